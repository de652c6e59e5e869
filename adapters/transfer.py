"""Adapters for how captured states travel from the worker that captured them to the generator's process."""

from __future__ import annotations

import atexit
import contextlib
import logging
import mmap
import os
import struct
import threading
import time
import uuid
import weakref
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
    """Hand each call's captured states to the generator in shared memory that its results then own.

    What is slow (speculators' design, on every vLLM): ``_get_captured_states`` returns every captured tensor in the
    reply of ``collective_rpc``. vLLM pickles the reply through its worker message queue: a CUDA tensor is copied to
    the host, serialised, sent in chunks, rebuilt on the generator's own GPU and copied once more by speculators
    (``.clone().cpu()``). Measured on an H200 (vLLM 0.22, 4 layers x 2048 x bf16, 32768 tokens per call: 537 MB),
    that reply took 91 % of the extraction time; with the states in a reused shared arena, speculators' own copy
    out of it (537 MB of new memory, on one thread) still took a third.
    Where fixed: the worker extension's return value. The worker keeps a pool of shared-memory segments, each
    mapped and registered with CUDA as pinned memory once. A call's states go into a free segment (one DMA from
    the GPU) and the reply carries a small handle; unpickling it in the generator's process yields the reply's usual
    structure (a list of per-layer tensors, or 0.4.0.1's dict of per-request lists) as tensors over that segment.
    They hold it until the last of them is dropped; then the segment is free and the worker reuses it. So the
    tensors are the caller's alone, and speculators' ``.clone()`` of them hands that memory over instead of
    copying it (``HandedOverStates``). After each call a worker thread keeps one free segment of that size ready
    (allocated and pinned while the GPU runs the next batch). Values are bit-identical; the reply's shape is
    unchanged. For 0.4.0.1, whose reply groups the states per request, the worker copies each request's rows
    straight from the per-step captures into the segment (``collect_per_request``: speculators' grouping, without
    its three copies of every state on the GPU), so the states of a call occupy the GPU once, not up to four times.
    A segment's name is removed as soon as the generator's process has mapped it, and a spare's when the worker
    exits, so nothing is left in /dev/shm. Where /dev/shm has no room (a container's default 64 MB), that call's
    states go through the RPC reply as before, with a warning.
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


_HEADER = 64  # a segment starts with its state (int64); a call's states follow
_FREE, _IN_USE, _RETIRED = 0, 1, 2  # written by the worker, except IN_USE -> FREE: the generator, when let go


class _Segment:
    """A file in /dev/shm, mapped (and pinned for CUDA) in the worker for as long as the worker keeps it."""

    def __init__(self, path: str, size: int, mapping: mmap.mmap, block: Any, device: int | None) -> None:
        self.path = path
        self.size = size
        self.mapping: Any = mapping
        self.block: Any = block  # uint8 tensor over the whole mapping (it keeps the mapping alive)
        self.device = device
        self.pinned = False

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
            os.unlink(path)
            return f"{SHM_DIR} has {_free_bytes() / 2**20:.0f} MiB free ({exc.strerror})"
        finally:
            os.close(fd)
        import torch

        segment = cls(path, size, mapping, torch.frombuffer(mapping, dtype=torch.uint8), device)
        segment.pinned = device is not None and _pin(segment.block, device)
        return segment

    @property
    def state(self) -> int:
        return _state(self.mapping)

    @state.setter
    def state(self, value: int) -> None:
        struct.pack_into("q", self.mapping, 0, value)

    def retire(self) -> None:
        """Give the segment up: its name goes, and its memory once the generator's process drops its mapping."""
        self.state = _RETIRED
        if self.pinned:
            _unpin(self.block, self.device)
        self.block = self.mapping = None  # the last references: the mapping goes with them
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a spare never handed over still has its name


class _Segments:
    """A worker's pool of segments: one per call whose states the generator still holds, and one spare.

    A segment is filled by the worker, handed over, and free again once the generator's process has dropped every
    tensor of that call (its finalizer writes the state). A free one is reused as it is: mapped and pinned, so a
    call pays one DMA and no allocation. After each hand-over a thread makes sure one free segment of the call's
    size is ready (allocated, mapped and pinned while the GPU runs the next batch) and retires other free ones.
    """

    def __init__(self) -> None:
        self.pool: list[_Segment] = []
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.stats: dict[str, Any] = {}
        self._exit_hook = False

    def take(self, size: int, device: int | None) -> _Segment | None:
        """A free segment of at least ``size`` bytes, marked in use; None where /dev/shm has no room."""
        started = time.perf_counter()
        segment = self._claim(size, device)
        if segment is None and self.thread is not None:  # the spare may be on its way
            self.thread.join()
            segment = self._claim(size, device)
        waited = time.perf_counter() - started
        made = segment is None
        if segment is None:
            _remove_orphans()
            made_size = _round(size + size // 4, _STEP)  # headroom: a somewhat longer call still fits
            new = _Segment.create(made_size, device)
            if isinstance(new, str):
                _no_room(new, size)
                return None
            new.state = _IN_USE
            # On the first call the spare is made now as well: made by the thread, it would not be ready for the
            # second call, which would wait for it.
            spare = _Segment.create(made_size, device) if not self.pool else None
            with self.lock:
                self.pool.append(new)
                if isinstance(spare, _Segment):
                    self.pool.append(spare)
            segment = new
        if not self._exit_hook:
            atexit.register(self.close)
            self._exit_hook = True
        self.stats = {
            "reused": not made,
            "waited_seconds": waited,
            "make_seconds": time.perf_counter() - started - waited if made else 0.0,
            "segment_bytes": segment.size,
            "pool_segments": len(self.pool),
        }
        return segment

    def _claim(self, size: int, device: int | None) -> _Segment | None:
        with self.lock:
            free = [s for s in self.pool if s.device == device and s.size >= size and s.state == _FREE]
            if not free:
                return None
            segment = min(free, key=lambda s: s.size)
            segment.state = _IN_USE
            return segment

    def keep_a_spare(self, size: int, device: int | None) -> None:
        """In a thread: one free segment of at least ``size`` bytes ready for the next call; other free ones go."""
        if self.thread is not None and self.thread.is_alive():
            return

        def tidy() -> None:
            try:
                if device is not None:
                    import torch

                    torch.cuda.set_device(device)  # this thread's CUDA calls go to the worker's device
                with self.lock:
                    free = [s for s in self.pool if s.state == _FREE]
                    fitting = [s for s in free if s.device == device and s.size >= size]
                    spare = min(fitting, key=lambda s: s.size) if fitting else None
                    extra = [s for s in free if s is not spare]
                    self.pool = [s for s in self.pool if s not in extra]
                for s in extra:
                    s.retire()
                if spare is None:
                    new = _Segment.create(_round(size + size // 4, _STEP), device)
                    if isinstance(new, _Segment):
                        with self.lock:
                            self.pool.append(new)
            except Exception:  # the next call makes its segment itself (and says so if that fails too)
                logger.debug("states-through-shared-memory: preparing a spare segment failed", exc_info=True)

        self.thread = threading.Thread(target=tidy, name="vllm_compat_states", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """At exit: retire the free segments (those in use are the generator's until it drops them)."""
        if self.thread is not None:
            self.thread.join(timeout=30)
        with self.lock:
            free = [s for s in self.pool if s.state == _FREE]
            self.pool = [s for s in self.pool if s not in free]
        for s in free:
            s.retire()


_SEGMENTS = _Segments()  # one per worker process (only the rank that captures states uses it)


def _state(mapping: Any) -> int:
    return struct.unpack_from("q", mapping, 0)[0]


def _round(n: int, step: int) -> int:
    return max(-(-n // step) * step, step)


class SharedStates:
    """A picklable handle to one call's states in a segment; unpickling maps it and yields the tensors themselves."""

    def __init__(self, path: str, size: int, spec: Any) -> None:
        self.path = path
        self.size = size  # the segment's size, what the generator's process maps
        self.spec = spec  # the original structure with every tensor replaced by a _Slot

    @classmethod
    def pack(cls, states: Any, segments: _Segments | None = None) -> Any:
        """Copy ``states`` into a segment and return a handle, or ``states`` itself where /dev/shm has no room."""
        import torch

        tensors: list[Any] = []

        def index(t: Any) -> _Index:
            tensors.append(t)
            return _Index(len(tensors) - 1)

        layout = _replace(states, torch.Tensor, index)
        slots, size = [], _HEADER
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            slots.append(_Slot(size, nbytes, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
            size += _round(nbytes, _ALIGN)
        spec = _replace(layout, _Index, lambda i: slots[i.i])
        copies = [(t, slot, []) for t, slot in zip(tensors, slots, strict=True)]  # whole tensors: one copy each
        handle = _copy_in(segments or _SEGMENTS, size, spec, copies, len(tensors))
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
    size = _HEADER
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
    segment = segments.take(size, device)
    if segment is None:
        return None
    async_ok = segment.pinned
    try:
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
    except BaseException:
        segment.state = _FREE  # never handed over: back to the pool
        raise
    segments.keep_a_spare(size, device)
    segments.stats.update(
        {"bytes": size, "tensors": count, "seconds": time.perf_counter() - started, "pinned": async_ok}
    )
    return SharedStates(segment.path, segment.size, spec)


def _view(block: Any, slot: _Slot) -> Any:
    import torch

    return block.narrow(0, slot.offset, slot.nbytes).view(getattr(torch, slot.dtype)).view(slot.shape)


_MAPPED: dict[str, Any] = {}  # in the generator's process: segment path -> its mapping, while the worker keeps it


def _unpack(path: str, size: int, spec: Any) -> Any:
    """In the generator's process: the call's tensors, over the segment (mapped on first sight, then reused).

    The tensors hold a lease on the segment: when the last of them is dropped, the segment is marked free and the
    worker reuses it. Until then it is this call's alone, so the tensors are ``HandedOverStates``: speculators'
    ``.clone()`` of them is the plain tensor over the same memory, not a second copy.
    """
    import torch

    _forget_retired()
    mapping = _MAPPED.get(path)
    if mapping is None:
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # both processes keep their mappings; no name is left behind
        _MAPPED[path] = mapping
    lease = memoryview(mapping)
    weakref.finalize(lease, _let_go, mapping).atexit = False
    block = torch.frombuffer(lease, dtype=torch.uint8)  # every tensor of the call holds the lease
    handed = handed_over_type()
    return _replace(spec, _Slot, lambda slot: _view(block, slot).as_subclass(handed))


def _replace(obj: Any, kind: type, replace: Any) -> Any:
    """``obj`` with every ``kind`` inside it (through dicts, lists and tuples) replaced by ``replace(it)``.

    A module-level function, not a recursive closure: a closure that calls itself is a reference cycle, and one
    holding the call's tensors would keep them (and their segment, or their GPU memory) until the garbage collector
    runs instead of until they are dropped.
    """
    if isinstance(obj, kind):
        return replace(obj)
    if isinstance(obj, dict):
        return {k: _replace(v, kind, replace) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_replace(v, kind, replace) for v in obj)
    return obj


def _let_go(mapping: Any) -> None:
    """The last tensor of a call is gone: its segment is free for the worker's next call."""
    if _state(mapping) == _IN_USE:
        struct.pack_into("q", mapping, 0, _FREE)


def _forget_retired() -> None:
    """Drop this process's mappings of segments their worker gave up (or of workers that are gone)."""
    for path, mapping in list(_MAPPED.items()):
        if _state(mapping) == _RETIRED or not _alive(_owner(path)):
            del _MAPPED[path]  # unmapped once no tensor uses it


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
