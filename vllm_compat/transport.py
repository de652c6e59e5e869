"""Hand captured states from a vLLM worker to the generator's process through shared memory.

Why: speculators returns every captured state in the reply of ``collective_rpc``, which vLLM pickles through its
message queue (GPU -> host -> serialised -> chunks -> rebuilt), then copies once more (``.clone().cpu()``). On an
H200 that reply was most of the extraction time.

How, and what the caller can rely on:

- The worker writes one call's states into a *fresh* file in ``/dev/shm`` (made ahead of time by a thread, so its
  pages are ready) and replies with a small :class:`StatesHandle`. It holds a shared ``flock`` on every file it owns;
  once a file is handed over it never writes to it again.
- Unpickling the handle in the generator's process opens the file without following links, checks it is the very
  file the worker made (owner, device, inode), removes its name and maps it *privately* (copy-on-write). speculators
  sees ``HandedOverStates`` tensors over that mapping; its ``.clone()`` of one maps that tensor's own bytes privately
  again: an independent tensor, with no copy made.
- So each tensor ``generate()`` returns owns exactly its bytes: ``torch.save`` or pickling one writes that tensor
  alone; a write to it is private to it (and to the process that makes it: ``fork()`` gives the child a
  copy-on-write snapshot); no other process, and no later call, can change it. Its memory is the kernel's to free
  once no process maps the call's file any more.
- A file is removed by a cleaner only when no process holds its lock: the kernel drops the locks of a process that
  dies, so that is proof its owner is gone, whatever PID namespace or container it ran in.

Nothing here imports torch until it is used.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PREFIX",
    "SHM_DIR",
    "Slot",
    "StatesHandle",
    "StatesWriter",
    "TransportError",
    "aligned",
    "handed_over_type",
    "layout",
    "open_states",
    "remove_dead_files",
]

logger = logging.getLogger("vllm_compat")

SHM_DIR = "/dev/shm"  # POSIX shared memory on Linux, where vLLM runs
PREFIX = "vllm_compat_states_"
_ALIGN = 64  # every tensor starts on a 64-byte boundary: aligned for any dtype and for vectorised copies
_STEP = 2 << 20  # file sizes are whole 2 MiB pages
_PAGE = mmap.PAGESIZE
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # map every page up front: no page faults while copying
_HEADROOM = 4  # a spare file is 1 + 1/4 the size of the last call's states, so a somewhat longer call fits


class TransportError(RuntimeError):
    """The states file handed over is not the one the worker made, or cannot be mapped."""


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in a states file."""

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


# -- memory maps the tensors own -----------------------------------------------------------------------------------


