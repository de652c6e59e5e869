"""Adapters for how captured states travel from the worker that captured them to the generator's process."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import WORKER_MODULE

from vllm_compat import transport
from vllm_compat.adapter import Adapter

WRITER = transport.StatesWriter()  # one per worker process (only the rank that replies with states uses it)


class StatesThroughSharedMemory(Adapter):
    """Hand each call's captured states to the generator in shared memory that the returned tensors then own.

    What is slow (speculators' design, on every vLLM): ``_get_captured_states`` returns every captured tensor in the
    reply of ``collective_rpc``. vLLM pickles the reply through its worker message queue: a CUDA tensor is copied to
    the host, serialised, sent in chunks, rebuilt on the generator's own GPU and copied once more by speculators
    (``.clone().cpu()``). Measured on an H200 (vLLM 0.22, 4 layers x 2048 x bf16, 32768 tokens per call: 537 MB),
    that reply took 91 % of the extraction time.
    Where fixed: the worker extension's return value. The worker writes the call's states into a fresh shared-memory
    file and replies with a small handle; unpickling it in the generator's process yields the reply's usual
    structure (a list of per-layer tensors, or 0.4.0.1's dict of per-request lists) over a private mapping of that
    file, and speculators' ``.clone()`` of each state maps that state's own bytes privately (no copy). So every
    tensor ``generate()`` returns is an ordinary tensor owning exactly its bytes (vllm_compat.transport says how).
    For 0.4.0.1, whose reply groups the states per request, the worker copies each request's rows straight from the
    per-step captures into the file (``collect_per_request``: speculators' grouping, without its three copies of
    every state on the GPU). Where /dev/shm has no room (a container's default 64 MB), that call's states go through
    the RPC reply as before, with a warning.
    """

    id = "states-through-shared-memory"
    always = "speculators returns all captured states through the RPC reply (a speculators design cost)"
    target = WORKER_MODULE
    side = "worker"
    remove_when = "speculators hands states over outside the RPC reply"

    def apply(self, module: ModuleType) -> None:
        def collect(wrapped: Any, ext: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            direct = collect_per_request(ext)
            if direct is not None:
                return direct
            states = wrapped(*args, **kwargs)
            return pack(states) if states else states

        self.wrap(module, "HiddenStatesWorkerExtension._get_captured_states", collect)


def pack(states: Any, writer: transport.StatesWriter | None = None) -> Any:
    """``states`` (any nesting of tensors) written whole into a states file: its handle, or ``states`` itself where
    /dev/shm has no room."""
    spec, size, copies = transport.layout(states)
    handle = (writer or WRITER).write(spec, size, copies)
    return states if handle is None else handle


def collect_per_request(ext: Any, writer: transport.StatesWriter | None = None) -> transport.StatesHandle | None:
    """speculators 0.4.0.1's ``_get_captured_states``, written straight into a states file; None where not applicable.

    Same grouping as speculators': the captured rows of every step, concatenated per layer, are sliced by a running
    index over the steps' ``(request id, prefill tokens)`` metadata, and each request's slices are joined, layer by
    layer, in the order requests first appear. Here each slice is copied from the step's capture on the GPU into
    its place in the request's slot, so nothing is concatenated or cloned on the GPU. Returns None (and leaves
    everything to speculators' own method) unless the extension holds exactly 0.4.0.1's structures, or where
    /dev/shm has no room.
    """
    import torch

    captured = getattr(ext, "_captured_states", None)
    metadata = getattr(ext, "_request_metadata", None)
    if not (isinstance(captured, list) and captured and isinstance(metadata, list)):
        return None
    steps = len(captured[0])
    if not all(isinstance(layer, list) and len(layer) == steps for layer in captured):
        return None
    if not all(isinstance(t, torch.Tensor) for layer in captured for t in layer):
        return None
    first = captured[0][0]
    rows = [t.shape[0] for t in captured[0]]
    if any(t.shape[1:] != first.shape[1:] or t.dtype != first.dtype for layer in captured for t in layer):
        return None
    total = sum(rows)
    pieces: dict[str, list[tuple[int, int]]] = {}
    index = 0
    for step in metadata:
        for req_id, num_tok in step:
            start, end = min(index, total), min(index + num_tok, total)  # a slice past the end is short, as in torch
            pieces.setdefault(req_id, []).append((start, end))
            index += num_tok
    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + r)
    row_bytes = first[0].numel() * first.element_size() if first.dim() else first.element_size()
    dtype = str(first.dtype).removeprefix("torch.")
    spec: dict[str, list[transport.Slot]] = {}
    copies: list[transport.Copy] = []
    size = 0
    for req_id, parts in pieces.items():
        n = sum(end - start for start, end in parts)
        spec[req_id] = []
        for layer in captured:
            slot = transport.Slot(size, n * row_bytes, dtype, (n, *first.shape[1:]))
            spec[req_id].append(slot)
            size += transport.aligned(n * row_bytes)
            ranges = []  # (step, first row in the step, rows): the steps each global row range overlaps
            for start, end in parts:
                for s in range(steps):
                    lo, hi = max(start, offsets[s]), min(end, offsets[s + 1])
                    if lo < hi:
                        ranges.append((s, lo - offsets[s], hi - lo))
            copies.append((layer, slot, ranges))
    writer = writer or WRITER
    handle = writer.write(spec, size, copies)
    if handle is None:
        return None
    ext._captured_states = None  # what speculators' method clears after it collected
    ext._request_metadata = []
    writer.stats["direct"] = True
    return handle
