"""Adapters for how captured states travel from the worker that captured them to the generator's process."""

from __future__ import annotations

import atexit
import contextlib
import logging
import mmap
import os
import threading
import time
import uuid
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import WORKER_MODULE

from vllm_compat.adapter import Adapter

logger = logging.getLogger("vllm_compat")

SHM_DIR = "/dev/shm"  # POSIX shared memory on Linux, where vLLM runs
PREFIX = "vllm_compat_states_"
_ALIGN = 64  # every tensor starts on a 64-byte boundary: aligned for any dtype and for vectorised copies
_STEP = 2 << 20  # segment sizes are whole 2 MiB pages (huge-page friendly)
_PAGE = mmap.PAGESIZE
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # map every page up front: no page faults while copying


class StatesThroughSharedMemory(Adapter):
    """Hand each call's captured states to the generator in fresh shared memory, prepared while the GPU works.

    What is slow (speculators' design, on every vLLM): ``_get_captured_states`` returns every captured tensor in the
    reply of ``collective_rpc``. vLLM pickles the reply through its worker message queue: a CUDA tensor is copied to
    the host, serialised, sent in chunks, rebuilt on the generator's own GPU and copied once more by speculators
    (``.clone().cpu()``). Measured on an H200 (vLLM 0.22, 4 layers x 2048 x bf16, 32768 tokens per call: 537 MB),
    that reply took 91 % of the extraction time; with the states in a reused shared arena, speculators' own copy
    out of it (page faults of 537 MB of new memory, on one thread) still took a third.
    Where fixed: the worker extension's return value. Each call's states go into a shared-memory segment of their
    own, which becomes the memory of the tensors ``generate()`` returns: the worker copies the states into it (one
    DMA from the GPU: the segment is registered with CUDA as pinned memory) and returns a small handle; unpickling
    the handle in the generator's process maps the segment and yields the reply's usual structure (a list of
    per-layer tensors, or 0.4.0.1's dict of per-request lists). These tensors are speculators' alone, so its
    ``.clone()`` of them hands over that memory instead of copying it again (``HandedOverStates``). The next
    call's segment is allocated, zeroed by the kernel, mapped and pinned by a worker thread while the GPU runs
    the next batch, so no call waits for memory. Values are bit-identical; the reply's shape is unchanged.
    For 0.4.0.1, whose reply groups the states per request, the worker copies each request's rows straight from
    the per-step captures into the segment (``collect_per_request``: speculators' grouping, without its three
    copies of every state on the GPU), so the states of a call occupy the GPU once instead of up to four times.
    A segment's name is removed as soon as the generator's process has mapped it, so nothing is left in /dev/shm
    when either process ends; its memory is freed when the last tensor of that call is dropped. Where /dev/shm has
    no room (a container's default 64 MB), that call's states go through the RPC reply as before, with a warning.
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
            return SharedStates.pack(states) if states else states

        self.wrap(module, "HiddenStatesWorkerExtension._get_captured_states", collect)


@dataclass(frozen=True)
class _Slot:
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Index:
    i: int


class _Segment:
    """One call's states: a file in /dev/shm, mapped in the worker (and pinned for CUDA) until they are copied in."""

    def __init__(self, path: str, fd: int, size: int, block: Any, device: int | None, pinned: bool) -> None:
        self.path = path
        self.fd = fd
        self.size = size
        self.block: Any = block  # uint8 tensor over the worker's mapping (the mapping lives as long as it does)
        self.device = device
        self.pinned = pinned

    @classmethod
    def create(cls, size: int, device: int | None) -> _Segment | str:
        """A new segment of ``size`` bytes, pinned for ``device`` where one is given; or why there is none."""
        path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}_{uuid.uuid4().hex}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            return f"cannot create a file in {SHM_DIR} ({exc.strerror})"
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS on the first write past the limit
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            return f"{SHM_DIR} has {_free_bytes() / 2**20:.0f} MiB free ({exc.strerror})"
        import torch

        block = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping; unmapped when the tensor goes
        pinned = device is not None and _pin(block, device)
        return cls(path, fd, size, block, device, pinned)

    def release(self, keep: int) -> None:
        """Drop the worker's hold on a filled segment: unpin, unmap, and cut the file to the ``keep`` bytes used."""
        if self.block is None:
            return
        if self.pinned:
            _unpin(self.block, self.device)
        self.block = None  # the last reference: the mapping goes with it
        if keep < self.size:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, keep)  # the unused tail returns to /dev/shm
        os.close(self.fd)

    def discard(self) -> None:
        """Remove a segment that was never handed over."""
        self.release(0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class _Segments:
    """A worker's supply of segments: one is filled per call; the next is prepared in a thread meanwhile."""

    def __init__(self) -> None:
        self.ready: _Segment | None = None  # prepared for the next call
        self.worker: threading.Thread | None = None
        self.handed = ""  # the last segment handed over (its name is removed once the generator mapped it)
        self.stats: dict[str, Any] = {}
        self._exit_hook = False

    def take(self, size: int, device: int | None) -> _Segment | None:
        """A segment of at least ``size`` bytes: the prepared one where it fits, else a new one; None if no room."""
        started = time.perf_counter()
        if self.worker is not None:
            self.worker.join()
            self.worker = None
        waited = time.perf_counter() - started
        if self.handed:  # the generator never mapped it (its process failed between calls): do not leave it behind
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.handed)
            self.handed = ""
        segment, self.ready = self.ready, None
        if segment is not None and (segment.size < size or segment.device != device):
            segment.discard()
            segment = None
        prepared = segment is not None
        if segment is None:
            _remove_orphans()
            made = _Segment.create(_round(size, _STEP), device)
            if isinstance(made, str):
                _no_room(made, size)
                return None
            segment = made
        if not self._exit_hook:
            atexit.register(self.close)
            self._exit_hook = True
        self.stats = {"prepared": prepared, "waited_seconds": waited, "segment_bytes": segment.size}
        return segment

    def hand_over(self, segment: _Segment, used: int) -> int:
        """The segment is filled with ``used`` bytes: release it and prepare the next one in a thread.

        Returns the length the generator's process maps (``used``, whole pages).
        """
        keep = _round(used, _PAGE)
        self.handed = segment.path
        next_size = _round(used + used // 4, _STEP)  # 25 % headroom: a somewhat longer next call still fits

        def prepare() -> None:
            try:
                if segment.device is not None:
                    import torch

                    torch.cuda.set_device(segment.device)  # this thread's CUDA calls go to the worker's device
                segment.release(keep)
                made = _Segment.create(next_size, segment.device)
                self.ready = made if isinstance(made, _Segment) else None  # no room now: the next call tries again
            except Exception:  # the next call makes its segment itself (and says so if that fails too)
                logger.debug("states-through-shared-memory: preparing the next segment failed", exc_info=True)

        self.worker = threading.Thread(target=prepare, name="vllm_compat_states", daemon=True)
        self.worker.start()
        return keep

    def close(self) -> None:
        """At exit: remove the prepared segment (a handed-over one is the generator's)."""
        if self.worker is not None:
            self.worker.join(timeout=10)
        if self.ready is not None:
            self.ready.discard()
            self.ready = None


_SEGMENTS = _Segments()  # one per worker process (only the rank that captures states uses it)


def _round(n: int, step: int) -> int:
    return max(-(-n // step) * step, step)


class SharedStates:
    """A picklable handle to one call's states in a segment; unpickling maps it and yields the tensors themselves."""

    def __init__(self, path: str, size: int, spec: Any) -> None:
        self.path = path
        self.size = size  # the bytes to map (whole pages)
        self.spec = spec  # the original structure with every tensor replaced by a _Slot

    @classmethod
    def pack(cls, states: Any, segments: _Segments | None = None) -> Any:
        """Copy ``states`` into a segment and return a handle, or ``states`` itself where /dev/shm has no room."""
        import torch

        tensors: list[Any] = []

        def describe(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                tensors.append(obj)
                return _Index(len(tensors) - 1)
            if isinstance(obj, dict):
                return {k: describe(v) for k, v in obj.items()}
            if isinstance(obj, list | tuple):
                return type(obj)(describe(v) for v in obj)
            return obj

        layout = describe(states)
        slots, size = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            slots.append(_Slot(size, nbytes, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
            size += _round(nbytes, _ALIGN)

        def fill(obj: Any) -> Any:
            if isinstance(obj, _Index):
                return slots[obj.i]
            if isinstance(obj, dict):
                return {k: fill(v) for k, v in obj.items()}
            if isinstance(obj, list | tuple):
                return type(obj)(fill(v) for v in obj)
            return obj

        copies = [(t, slot, []) for t, slot in zip(tensors, slots, strict=True)]  # whole tensors: one copy each
        handle = _copy_in(segments or _SEGMENTS, size, fill(layout), copies, len(tensors))
        return states if handle is None else handle

    def __reduce__(self) -> tuple[Any, tuple[str, int, Any]]:
        return (_unpack, (self.path, self.size, self.spec))


def collect_per_request(ext: Any, segments: _Segments | None = None) -> SharedStates | None:
    """speculators 0.4.0.1's ``_get_captured_states``, written straight into a segment; None where it does not apply.

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
    spec: dict[str, list[_Slot]] = {}
    copies: list[tuple[Any, _Slot, list[tuple[int, int, int]]]] = []
    size = 0
    for req_id, parts in pieces.items():
        n = sum(end - start for start, end in parts)
        spec[req_id] = []
        for layer in captured:
            slot = _Slot(size, n * row_bytes, dtype, (n, *first.shape[1:]))
            spec[req_id].append(slot)
            size += _round(n * row_bytes, _ALIGN)
            ranges = []  # (step, first row in the step, rows): the steps each global row range overlaps
            for start, end in parts:
                for s in range(steps):
                    lo, hi = max(start, offsets[s]), min(end, offsets[s + 1])
                    if lo < hi:
                        ranges.append((s, lo - offsets[s], hi - lo))
            copies.append((layer, slot, ranges))
    segments = segments or _SEGMENTS
    handle = _copy_in(segments, size, spec, copies, len(spec) * len(captured))
    if handle is None:
        return None
    ext._captured_states = None  # what speculators' method clears after it collected
    ext._request_metadata = []
    segments.stats["direct"] = True
    return handle


def _copy_in(segments: _Segments, size: int, spec: Any, copies: list[tuple[Any, _Slot, list]], count: int) -> Any:
    """Fill a segment: each ``(source, slot, ranges)`` copies ``source`` whole (no ranges) or the listed
    ``(step, row, rows)`` pieces of ``source[step]``, in order; one wait per device at the end. None: no room."""
    import torch

    started = time.perf_counter()
    sources = [t for src, _, ranges in copies for t in (src if ranges else [src])]  # ranges: src is a step list
    devices = {t.device for t in sources if t.is_cuda}
    device = next(iter(devices)).index if devices else None
    segment = segments.take(max(size, _ALIGN), device)
    if segment is None:
        return None
    async_ok = segment.pinned
    for src, slot, ranges in copies:
        if not slot.nbytes:
            continue
        dst = _view(segment.block, slot)
        if not ranges:
            dst.copy_(src.detach(), non_blocking=async_ok and src.is_cuda)
            continue
        at = 0
        for step, row, n in ranges:
            piece = src[step][row : row + n]
            dst[at : at + n].copy_(piece.detach(), non_blocking=async_ok and piece.is_cuda)
            at += n
    for d in devices:
        torch.cuda.current_stream(d).synchronize()
    path = segment.path
    keep = segments.hand_over(segment, size)
    segments.stats.update(
        {"bytes": size, "tensors": count, "seconds": time.perf_counter() - started, "pinned": async_ok}
    )
    return SharedStates(path, keep, spec)


def _view(block: Any, slot: _Slot) -> Any:
    import torch

    return block.narrow(0, slot.offset, slot.nbytes).view(getattr(torch, slot.dtype)).view(slot.shape)


def _unpack(path: str, size: int, spec: Any) -> Any:
    """In the generator's process: map the call's segment, remove its name, and return its tensors.

    The memory is this call's alone (the worker let go of it), so the tensors are ``HandedOverStates``:
    speculators' ``.clone()`` of them is the plain tensor over the same memory, not a second copy.
    """
    import torch

    fd = os.open(path, os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # the mapping keeps the memory; no name is left behind
    block = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensors keep the mapping; it goes with the last one
    handed = handed_over_type()

    def build(obj: Any) -> Any:
        if isinstance(obj, _Slot):
            return _view(block, obj).as_subclass(handed)
        if isinstance(obj, dict):
            return {k: build(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(build(v) for v in obj)
        return obj

    return build(spec)


_HANDED: list[type] = []


def handed_over_type() -> type:
    """``HandedOverStates``, a ``torch.Tensor`` subclass made on first use (importing this module needs no torch)."""
    if _HANDED:
        return _HANDED[0]
    import torch

    class HandedOverStates(torch.Tensor):
        """States in memory that belongs to this call's results alone: ``clone()`` hands it over, uncopied.

        speculators copies each returned state once (``h.clone().cpu()``, after slicing it by request on 0.3.0)
        because the RPC reply's tensors were not its own. These are, so that copy would only cost time: ``clone()``
        returns a plain tensor over the same memory. Indexing keeps the type; every other operation returns plain
        tensors and copies as usual.
        """

        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func is torch.Tensor.clone and len(args) == 1 and not kwargs:
                with torch._C.DisableTorchFunctionSubclass():
                    return args[0].as_subclass(torch.Tensor)
            if func is torch.Tensor.__getitem__:
                return super().__torch_function__(func, types, args, kwargs)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)

    HandedOverStates.__module__, HandedOverStates.__qualname__ = __name__, "HandedOverStates"  # picklable by name
    _HANDED.append(HandedOverStates)
    return HandedOverStates


def __getattr__(name: str) -> Any:
    if name == "HandedOverStates":  # found by name when one is unpickled
        return handed_over_type()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _owner(path: str) -> int:
    """The pid of the worker that created a segment (from its name)."""
    name = os.path.basename(path).removeprefix(PREFIX)
    try:
        return int(name.split("_", 1)[0])
    except ValueError:
        return -1


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_orphans() -> None:
    """Remove segments of workers that died before the generator mapped them (the only way one is left behind)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(SHM_DIR):
            if name.startswith(PREFIX) and not _alive(_owner(name)):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(SHM_DIR, name))


_WARNED: list[bool] = []


def _no_room(why: str, size: int) -> bool:
    """Say once (later calls at debug level) that states take the slow path, and why."""
    log = logger.debug if _WARNED else logger.warning
    _WARNED.append(True)
    log(
        "states-through-shared-memory: %s; a call's captured states need %.0f MiB. They go through vLLM's message "
        "queue instead (slower). Give the container more shared memory (e.g. docker run --shm-size=16g).",
        why,
        max(size / 2**20, 0.1),
    )
    return False


def _free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _pin(block: Any, device: int) -> bool:
    """Register the mapping with CUDA (page-locked), so copies from the GPU are asynchronous DMAs."""
    import torch

    try:
        with torch.cuda.device(device):
            result = torch.cuda.cudart().cudaHostRegister(block.data_ptr(), block.numel(), 0)
    except Exception as exc:  # no CUDA runtime binding here: copies still work, synchronously
        logger.debug("states-through-shared-memory: cannot pin a segment (%r)", exc)
        return False
    ok = int(getattr(result, "value", result)) == 0
    if not ok:
        logger.debug("states-through-shared-memory: cudaHostRegister returned %s; segment left pageable", result)
    return ok


def _unpin(block: Any, device: int | None) -> None:
    import torch

    with contextlib.suppress(Exception), torch.cuda.device(device):
        torch.cuda.cudart().cudaHostUnregister(block.data_ptr())
