"""Adapters for how captured states travel from the worker that captured them to the generator's process."""

from __future__ import annotations

import contextlib
import logging
import os
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
_STEP = 2 << 20  # arena sizes are whole 2 MiB pages (huge-page friendly)


class StatesThroughSharedMemory(Adapter):
    """Hand the captured states to the generator through a reused, pinned shared-memory arena.

    What is slow (speculators' design, on every vLLM): ``_get_captured_states`` returns every captured tensor in the
    reply of ``collective_rpc``. vLLM pickles the reply through its worker message queue: a CUDA tensor is copied to
    the host, serialised, sent in chunks, rebuilt on the generator's own GPU and copied back to the host by
    speculators (``.clone().cpu()``). Measured on an H200 (vLLM 0.22, 4 layers x 2048 x bf16, 32768 tokens per call:
    537 MB), that reply took 91 % of the extraction time.
    Where fixed: the worker extension's return value. Each worker process keeps one shared-memory arena, reused by
    every call and registered with CUDA as pinned memory, so the copy from the GPU is one DMA at full bus speed
    and no call pays page faults. The worker copies the states into it and returns a small handle; unpickling the
    handle in the generator's process yields the same structure (a list of per-layer tensors, or 0.4.0.1's dict of
    per-request lists) as host tensors viewing the arena, which speculators copies out at once as it always did
    (``.clone().cpu()``). Values are bit-identical; the reply's shape is unchanged for speculators.
    For 0.4.0.1, whose reply groups the states per request, the worker copies each request's rows straight from
    the per-step captures into the arena (``collect_per_request``: speculators' grouping, without its three copies
    of every state on the GPU: the concatenation, the per-request slices and their concatenation), so the states
    of a call occupy the GPU once instead of up to four times.
    The views are valid until the worker's next ``_get_captured_states``: both speculators lines copy them before
    ``generate()`` returns. The arena's name is removed as soon as the generator's process has mapped it, so
    nothing is left in /dev/shm when either process ends. Where /dev/shm has no room for a call's states (a
    container's default 64 MB), that call's states go through the RPC reply as before, with a warning.
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


class _Arena:
    """A worker's shared-memory file, mapped once, pinned for CUDA where possible, grown on demand, never shrunk."""

    def __init__(self) -> None:
        self.path = ""
        self.size = 0
        self.block: Any = None  # uint8 tensor over the whole mapping
        self.pinned = False
        self.stats: dict[str, Any] = {}

    def reserve(self, size: int, want_pinned: bool) -> bool:
        """Make room for ``size`` bytes; False (and a warning) where /dev/shm cannot hold them."""
        if size <= self.size:
            return True
        need, size = size, -(-(size + size // 4) // _STEP) * _STEP  # 25 % headroom: a little more next call fits
        self.close()
        _remove_orphans()
        path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}_{uuid.uuid4().hex}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            return _no_room(f"cannot create a file in {SHM_DIR} ({exc.strerror})", need)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS on the first write past the limit
        except OSError as exc:
            os.unlink(path)
            return _no_room(f"{SHM_DIR} has {_free_bytes() / 2**20:.0f} MiB free ({exc.strerror})", need)
        finally:
            os.close(fd)
        import torch

        self.block = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self.path, self.size = path, size
        self.pinned = want_pinned and _pin(self.block)
        logger.debug("states-through-shared-memory: arena %s, %d MiB, pinned=%s", path, size >> 20, self.pinned)
        return True

    def close(self) -> None:
        if self.block is None:
            return
        if self.pinned:
            _unpin(self.block)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # usually gone already: the generator's process removes it once mapped
        self.block, self.path, self.size, self.pinned = None, "", 0, False


_ARENA = _Arena()  # one per worker process (only the rank that captures states creates it)


class SharedStates:
    """A picklable handle to tensors in a worker's arena; unpickling yields the tensors themselves (views)."""

    def __init__(self, path: str, size: int, spec: Any) -> None:
        self.path = path
        self.size = size
        self.spec = spec  # the original structure with every tensor replaced by a _Slot

    @classmethod
    def pack(cls, states: Any, arena: _Arena | None = None) -> Any:
        """Copy ``states`` into the arena and return a handle, or ``states`` itself where the arena has no room."""
        import torch

        arena = arena or _ARENA
        start = time.perf_counter()
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
            size += -(-nbytes // _ALIGN) * _ALIGN
        cuda = {t.device for t in tensors if t.is_cuda}
        if not arena.reserve(max(size, _ALIGN), want_pinned=bool(cuda)):
            return states
        for t, slot in zip(tensors, slots, strict=True):
            if slot.nbytes:
                # into pinned memory a copy from the GPU is an asynchronous DMA; one wait per device below
                _view(arena.block, slot).copy_(t.detach(), non_blocking=arena.pinned and t.is_cuda)
        for device in cuda:
            torch.cuda.current_stream(device).synchronize()
        arena.stats = {
            "bytes": size,
            "tensors": len(tensors),
            "seconds": time.perf_counter() - start,
            "pinned": arena.pinned,
            "arena_bytes": arena.size,
        }

        def fill(obj: Any) -> Any:
            if isinstance(obj, _Index):
                return slots[obj.i]
            if isinstance(obj, dict):
                return {k: fill(v) for k, v in obj.items()}
            if isinstance(obj, list | tuple):
                return type(obj)(fill(v) for v in obj)
            return obj

        return cls(arena.path, arena.size, fill(layout))

    def __reduce__(self) -> tuple[Any, tuple[str, int, Any]]:
        return (_unpack, (self.path, self.size, self.spec))


def collect_per_request(ext: Any, arena: _Arena | None = None) -> SharedStates | None:
    """speculators 0.4.0.1's ``_get_captured_states``, written straight into the arena; None where it does not apply.

    Same grouping as speculators': the captured rows of every step, concatenated per layer, are sliced by a running
    index over the steps' ``(request id, prefill tokens)`` metadata, and each request's slices are joined, layer by
    layer, in the order requests first appear. Here each slice is copied from the step's capture on the GPU into
    its place in the request's slot, so nothing is concatenated or cloned on the GPU. Returns None (and leaves
    everything to speculators' own method) unless the extension holds exactly 0.4.0.1's structures, or where the
    arena has no room.
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
    arena = arena or _ARENA
    start_time = time.perf_counter()
    row_bytes = first[0].numel() * first.element_size() if first.dim() else first.element_size()
    dtype = str(first.dtype).removeprefix("torch.")
    spec: dict[str, list[_Slot]] = {}
    size = 0
    for req_id, parts in pieces.items():
        n = sum(end - start for start, end in parts)
        spec[req_id] = []
        for _ in captured:
            spec[req_id].append(_Slot(size, n * row_bytes, dtype, (n, *first.shape[1:])))
            size += -(-n * row_bytes // _ALIGN) * _ALIGN
    cuda = {t.device for layer in captured for t in layer if t.is_cuda}
    if not arena.reserve(max(size, _ALIGN), want_pinned=bool(cuda)):
        return None
    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + r)
    for req_id, parts in pieces.items():
        for layer, slot in zip(captured, spec[req_id], strict=True):
            dst = _view(arena.block, slot)
            at = 0
            for start, end in parts:
                for s in range(steps):  # the steps this global row range overlaps
                    lo, hi = max(start, offsets[s]), min(end, offsets[s + 1])
                    if lo < hi:
                        src = layer[s][lo - offsets[s] : hi - offsets[s]]
                        dst[at : at + hi - lo].copy_(src.detach(), non_blocking=arena.pinned and src.is_cuda)
                        at += hi - lo
    for device in cuda:
        torch.cuda.current_stream(device).synchronize()
    ext._captured_states = None  # what speculators' method clears after it collected
    ext._request_metadata = []
    arena.stats = {
        "bytes": size,
        "tensors": len(spec) * len(captured),
        "seconds": time.perf_counter() - start_time,
        "pinned": arena.pinned,
        "arena_bytes": arena.size,
        "direct": True,
    }
    return SharedStates(arena.path, arena.size, spec)


def _view(block: Any, slot: _Slot) -> Any:
    import torch

    return block.narrow(0, slot.offset, slot.nbytes).view(getattr(torch, slot.dtype)).view(slot.shape)


_MAPPED: dict[str, Any] = {}  # in the generator's process: arena path -> its mapping, kept across calls


def _unpack(path: str, size: int, spec: Any) -> Any:
    """Views of the worker's arena: map it on first sight (then remove its name), reuse the mapping after.

    No copy is made here: speculators copies what it keeps (``.clone().cpu()``).
    """
    block = _MAPPED.get(path)
    if block is None or block.numel() != size:
        import torch

        for stale in [p for p in _MAPPED if _owner(p) == _owner(path) or not _alive(_owner(p))]:
            del _MAPPED[stale]  # the worker grew its arena or is gone: drop the old mapping
        try:
            block = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # both processes keep their mappings; no name is left behind
        _MAPPED[path] = block

    def build(obj: Any) -> Any:
        if isinstance(obj, _Slot):
            return _view(block, obj)
        if isinstance(obj, dict):
            return {k: build(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(build(v) for v in obj)
        return obj

    return build(spec)


def _owner(path: str) -> int:
    """The pid of the worker that created an arena (from its name)."""
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
    """Remove arenas of workers that died before the generator mapped them (the only way one is left behind)."""
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


def _pin(block: Any) -> bool:
    """Register the mapping with CUDA (page-locked), so copies from the GPU are asynchronous DMAs."""
    import torch

    try:
        result = torch.cuda.cudart().cudaHostRegister(block.data_ptr(), block.numel(), 0)
    except Exception as exc:  # no CUDA runtime binding here: copies still work, synchronously
        logger.debug("states-through-shared-memory: cannot pin the arena (%r)", exc)
        return False
    ok = int(getattr(result, "value", result)) == 0
    if not ok:
        logger.debug("states-through-shared-memory: cudaHostRegister returned %s; arena left pageable", result)
    return ok


def _unpin(block: Any) -> None:
    import torch

    with contextlib.suppress(Exception):
        torch.cuda.cudart().cudaHostUnregister(block.data_ptr())
