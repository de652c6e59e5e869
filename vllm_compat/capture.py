"""Lay one ``generate()`` call's captured states out, and put each step's rows in place while the steps run.

Why: speculators keeps every step's captured tensors on the GPU until the call ends, then groups rows by request
(0.4.0.1: by per-step metadata sorted in V1's batch order; 0.3.0: by input position, wrong once vLLM reorders or
chunks requests) and copies everything once more. Here the generator's process tells the workers, as the call
starts, which requests it holds and how long their prompts are (the *plan*); the worker lays the call out once
(layer-major: per requested layer, every request's rows in input order, so each request's state for a layer is one
contiguous range and 0.3.0's per-layer concatenation is that layer's whole range) and, at each step, routes the rows
of each request (in the model runner's row order, vllm_compat.batch_order) to their place. On a GPU the copies run on
a side stream, overlapped with the steps that follow; only the last step's copies remain when the call ends.

The destination is a slab of the hand-over (vllm_compat.transport) where ``states-through-shared-memory`` is applied,
ordinary host memory otherwise (the states then travel in the RPC reply, as speculators sends them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_compat import transport
from vllm_compat.batch_order import StepRows
from vllm_compat.errors import AdapterError

__all__ = ["SLABS", "CallCapture", "CallLayout", "Plan", "hand_over"]

logger = logging.getLogger("vllm_compat")

Plan = list[tuple[str, int]]  # (request id, prompt tokens) in input order, as speculators added them
SLABS = transport.Slabs()  # this worker's slabs (only the rank that captures uses them)
transport.when_released(SLABS.reclaim)  # a slab the caller lets go of is closed then, not at the next call


@dataclass(frozen=True)
class CallLayout:
    """Where every request's rows for every captured layer lie in the call's block."""

    plan: tuple[tuple[str, int], ...]
    layers: int
    row_shape: tuple[int, ...]
    dtype: Any
    row_bytes: int
    starts: dict[str, int]  # request id -> its first row in each layer's range
    total_rows: int
    layer_bytes: int  # each layer's range, aligned

    @classmethod
    def of(cls, plan: Plan, layers: int, sample: Any) -> CallLayout:
        starts: dict[str, int] = {}
        total = 0
        for rid, n in plan:
            if rid in starts:
                raise AdapterError(f"per-request-capture: request {rid} appears twice in the call's plan")
            starts[rid] = total
            total += n
        row_shape = tuple(sample.shape[1:])
        row_bytes = sample.element_size()
        for d in row_shape:
            row_bytes *= d
        return cls(
            tuple(plan), layers, row_shape, sample.dtype, row_bytes, starts, total, transport.aligned(total * row_bytes)
        )

    @property
    def size(self) -> int:
        return self.layers * self.layer_bytes

    def offset(self, layer: int, row: int) -> int:
        return layer * self.layer_bytes + row * self.row_bytes

    def slot(self, layer: int, first_row: int, rows: int) -> transport.Slot:
        dtype = str(self.dtype).removeprefix("torch.")
        return transport.Slot(self.offset(layer, first_row), rows * self.row_bytes, dtype, (rows, *self.row_shape))

    def reply_spec(self, line: str) -> tuple[Any, list[tuple[int, int]]]:
        """The reply's structure for speculators' ``line`` (Slots in place of tensors) and the pieces speculators
        will ``clone()``: 0.3.0 gets one tensor per layer (every request's rows, in input order) and slices it by
        prompt length; 0.4.0.1 gets, per request, one tensor per layer."""
        pieces = [
            (self.offset(j, self.starts[rid]), n * self.row_bytes) for j in range(self.layers) for rid, n in self.plan
        ]
        if line == "0.3.0":
            return [self.slot(j, 0, self.total_rows) for j in range(self.layers)], pieces
        return {rid: [self.slot(j, self.starts[rid], n) for j in range(self.layers)] for rid, n in self.plan}, pieces


class _Copier:
    """Copies rows of a step's captured tensors into a host block; on a GPU asynchronously, on a side stream.

    ``piece``: the block is registered with CUDA in pieces of this many bytes (0: in one, or not at all); a copy
    that would cross the border of two is split there, as the driver refuses one across registrations."""

    def __init__(self, block: Any, device: Any, piece: int = 0) -> None:
        import torch

        self.block = block
        self.piece = piece
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.pending: list[tuple[Any, list[Any]]] = []  # (event, the captured tensors it still reads)

    def copy(self, pieces: list[tuple[int, Any]], keep: list[Any]) -> None:
        """Copy each ``(offset, source)``: ``source`` (contiguous rows) to the block at ``offset``."""
        import torch

        if not self.cuda:
            for offset, src in pieces:
                self._copy(offset, src, keep, non_blocking=False)
            return
        self.pending = [(event, kept) for event, kept in self.pending if not event.query()]  # let finished go
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            for offset, src in pieces:
                self._copy(offset, src, keep, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pending.append((event, keep))  # the sources stay alive (and unreused) until their copies are done

    def _copy(self, offset: int, src: Any, keep: list[Any], non_blocking: bool) -> None:
        """``src`` to the block at ``offset``, as one copy or, across borders of the block's pieces, one a piece."""
        import torch

        ranges = transport.piece_ranges(offset, src.numel() * src.element_size(), self.piece)
        if len(ranges) == 1:
            self._dst(offset, src).copy_(src, non_blocking=non_blocking)
            return
        flat = src.contiguous().reshape(-1).view(torch.uint8)  # a view where src is contiguous (rows are)
        keep.append(flat)  # alive until its copies are done
        for at, n in ranges:
            self.block.narrow(0, at, n).copy_(flat.narrow(0, at - offset, n), non_blocking=non_blocking)

    def _dst(self, offset: int, src: Any) -> Any:
        nbytes = src.numel() * src.element_size()
        return self.block.narrow(0, offset, nbytes).view(src.dtype).view(src.shape)

    def finish(self) -> None:
        if self.cuda:
            self.stream.synchronize()
        self.pending.clear()


class CallCapture:
    """One call's capture in the worker that captures (tensor-parallel rank 0)."""

    def __init__(self, plan: Plan, line: str) -> None:
        self.plan = [(str(rid), int(n)) for rid, n in plan]
        self.line = line
        self.index = {rid: i for i, (rid, _) in enumerate(self.plan)}
        self.lengths = dict(self.plan)
        self.progress = dict.fromkeys(self.lengths, 0)
        self.layout: CallLayout | None = None
        self.slab: transport.Slab | None = None
        self.block: Any = None
        self.copier: _Copier | None = None
        self.stats: dict[str, Any] = {"overlapped_seconds": 0.0}
        SLABS.call_started()  # the plan comes before the first step: background slab work waits for the hand-over

    @property
    def stored(self) -> bool:
        return self.layout is not None

    def store(self, aux: list[Any], rows: StepRows) -> None:
        """Route one step's captured tensors (one per layer, rows in ``rows``' order) to their places."""
        started = time.perf_counter()
        if not aux:
            return
        if self.layout is None:
            self._start(aux)
        layout = self.layout
        assert layout is not None and self.copier is not None
        if len(aux) != layout.layers:
            raise AdapterError(f"per-request-capture: a step captured {len(aux)} layers, the call {layout.layers}")
        total = sum(n for _, n in rows)
        if any(h.shape[0] < total for h in aux):
            raise AdapterError(f"per-request-capture: captured {aux[0].shape[0]} rows for {total} scheduled tokens")
        runs: list[list[int]] = []  # [first source row, first destination row, rows]: merged where both continue
        at = 0
        for rid, n in rows:
            if rid not in self.lengths:
                raise AdapterError(f"per-request-capture: the step holds request {rid}, which is not in this call")
            done = self.progress[rid]
            take = max(0, min(n, self.lengths[rid] - done))  # prompt rows only (a decode token is not captured)
            if take:
                dst = layout.starts[rid] + done
                if runs and runs[-1][0] + runs[-1][2] == at and runs[-1][1] + runs[-1][2] == dst:
                    runs[-1][2] += take
                else:
                    runs.append([at, dst, take])
                self.progress[rid] = done + take
            at += n
        pieces = [(layout.offset(j, dst), h[src : src + k]) for j, h in enumerate(aux) for src, dst, k in runs]
        self.copier.copy(pieces, list(aux))
        self.stats["overlapped_seconds"] += time.perf_counter() - started

    def _start(self, aux: list[Any]) -> None:
        import torch

        self.layout = CallLayout.of(self.plan, len(aux), aux[0])
        size = self.layout.size
        if HAND_OVER is _rpc_reply:
            self.block = torch.empty(size, dtype=torch.uint8, pin_memory=aux[0].is_cuda)
        else:
            if aux[0].is_cuda and SLABS.device is None:  # no slab made ahead: pin for the device the states are on
                SLABS.device = aux[0].device.index
            self.slab, taken = SLABS.take(max(size, 1))
            self.block = self.slab.block
            self.stats.update(taken, slab_reused=not taken["made_now"])
        self.copier = _Copier(self.block, aux[0].device, self.slab.piece if self.slab is not None else 0)

    def finish(self) -> tuple[Any, list[tuple[int, int]]]:
        """Wait for the last copies; check every request got its whole prompt: the reply's spec and pieces."""
        assert self.layout is not None and self.copier is not None
        self.copier.finish()
        short = [(rid, self.progress[rid], n) for rid, n in self.plan if self.progress[rid] != n]
        if short:
            rid, got, n = short[0]
            raise AdapterError(
                f"per-request-capture: request {rid} has {got} captured rows for a {n}-token prompt "
                f"({len(short)} request(s) short; was one aborted before its prefill finished?)"
            )
        return self.layout.reply_spec(self.line)

    def release(self) -> None:
        """After a failure: the slab goes back to the pool unused."""
        if self.copier is not None:
            self.copier.finish()
        if self.slab is not None:
            self.slab.busy = False
        SLABS.call_ended()
        self.slab = self.block = self.copier = None


def _rpc_reply(call: CallCapture) -> Any:
    """The states themselves, each tensor its own ordinary copy: vLLM pickles them into the RPC reply."""
    spec, _pieces = call.finish()
    block = call.block
    call.block = None
    return transport.map_slots(spec, transport.Slot, lambda slot: transport.slot_view(block, slot).clone())


HAND_OVER: Callable[[CallCapture], Any] = _rpc_reply  # states-through-shared-memory points it at the slab's hand-over


def hand_over(call: CallCapture) -> Any:
    """The reply to ``_get_captured_states`` for the call: a states handle, or the states themselves."""
    started = time.perf_counter()
    try:
        reply = HAND_OVER(call)
    except BaseException:
        call.release()
        raise
    finally:
        SLABS.call_ended()  # the call's steps are done: the slabs' background driver work may run
    layout = call.layout
    direct = HAND_OVER is not _rpc_reply
    transport.record_stats(
        bytes=layout.size if layout else 0,
        seconds=time.perf_counter() - started,
        direct=direct,
        **call.stats,
        **(SLABS.history() if direct else {}),
    )
    return reply
