"""The caller's side: the generator's process maps each handed-over slab and gives speculators tensors over it.

Runs in the process that called ``generate()`` (and, through the fork hook, keeps a forked child's snapshot right).
Unpickling a ``StatesHandle`` receives the slab's descriptor (vllm_compat.transport.wire), opens a description of its
own with a shared lock on it (the worker writes the slab again only once no process holds one), maps it privately
(copy-on-write) and replaces the reply's slots with ``HandedOverStates``, whose ``clone()`` is a plain tensor over
exactly its bytes of that mapping (or, in copy mode, a copy made ahead by a few threads).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import threading
import weakref
from typing import Any

from vllm_compat.transport import wire
from vllm_compat.transport._libc import _LIBC, _MAP_FAILED, _libc
from vllm_compat.transport.layout import ENV_MODE, SIZE_SEALS, Slot, TransportError, map_slots, slot_view

_PAGE = mmap.PAGESIZE


_DISCARD = threading.local()


@contextlib.contextmanager
def discarding() -> Any:
    """While this is active in a thread, a states handle unpickled there is dropped: its descriptor is closed unmapped
    (the worker may write the slab again) and it stands for None."""
    _DISCARD.on = True
    try:
        yield
    finally:
        _DISCARD.on = False


class _Maps:
    """How many slab mappings this process holds (one per call whose states are alive here)."""

    def __init__(self) -> None:
        self.live = 0


_MAPS = _Maps()


class _Lease:
    """This process's hold on one slab: an open file description of its own with a shared lock on it, alive while any
    mapping of the slab lives (every mapping's finalizer holds the lease). When it goes, the worker is told.

    The descriptor itself is closed as soon as the slab is mapped (``mapped``): a mapping holds the open file, and a
    lock taken on an open file lasts until the file's last reference goes, so the lock stays exactly as long as the
    mapping (or a forked child's copy of it). A caller keeping a thousand calls' results then holds no descriptor for
    them: with ``ulimit -n 1024`` the caller failed at about call 938 when each lease kept one."""

    __slots__ = ("__weakref__", "fd")

    def __init__(self, fd: int, token: str, serial: int) -> None:
        self.fd = [fd]  # shared with the finalizer: -1 once closed
        weakref.finalize(self, _let_go, self.fd, token, serial).atexit = False

    def mapped(self) -> None:
        """The slab is mapped (or there is nothing to map): the descriptor can go, the lock stays with the mapping."""
        fd, self.fd[0] = self.fd[0], -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def _let_go(fd: list[int], token: str, serial: int) -> None:
    """The last mapping is gone (and with it this process's lock, unless a forked child still maps the slab): tell the
    worker, which closes the slab now if it keeps no spare of that size."""
    if fd[0] >= 0:
        with contextlib.suppress(OSError):
            os.close(fd[0])
        fd[0] = -1
    wire.tell_released(token, serial)


def _map_private(lease: _Lease, offset: int, nbytes: int) -> tuple[Any, int]:
    """A private (copy-on-write) mapping of ``nbytes`` of the slab at ``offset``: (buffer, where the bytes start in
    it). The buffer unmaps itself when the last reference to it goes, and lets go of the lease then."""
    libc = _libc()
    start = offset - offset % _PAGE
    span = offset + nbytes - start
    addr = libc.mmap(None, span, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, lease.fd[0], start)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {span} bytes failed: {os.strerror(err)}")
    buffer = (ctypes.c_char * span).from_address(addr)
    _MAPS.live += 1
    weakref.finalize(buffer, _unmap, addr, span, lease).atexit = False
    return buffer, offset - start


def _unmap(addr: int, span: int, lease: _Lease) -> None:
    _LIBC[0].munmap(addr, span)
    _MAPS.live -= 1


class _Sources:
    """The slabs this process maps while speculators still holds their ``HandedOverStates``: the address range of
    each slab's mapping -> the mapping (held weakly: it goes with its last tensor) and the copies made ahead (copy
    mode), so ``clone()`` finds them."""

    def __init__(self) -> None:
        self.by_address: dict[int, tuple[int, Any, dict[tuple[int, int], Any] | None]] = {}
        self.lock = threading.Lock()

    def add(self, start: int, end: int, buffer: Any, copies: dict[tuple[int, int], Any] | None) -> None:
        with self.lock:
            self.by_address[start] = (end, weakref.ref(buffer), copies)

    def drop(self, start: int) -> None:
        with self.lock:
            self.by_address.pop(start, None)

    def find(self, address: int) -> tuple[Any, int, dict[tuple[int, int], Any] | None] | None:
        """(mapping, offset in the slab, copies made ahead or None in map mode) of the slab mapped at ``address``."""
        with self.lock:
            for start, (end, ref, copies) in self.by_address.items():
                if start <= address < end:
                    buffer = ref()
                    return None if buffer is None else (buffer, address - start, copies)
        return None


_SOURCES = _Sources()


def copy_mode() -> bool:
    return os.environ.get(ENV_MODE, "").strip().lower() == "copy"


def open_states(token: str, pid: int, serial: int, size: int, spec: Any, pieces: list[tuple[int, int]]) -> Any:
    """In the generator's process: the reply's structure, with ``HandedOverStates`` over the worker's slab."""
    import torch

    receiver = wire.current_receiver()
    if receiver is None:
        raise TransportError(
            "a states handle reached a process that started no vLLM workers of its own (it has no receiving socket)"
        )
    if getattr(_DISCARD, "on", False):
        receiver.discard(token, serial)
        return None
    fd = receiver.receive(token, pid, serial, size)
    try:
        _check_slab(fd, size, pid)
        own = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)  # a description of our own: our lock
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    lease = _Lease(own, token, serial)
    fcntl.flock(own, fcntl.LOCK_SH)  # the worker leaves the slab alone while any process holds this
    handed = handed_over_type()
    if not size:
        block = torch.empty(0, dtype=torch.uint8)
    else:
        buffer = _map_private(lease, 0, size)[0]
        lease.mapped()
        start = ctypes.addressof(buffer)
        copies = _copy_ahead(buffer, pieces) if copy_mode() else None
        _SOURCES.add(start, start + size, buffer, copies)
        weakref.finalize(buffer, _SOURCES.drop, start).atexit = False
        block = torch.frombuffer(buffer, dtype=torch.uint8)
    return map_slots(spec, Slot, lambda slot: slot_view(block, slot).as_subclass(handed))


def _check_slab(fd: int, size: int, pid: int) -> None:
    st = os.fstat(fd)
    if st.st_size < size:
        raise TransportError(f"worker pid {pid} handed over {st.st_size} bytes of memory for {size} bytes of states")
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & SIZE_SEALS != SIZE_SEALS:
        raise TransportError(f"worker pid {pid} handed over memory whose size is not sealed (seals {seals:#x})")


_COPY_THREADS = 8
_POOL: list[Any] = []


def _copy_ahead(buffer: Any, pieces: list[tuple[int, int]]) -> dict[tuple[int, int], Any]:
    """Copy mode: each piece ``(offset, nbytes)`` that speculators will ``clone()`` copied into ordinary memory now,
    by a few threads (torch releases the GIL while copying): (offset, nbytes) -> uint8 tensor."""
    import torch

    source = torch.frombuffer(buffer, dtype=torch.uint8)
    copies = {piece: torch.empty(piece[1], dtype=torch.uint8) for piece in pieces if piece[1]}
    if not _POOL:
        from concurrent.futures import ThreadPoolExecutor

        _POOL.append(ThreadPoolExecutor(min(_COPY_THREADS, os.cpu_count() or 1), thread_name_prefix="vllm_compat_copy"))
    futures = [_POOL[0].submit(dst.copy_, source.narrow(0, off, n)) for (off, n), dst in copies.items()]
    for f in futures:
        f.result()
    return copies


def _own_copy(tensor: Any) -> Any:
    """``tensor.clone()`` as an independent plain tensor: a storage of exactly its bytes over the call's private
    mapping (no copy: a write to it stays in it, as the mapping is private and no other tensor holds those bytes),
    the copy made ahead in copy mode, or a real copy (not contiguous, or written to since it was handed over)."""
    import torch

    with torch._C.DisableTorchFunctionSubclass():
        plain = tensor.as_subclass(torch.Tensor)
        found = _SOURCES.find(plain.data_ptr()) if plain.numel() else None
        if found is not None and plain.is_contiguous() and plain._version == 0:
            buffer, offset, copies = found
            if copies is None:
                return torch.frombuffer(buffer, dtype=plain.dtype, count=plain.numel(), offset=offset).view(plain.shape)
            ahead = copies.pop((offset, plain.numel() * plain.element_size()), None)  # copy mode: once
            if ahead is not None:
                return ahead.view(plain.dtype).view(plain.shape)
        return plain.clone()


_HANDED: list[type] = []


def handed_over_type() -> type:
    """``HandedOverStates``, a ``torch.Tensor`` subclass made on first use (importing this module needs no torch)."""
    if _HANDED:
        return _HANDED[0]
    import torch

    class HandedOverStates(torch.Tensor):
        """States as the worker handed them over, seen only by speculators' ``generate()``.

        speculators copies each state it returns (``h.clone().cpu()``, after slicing it by request on 0.3.0): its
        ``clone()`` here is a plain tensor whose storage is exactly that state's bytes of the private mapping, at no
        copying cost. Indexing keeps the type; every other operation returns plain tensors.
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


def _forget_in_forked_child() -> None:
    """A forked child (a vLLM worker under the fork start method, a DataLoader worker) keeps the mappings and leases
    it inherited (its snapshot), with a lock of its own for finding them."""
    _SOURCES.lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_forked_child)


def __getattr__(name: str) -> Any:
    if name == "HandedOverStates":  # found by name when one is unpickled
        return handed_over_type()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