class _Libc:
    """``mmap``/``munmap`` from the C library: Python's ``mmap`` object keeps a duplicate file descriptor open for as
    long as the mapping lives (one per returned tensor would exhaust the process's descriptors)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols, libc's among them: no library search
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self.munmap = libc.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


_LIBC: list[_Libc] = []
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Maps:
    """The private mappings this process made for states, counted: each is one entry of ``vm.max_map_count``."""

    def __init__(self) -> None:
        self.live = 0
        self.limit: int | None = None  # read on first use, not when vllm_compat is imported
        self.warned = False

    def full(self) -> bool:
        if self.limit is None:
            self.limit = _max_map_count() // 2  # leave the other half to everything else in the process
        return self.live >= self.limit


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530  # Linux's default


_MAPS = _Maps()


def _map_private(fd: int, offset: int, nbytes: int) -> tuple[Any, int]:
    """A private (copy-on-write) mapping of ``nbytes`` of the file at ``offset``: (buffer, where the bytes start in
    it). The buffer unmaps itself when the last reference to it goes."""
    if not _LIBC:
        _LIBC.append(_Libc())
    libc = _LIBC[0]
    start = offset - offset % _PAGE
    span = offset + nbytes - start
    addr = libc.mmap(None, span, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, start)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {span} bytes failed: {os.strerror(err)}")
    buffer = (ctypes.c_char * span).from_address(addr)
    _MAPS.live += 1
    weakref.finalize(buffer, _unmap, addr, span).atexit = False
    return buffer, offset - start


def _unmap(addr: int, span: int) -> None:
    _LIBC[0].munmap(addr, span)
    _MAPS.live -= 1


def _tensor_over(fd: int, offset: int, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> Any:
    """A plain tensor over its own private mapping of the file's bytes ``[offset, offset + nbytes)``."""
    import torch

    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    buffer, start = _map_private(fd, offset, nbytes)
    return torch.frombuffer(buffer, dtype=dtype, count=nbytes // dtype.itemsize, offset=start).view(shape)


# -- the caller's side ---------------------------------------------------------------------------------------------


class _Sources:
    """The states files this process has open while speculators still holds their ``HandedOverStates``: the address
    range of each file's mapping -> its descriptor, so ``clone()`` can map a tensor's own bytes again."""

    def __init__(self) -> None:
        self.by_address: dict[int, tuple[int, int]] = {}  # start address -> (end address, descriptor)
        self.lock = threading.Lock()

    def add(self, start: int, end: int, fd: int) -> None:
        with self.lock:
            self.by_address[start] = (end, fd)

    def drop(self, start: int) -> None:
        with self.lock:
            _, fd = self.by_address.pop(start, (0, -1))
        if fd >= 0:
            os.close(fd)

    def find(self, address: int) -> tuple[int, int] | None:
        """(descriptor, offset in the file) of the file mapped at ``address``, if any."""
        with self.lock:
            for start, (end, fd) in self.by_address.items():
                if start <= address < end:
                    return fd, address - start
        return None


_SOURCES = _Sources()
_CLEANER_AT_EXIT: list[bool] = []


def open_states(path: str, size: int, device: int, inode: int, spec: Any) -> Any:
    """In the generator's process: the reply's structure with ``HandedOverStates`` over the worker's file.

    The file must be the worker's own (a regular file of this user, the device and inode the worker reported, not
    reached through a link); its name is removed at once, so nothing is left in /dev/shm.
    """
    import torch

    if not _CLEANER_AT_EXIT:
        _CLEANER_AT_EXIT.append(True)
        atexit.register(remove_dead_files)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        remove_dead_files()
        raise TransportError(
            f"the worker's states file {path} cannot be opened ({exc.strerror}). Was it removed by another program "
            "cleaning /dev/shm? Run again; if this repeats, report it with the log."
        ) from exc
    try:
        st = os.fstat(fd)
        problem = _not_the_file(st, size, device, inode)
        if problem:
            raise TransportError(f"refusing to map {path}: {problem}. Nothing was read from it.")
        with contextlib.suppress(OSError):
            if os.lstat(path).st_ino == st.st_ino:
                os.unlink(path)
        buffer = _map_private(fd, 0, size)[0] if size else None
    except BaseException:
        os.close(fd)
        raise
    if buffer is None:  # nothing but empty tensors
        os.close(fd)
        block = torch.empty(0, dtype=torch.uint8)
    else:
        start = ctypes.addressof(buffer)
        _SOURCES.add(start, start + size, fd)
        weakref.finalize(buffer, _SOURCES.drop, start).atexit = False
        block = torch.frombuffer(buffer, dtype=torch.uint8)
    handed = handed_over_type()
    remove_dead_files()
    return _replace(spec, Slot, lambda slot: _view(block, slot).as_subclass(handed))


def _not_the_file(st: os.stat_result, size: int, device: int, inode: int) -> str:
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.geteuid():
        return f"it belongs to uid {st.st_uid}, not to this user ({os.geteuid()})"
    if (st.st_dev, st.st_ino) != (device, inode):
        return "it is not the file the worker wrote (another device or inode)"
    if st.st_size < size:
        return f"it holds {st.st_size} bytes, the states need {size}"
    return ""


def _view(block: Any, slot: Slot) -> Any:
    import torch

    return block.narrow(0, slot.offset, slot.nbytes).view(getattr(torch, slot.dtype)).view(slot.shape)


def _replace(obj: Any, kind: type, replace: Callable[[Any], Any]) -> Any:
    """``obj`` with every ``kind`` inside it (through dicts, lists and tuples) replaced by ``replace(it)``.

    A module-level function, not a recursive closure: a closure that calls itself is a reference cycle, and one
    holding the call's tensors would keep them until the garbage collector runs instead of until they are dropped.
    """
    if isinstance(obj, kind):
        return replace(obj)
    if isinstance(obj, dict):
        return {k: _replace(v, kind, replace) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_replace(v, kind, replace) for v in obj)
    return obj


def _own_copy(tensor: Any) -> Any:
    """``tensor.clone()`` as an independent plain tensor: its bytes mapped again privately where possible (no copy),
    a real copy otherwise (not contiguous, written to since it was handed over, or too many mappings live)."""
    import torch

    with torch._C.DisableTorchFunctionSubclass():
        plain = tensor.as_subclass(torch.Tensor)
        found = _SOURCES.find(plain.data_ptr()) if plain.numel() else None
        full = _MAPS.full()
        if found is None or not plain.is_contiguous() or plain._version != 0 or full:
            if found is not None and full and not _MAPS.warned:
                _MAPS.warned = True
                logger.warning(
                    "states-through-shared-memory: %d returned state tensors are alive in this process; further "
                    "states are copied into ordinary memory (slower) to stay within vm.max_map_count.",
                    _MAPS.live,
                )
            return plain.clone()
        fd, offset = found
        return _tensor_over(fd, offset, plain.numel() * plain.element_size(), plain.dtype, tuple(plain.shape))


_HANDED: list[type] = []


def handed_over_type() -> type:
    """``HandedOverStates``, a ``torch.Tensor`` subclass made on first use (importing this module needs no torch)."""
    if _HANDED:
        return _HANDED[0]
    import torch

    class HandedOverStates(torch.Tensor):
        """States as the worker handed them over, seen only by speculators' ``generate()``.

        speculators copies each state it returns (``h.clone().cpu()``, after slicing it by request on 0.3.0): its
        ``clone()`` here maps the tensor's own bytes privately instead, an independent tensor that owns exactly
        those bytes, at no copying cost. Indexing keeps the type; every other operation returns plain tensors.
        """

        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func is torch.Tensor.clone and len(args) == 1 and not kwargs:
                return _own_copy(args[0])
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


# -- the worker's side ---------------------------------------------------------------------------------------------


class StatesHandle:
    """A picklable handle to one call's states file; unpickling it (in the generator's process) opens the states."""

    def __init__(self, path: str, size: int, device: int, inode: int, spec: Any) -> None:
        self.path, self.size, self.device, self.inode, self.spec = path, size, device, inode, spec

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (open_states, (self.path, self.size, self.device, self.inode, self.spec))


class _File:
    """A fresh file in /dev/shm, made, locked (shared) and mapped by this worker."""

    def __init__(self, path: str, fd: int, size: int, mapping: Any, block: Any) -> None:
        self.path, self.fd, self.size = path, fd, size
        self.mapping: Any = mapping
        self.block: Any = block  # uint8 tensor over the whole mapping, while the worker writes
        st = os.fstat(fd)
        self.device, self.inode = st.st_dev, st.st_ino

    @classmethod
    def create(cls, size: int) -> _File | str:
        """A new file of ``size`` bytes with every page in place; or why there is none."""
        try:
            path, fd = _create_locked()
        except OSError as exc:
            return f"cannot create a file in {SHM_DIR} ({exc.strerror})"
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS on the first write past the limit
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except OSError as exc:
            _unlink_if_ours(path, fd)
            os.close(fd)
            return f"{SHM_DIR} has {_free_bytes() / 2**20:.0f} MiB free ({exc.strerror})"
        import torch

        return cls(path, fd, size, mapping, torch.frombuffer(mapping, dtype=torch.uint8))

    def seal(self, used: int) -> None:
        """The worker is done writing: drop its mapping (unmapped with the last reference) and give back the pages
        past ``used``."""
        self.block = self.mapping = None
        os.ftruncate(self.fd, used)
        self.size = used

    def discard(self) -> None:
        """Let go: the name goes unless the generator's process already took the file; the lock goes with the fd."""
        self.block = self.mapping = None
        _unlink_if_ours(self.path, self.fd)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1


def _create_locked() -> tuple[str, int]:
    """Create a file under a new name and hold a shared lock on it, so that no cleaner ever takes it for a dead
    worker's: a cleaner that slipped in between the two steps took the name away, and we try again."""
    for _ in range(8):
        path = os.path.join(SHM_DIR, f"{PREFIX}{uuid.uuid4().hex}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.lstat(path).st_ino == os.fstat(fd).st_ino:
                return path, fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise OSError(errno.EAGAIN, "could not keep a file of its own (removed as soon as made)")


def _unlink_if_ours(path: str, fd: int) -> None:
    with contextlib.suppress(OSError):
        if os.lstat(path).st_ino == os.fstat(fd).st_ino:
            os.unlink(path)


def _round(n: int, step: int) -> int:
    return max(-(-n // step) * step, step)


def aligned(nbytes: int) -> int:
    """The room a tensor of ``nbytes`` takes in a states file (the next one starts aligned)."""
    return -(-nbytes // _ALIGN) * _ALIGN


Copy = tuple[Any, Slot, list[tuple[int, int, int]]]  # (source, slot, ranges): see StatesWriter.write


def layout(states: Any) -> tuple[Any, int, list[Copy]]:
    """(spec, size, copies) that put every tensor of ``states`` (any nesting of dicts, lists and tuples) whole into
    a states file: ``spec`` is ``states`` with each tensor replaced by its :class:`Slot`."""
    import torch

    tensors: list[Any] = []

    def index(t: Any) -> _Index:
        tensors.append(t)
        return _Index(len(tensors) - 1)

    shape = _replace(states, torch.Tensor, index)
    slots, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        slots.append(Slot(size, nbytes, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
        size += aligned(nbytes)
    spec = _replace(shape, _Index, lambda i: slots[i.i])
    return spec, size, [(t, slot, []) for t, slot in zip(tensors, slots, strict=True)]


@dataclass(frozen=True)
class _Index:
    i: int


class StatesWriter:
    """A worker's side of the hand-over: a fresh file per call, one spare kept ready by a thread.

    A file is handed over once and never written again; the worker keeps its lock (and so its name safe from
    cleaners) until the next call, by which time the generator's process has taken it. States on a GPU go to a
    pinned staging buffer in one DMA, then into the file with a few threads; states in host memory go straight in.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spare: _File | None = None
        self.handed: list[_File] = []
        self.thread: threading.Thread | None = None
        self.staging: Any = None
        self.stats: dict[str, Any] = {}
        self.closing = False
        self.spare_ready = threading.Event()
        self.spare_ready.set()  # no spare on its way
        self._started = False

    def write(self, spec: Any, size: int, copies: Iterable[Copy]) -> StatesHandle | None:
        """Write the states and return their handle; None where /dev/shm has no room (the caller then replies the
        usual way). Each copy ``(source, slot, ranges)`` copies ``source`` whole (no ranges), or the listed
        ``(step, first row, rows)`` pieces of ``source[step]`` one after the other."""
        started = time.perf_counter()
        if not self._started:
            self._started = True
            atexit.register(self.close)
            remove_dead_files()
        self._let_go_of_handed()
        file, waited, made = self._take(size)
        if file is None:
            return None
        try:
            self._fill(file, list(copies), size)
            file.seal(size)
        except BaseException:
            file.discard()
            raise
        with self.lock:
            self.handed.append(file)
        self._prepare_spare(size)
        self.stats = {
            "bytes": size,
            "seconds": time.perf_counter() - started,
            "waited_seconds": waited,
            "made_now": made,
            "pinned": self.staging is not None,
        }
        return StatesHandle(file.path, size, file.device, file.inode, spec)

    def _take(self, size: int) -> tuple[_File | None, float, bool]:
        started = time.perf_counter()
        self.spare_ready.wait()  # the spare may be on its way
        waited = time.perf_counter() - started
        with self.lock:
            spare, self.spare = self.spare, None
        if spare is not None and spare.size >= max(size, 1):
            return spare, waited, False
        if spare is not None:
            spare.discard()
        new = _File.create(_round(size + size // _HEADROOM, _STEP))
        if isinstance(new, str):
            _no_room(new, size)
            return None, waited, True
        return new, waited, True

    def _fill(self, file: _File, copies: list[Copy], size: int) -> None:
        import torch

        sources = [t for src, _, ranges in copies for t in (src if ranges else [src])]
        devices = {t.device for t in sources if t.is_cuda}
        target = file.block
        if devices:
            target = self._staging_buffer(size)
        for src, slot, ranges in copies:
            if not slot.nbytes:
                continue
            dst = _view(target, slot)
            if not ranges:
                dst.copy_(src.detach(), non_blocking=bool(devices))
                continue
            at = 0
            for step, row, n in ranges:
                dst[at : at + n].copy_(src[step][row : row + n].detach(), non_blocking=bool(devices))
                at += n
        if devices:
            for d in devices:
                torch.cuda.current_stream(d).synchronize()
            _parallel_copy(file.block.narrow(0, 0, size), target.narrow(0, 0, size))

    def _staging_buffer(self, size: int) -> Any:
        """A pinned host buffer of at least ``size`` bytes, kept for the next calls (DMA from the GPU at full speed)."""
        import torch

        if self.staging is None or self.staging.numel() < size:
            self.staging = None
            self.staging = torch.empty(_round(size + size // _HEADROOM, _STEP), dtype=torch.uint8, pin_memory=True)
        return self.staging

    def _prepare_spare(self, size: int) -> None:
        """In a thread: make the next call's file, then let go of the one just handed over once it is taken."""
        handed = list(self.handed)
        self.spare_ready.clear()

        def run() -> None:
            try:
                new = _File.create(_round(size + size // _HEADROOM, _STEP))
                if isinstance(new, _File):
                    with self.lock:
                        self.spare = new
                else:
                    logger.debug("states-through-shared-memory: no spare file (%s)", new)
            finally:
                self.spare_ready.set()
            self._let_go_once_taken(handed)

        self.thread = threading.Thread(target=run, name="vllm_compat_states", daemon=True)
        self.thread.start()

    def _let_go_once_taken(self, files: list[_File], patience: float = 30.0) -> None:
        """Close each file once the generator's process has taken it (its name is gone), so that its memory is
        freed as soon as that process drops the states, not at the next call. A file not taken in time stays until
        the next call (or the worker's exit) lets go of it."""
        deadline = time.monotonic() + patience
        pause = 0.001
        pending = list(files)
        while pending and time.monotonic() < deadline and not self.closing:
            pending = [f for f in pending if os.path.lexists(f.path)]
            if pending:
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
        with self.lock:
            for f in files:
                if f not in pending and f in self.handed:
                    self.handed.remove(f)
                    f.discard()

    def _let_go_of_handed(self) -> None:
        with self.lock:
            handed, self.handed = self.handed, []
        for file in handed:
            file.discard()

    def close(self) -> None:
        """At exit: the spare goes, and the lock (and name, if still there) of the last file handed over."""
        self.closing = True
        if self.thread is not None:
            self.thread.join(timeout=30)
        self._let_go_of_handed()
        with self.lock:
            spare, self.spare = self.spare, None
        if spare is not None:
            spare.discard()


_COPY_THREADS = 8
_POOL: list[Any] = []


def _parallel_copy(dst: Any, src: Any) -> None:
    """``dst.copy_(src)`` for large host buffers, split over a few threads (torch releases the GIL while copying)."""
    n = dst.numel()
    threads = max(1, min(_COPY_THREADS, os.cpu_count() or 1, n // (8 << 20)))
    if threads == 1:
        dst.copy_(src)
        return
    if not _POOL:
        from concurrent.futures import ThreadPoolExecutor

        _POOL.append(ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="vllm_compat_copy"))
    chunk = -(-n // threads)
    futures = [
        _POOL[0].submit(dst.narrow(0, i, min(chunk, n - i)).copy_, src.narrow(0, i, min(chunk, n - i)))
        for i in range(0, n, chunk)
    ]
    for f in futures:
        f.result()


# -- clean-up ------------------------------------------------------------------------------------------------------


def remove_dead_files() -> int:
    """Remove states files that no living process holds, and say how many went.

    Every owner holds a lock on its file; the kernel drops it when the owner dies. A file nobody holds a lock on was
    left by a dead worker (a spare, or a file its generator never took): removing it is safe from any process, in any
    PID namespace. Files of other users are left alone.
    """
    removed = 0
    try:
        names = [n for n in os.listdir(SHM_DIR) if _is_states_file(n)]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner is alive
            if os.lstat(path).st_ino == st.st_ino:
                os.unlink(path)
                removed += 1
        except OSError:
            continue
        finally:
            os.close(fd)
    if removed:
        logger.info("states-through-shared-memory: removed %d states file(s) of dead workers from %s", removed, SHM_DIR)
    return removed


def _is_states_file(name: str) -> bool:
    """A name this transport makes: the prefix and 32 hex digits. Files of vllm-compat 0.1.0 (the prefix, a pid,
    ``_``, hex) took no lock, so a live one cannot be told from a dead one: they are left to that version."""
    rest = name[len(PREFIX) :] if name.startswith(PREFIX) else ""
    return len(rest) == 32 and all(c in "0123456789abcdef" for c in rest)


_WARNED: list[bool] = []


def _no_room(why: str, size: int) -> None:
    """Say once (later calls at debug level) that states take the slow path, and why."""
    log = logger.debug if _WARNED else logger.warning
    _WARNED.append(True)
    log(
        "states-through-shared-memory: %s; a call's captured states need %.0f MiB. They go through vLLM's message "
        "queue instead (slower). Give the container more shared memory (e.g. docker run --shm-size=16g).",
        why,
        max(size / 2**20, 0.1),
    )


def _free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize
