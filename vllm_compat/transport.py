"""Hand a call's captured states from a vLLM worker to the generator's process at the speed of the bus.

Why: speculators returns every captured state in the reply of ``collective_rpc``, which vLLM pickles through its
message queue (GPU -> host -> serialised -> chunks -> rebuilt), then copies once more (``.clone().cpu()``). On an
H200 that reply was most of the extraction time.

How, and what the caller can rely on:

- The worker keeps a few *slabs*: anonymous shared memory (``memfd_create``: no name in any file system, so no
  cleaner can remove it and nothing is left behind when a process dies), each mapped once with every page in place
  (by a few threads, with the GIL released: a spare made while a call runs does not hold the call up), registered
  with CUDA as pinned memory once (in pieces: the driver holds the worker's launches up while it registers), and
  sealed: its size can never change and no process can open it for writing
  (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE``); only the mapping the worker made before sealing writes.
- While a call's steps run, each step's captured rows are copied to their place in the call's slab
  (vllm_compat.capture lays a call out): on a GPU by DMA on a side stream, overlapped with the steps that follow.
- At the end of the call the worker passes the slab's descriptor to the generator's process over a Unix socket
  (``SCM_RIGHTS``) and replies with a small :class:`StatesHandle` instead of the states.
- Unpickling the handle in the generator's process opens the slab on a descriptor of its own, takes a shared lock on
  it and maps it *privately* (copy-on-write). speculators sees ``HandedOverStates`` over that mapping; its
  ``.clone()`` of one is a plain tensor whose storage is exactly that state's bytes of the mapping: no copy made
  (``VLLM_COMPAT_STATES=copy``: a real copy into ordinary memory instead, made with a few threads).
- The worker writes a slab again only once no process holds a lock on it: the caller's lock goes when the last tensor
  over the slab goes (the kernel drops the locks of a process that dies; a forked child keeps the lock it inherited,
  as it keeps its snapshot of the tensors).

So each tensor ``generate()`` returns owns exactly its bytes: ``torch.save`` or pickling one writes that tensor alone;
a write to it is private to it and to the process that makes it (``fork()`` gives the child a copy-on-write
snapshot); no other process and no later call can change it, and its memory goes when the last process mapping it
drops it. The slabs are not in /dev/shm: filling them never takes the room vLLM's own message queues need there.

Nothing here imports torch until it is used.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import secrets
import select
import selectors
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ENV_MODE",
    "ENV_PINNED_LIMIT",
    "ENV_SOCKET",
    "MOST_SPARES",
    "Slab",
    "Slabs",
    "Slot",
    "StatesHandle",
    "TransportError",
    "discarding",
    "forget_workers",
    "handed_over_type",
    "open_states",
    "receiver_address",
    "send_slab",
    "worker_stats",
]

logger = logging.getLogger("vllm_compat")

ENV_SOCKET = "VLLM_COMPAT_STATES_SOCKET"  # the generator's receiving socket; set while its constructor starts workers
ENV_MODE = "VLLM_COMPAT_STATES"  # "map" (default): returned states map the slab privately; "copy": ordinary memory
ENV_PINNED_LIMIT = "VLLM_COMPAT_PINNED_LIMIT_GIB"  # at most this much slab memory is registered with CUDA per worker

_ALIGN = 64  # every tensor starts on a 64-byte boundary: aligned for any dtype and for vectorised copies
_STEP = 2 << 20  # slab sizes are whole 2 MiB
_PAGE = mmap.PAGESIZE
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # map every page up front: no page faults while copying
_MADV_POPULATE_WRITE = 23  # Linux 5.14: put a range's pages in place, an error (not SIGBUS) where memory is short
_FILL_THREADS = 8  # a slab's pages are put in place by up to this many threads at once (the kernel zero-fills each)
# Slabs are registered with CUDA in pieces of this size, with a pause between pieces when made while a call runs:
# the driver holds up the worker's kernel launches and copies while it registers (on an H200, 27 ms for a 640 MiB
# slab at once, under 1.2 ms with pieces). A copy may not cross the border of two registrations (the driver refuses
# it: invalid argument), so the capture splits copies at these borders.
PIN_PIECE = 32 << 20
_PIN_PAUSE = 0.001
_F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1; Python's fcntl does not name it
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_HELLO = struct.Struct("<4s32sI32s")  # magic, worker token (hex), worker pid, the receiver's key (hex)
_MAGIC = b"VCS2"
_HEADER = struct.Struct("<QQ")  # serial, size: sent with each slab's descriptor
_RECV_TIMEOUT = 30.0
_HELLO_TIMEOUT = 2.0  # a connection that has not said who it is by then is closed (a worker says it as it connects)


class TransportError(RuntimeError):
    """The states the worker handed over cannot be received or are not what the worker said they are."""


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in a slab."""

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def aligned(nbytes: int) -> int:
    """The room a tensor of ``nbytes`` takes in a slab (the next one starts aligned)."""
    return -(-nbytes // _ALIGN) * _ALIGN


def _round(n: int, step: int = _STEP) -> int:
    return max(-(-n // step) * step, step)


# -- the worker's side ---------------------------------------------------------------------------------------------


class Slab:
    """Sealed anonymous shared memory the worker writes a call's states into; handed over by descriptor."""

    def __init__(self, fd: int, size: int, buffer: Any, block: Any, piece: int, device: int | None) -> None:
        self.fd, self.size, self.buffer, self.block = fd, size, buffer, block
        self.piece, self.device = piece, device  # piece: registered with CUDA in pieces of this size (0: pageable)
        self.busy = False  # taken by a call whose states are being written
        self.handed = False  # handed over, and maybe still mapped by the generator's process

    @property
    def pinned(self) -> bool:
        return self.piece > 0

    @classmethod
    def make(cls, size: int, device: int | None, pin: bool, background: bool = False) -> Slab:
        """A slab of ``size`` bytes (whole 2 MiB) with every page in place; OSError where memory is short.

        Everything slow here runs with the GIL released (the kernel zero-filling the pages, by a few threads; CUDA
        registering them, in pieces), so a slab made in the background while a call runs does not hold the call up:
        Python's own ``mmap`` keeps the GIL while it populates a mapping, which stopped a worker's steps for as long
        (0.26 s for 640 MiB on an H200 host)."""
        size = _round(size)
        fd = os.memfd_create("vllm-compat-states", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            addr = _map_filled(fd, size)
        except BaseException:
            os.close(fd)
            raise
        buffer = (ctypes.c_char * size).from_address(addr)
        weakref.finalize(buffer, _libc().munmap, addr, size).atexit = False  # unmapped with the last view
        try:
            _seal(fd)
        except BaseException:
            os.close(fd)
            raise
        import torch

        block = torch.frombuffer(buffer, dtype=torch.uint8)
        piece = _pin(block, device, _PIN_PAUSE if background else 0.0) if pin and device is not None else 0
        return cls(fd, size, buffer, block, piece, device)

    def is_free(self) -> bool:
        """Whether the worker may write it: not in use by a call, and never handed over or no process holds a lock on
        it any more."""
        if self.busy:
            return False
        if not self.handed:
            return True
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.handed = False
        return True

    def view(self, offset: int, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> Any:
        return self.block.narrow(0, offset, nbytes).view(dtype).view(shape)

    def close(self) -> None:
        """Unregister and let go: the mapping goes with the last tensor viewing it."""
        if self.block is None:
            return
        if self.pinned:
            _unpin(self.block, self.device, self.piece)
            self.piece = 0
        self.block = self.buffer = None
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1


def _map_filled(fd: int, size: int) -> int:
    """Map ``size`` bytes of ``fd`` shared, every page in place (ENOMEM/ENOSPC now, not SIGBUS at the first write):
    by a few threads at once where the kernel populates ranges on request (``MADV_POPULATE_WRITE``), else by
    ``fallocate`` and a populated mapping. The address; the calls go through ctypes, which releases the GIL."""
    libc = _libc()
    addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
    try:
        if _populate(libc, addr, size):
            return addr
        libc.munmap(addr, size)
        addr = None
        os.posix_fallocate(fd, 0, size)
        addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _POPULATE, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            addr = None
            raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
        return addr
    except BaseException:
        if addr is not None:
            libc.munmap(addr, size)
        raise


def _populate(libc: _Libc, addr: int, size: int) -> bool:
    """Put every page of the mapping in place, split among threads: False where this kernel cannot (before 5.14)."""
    threads = max(1, min(_FILL_THREADS, os.cpu_count() or 1, size // _STEP))
    share = _round(-(-size // threads))
    ranges = [(at, min(share, size - at)) for at in range(0, size, share)]
    errors: list[int] = []

    def fill(at: int, n: int) -> None:
        if libc.madvise(addr + at, n, _MADV_POPULATE_WRITE) != 0:
            errors.append(ctypes.get_errno())

    workers = [threading.Thread(target=fill, args=r, name="vllm_compat_fill", daemon=True) for r in ranges[1:]]
    for w in workers:
        w.start()
    fill(*ranges[0])
    for w in workers:
        w.join()
    if not errors:
        return True
    if all(e == errno.EINVAL for e in errors):
        return False  # no MADV_POPULATE_WRITE here
    err = next(e for e in errors if e != errno.EINVAL)
    raise OSError(err, f"cannot put {size} bytes of states memory in place: {os.strerror(err)}")


def _seal(fd: int) -> None:
    """Fix the slab's size and forbid every later write but through the worker's mapping (where the kernel can)."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS | _F_SEAL_FUTURE_WRITE)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # a kernel before 5.1 knows no future-write seal: seal the size only
            raise
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)


def piece_ranges(offset: int, nbytes: int, piece: int) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` split where it crosses a multiple of ``piece`` (0: not split): the copies into a slab
    registered in pieces, none of which may cross a border."""
    if not piece or nbytes <= 0 or offset // piece == (offset + nbytes - 1) // piece:
        return [(offset, nbytes)]
    out = []
    at, end = offset, offset + nbytes
    while at < end:
        stop = min(end, (at // piece + 1) * piece)
        out.append((at, stop - at))
        at = stop
    return out


def _pin(block: Any, device: int, pause: float) -> int:
    """Register the slab with CUDA (page-locked) in pieces of ``PIN_PIECE``, so copies from the GPU into it are
    asynchronous DMAs: the piece size, or 0 where it cannot be registered (copies then work at pageable speed)."""
    import torch

    start, size = block.data_ptr(), block.numel()
    done: list[int] = []
    try:
        cudart = torch.cuda.cudart()
        with torch.cuda.device(device):
            for at in range(0, size, PIN_PIECE):
                result = cudart.cudaHostRegister(start + at, min(PIN_PIECE, size - at), 0)
                if int(getattr(result, "value", result)) != 0:
                    logger.debug("states-through-shared-memory: cudaHostRegister returned %s; pageable", result)
                    break
                done.append(start + at)
                if pause:
                    time.sleep(pause)  # the driver is the worker's steps' meanwhile
    except Exception as exc:  # no CUDA runtime binding: copies still work, at pageable speed
        logger.debug("states-through-shared-memory: cannot pin a slab (%r)", exc)
    if len(done) * PIN_PIECE >= size:
        return PIN_PIECE
    _unregister(done, device)
    return 0


def _unpin(block: Any, device: int | None, piece: int) -> None:
    start = block.data_ptr()
    _unregister([start + at for at in range(0, block.numel(), piece)], device)


def _unregister(addresses: list[int], device: int | None) -> None:
    import torch

    with contextlib.suppress(Exception), torch.cuda.device(device):
        cudart = torch.cuda.cudart()
        for address in addresses:
            cudart.cudaHostUnregister(address)


def _pinned_limit() -> int:
    """The most slab memory one worker registers with CUDA: VLLM_COMPAT_PINNED_LIMIT_GIB, else a quarter of RAM."""
    value = os.environ.get(ENV_PINNED_LIMIT, "").strip()
    if value:
        try:
            return int(float(value) * 2**30)
        except ValueError:
            logger.warning("vllm-compat: %s=%r is not a number of GiB; using the default", ENV_PINNED_LIMIT, value)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError):
        return 16 << 30


MOST_SPARES = 2  # free slabs kept ready at most (see Slabs.spares)


class Slabs:
    """A worker's slabs: a call takes the smallest free one that fits, and a thread keeps spares ready.

    Host memory: the slabs the generator's process still maps (its live results, exactly as large as ordinary
    tensors holding them would be) plus at most ``MOST_SPARES`` free ones (one where making a slab takes less time
    than a call: see ``spares``). Pinned memory: at most ``_pinned_limit()``; slabs beyond it stay pageable (copies
    into them are synchronous, slower).
    """

    def __init__(self) -> None:
        self.slabs: list[Slab] = []
        self.lock = threading.Lock()
        self.maker: threading.Thread | None = None
        self.device: int | None = None
        self.expected = 0  # the size spares are made for: the largest call so far
        self.limit: int | None = None
        self.warned_unpinned = False
        self.closers: list[threading.Thread] = []
        self.make_seconds = 0.0  # how long making the last slab in the background took
        self.call_seconds: float | None = None  # the shortest time between two calls' takes so far
        self.last_take: float | None = None

    def pinned_bytes(self) -> int:
        return sum(s.size for s in self.slabs if s.pinned)

    def spares(self) -> int:
        """How many free slabs to keep ready: two while making one takes longer than a call (or nothing says yet),
        else one. A caller that keeps two calls' results while the next runs (a warm-up's, say) needs a third slab
        at once, and a spare started only when the previous call took the last one is not ready in time where the
        host fills memory slower than the GPU computes (640 MiB in 0.34 s on one H200 host, against 0.165 s calls).
        Where calls are slower than making a slab (large calls, whose memory matters most), one spare suffices."""
        if self.call_seconds is None or self.make_seconds > self.call_seconds:
            return MOST_SPARES
        return 1

    def _make(self, size: int, background: bool = False) -> Slab:
        if self.limit is None:
            self.limit = _pinned_limit()
        pin = self.device is not None and self.pinned_bytes() + _round(size) <= self.limit
        if self.device is not None and not pin and not self.warned_unpinned:
            self.warned_unpinned = True
            logger.warning(
                "states-through-shared-memory: the worker's pinned states memory would pass %.1f GiB (%s); further "
                "slabs are pageable and copies into them slower. Drop or save earlier results sooner, or raise %s.",
                self.limit / 2**30,
                "held by results still alive in the generator's process",
                ENV_PINNED_LIMIT,
            )
        started = time.perf_counter()
        slab = Slab.make(size, self.device, pin, background)
        if background:
            self.make_seconds = time.perf_counter() - started
        return slab

    def prepare(self, size: int, device: int | None) -> None:
        """Make, in a thread, the first call's slab and the spares after it (``size`` bytes each, an estimate, before
        the first call): ``results = generate(...)`` in a loop keeps one call's results while the next runs, and a
        warm-up's kept results add one more. Later spares follow the calls actually made."""
        self.device = device
        if self.expected or self.slabs:
            return

        self._make_in_background(size, 1 + self.spares())

    def take(self, size: int) -> tuple[Slab, dict[str, Any]]:
        """A free slab of at least ``size`` bytes for one call (made now only where none is ready)."""
        started = time.perf_counter()
        if self.last_take is not None:
            interval = started - self.last_take
            self.call_seconds = interval if self.call_seconds is None else min(self.call_seconds, interval)
        self.last_take = started
        slab = self._take_free(size)
        maker = self.maker
        if slab is None and maker is not None:
            maker.join()  # a spare on its way: it is what this call needs
            slab = self._take_free(size)
        waited = time.perf_counter() - started
        made = slab is None
        if slab is None:
            slab = self._make(size)
        with self.lock:
            self.slabs.append(slab)
            slab.busy = True  # in use by this call until it is handed over (or given back)
        self.expected = max(self.expected, size)
        self._retire_extra(keep=slab)
        self._spares_in_background(self.expected)
        return slab, {"waited_seconds": waited, "made_now": made, "slab_bytes": slab.size, "pinned": slab.pinned}

    def _take_free(self, size: int) -> Slab | None:
        with self.lock:
            free = [s for s in self.slabs if s.size >= size and s.is_free()]
            slab = min(free, key=lambda s: s.size) if free else None
            if slab is not None:
                self.slabs.remove(slab)
        return slab

    def _ready(self, want: int) -> int:
        """Free slabs of ``want`` bytes known to be free: never handed over, or found free by a take since. Never asks
        a handed slab's lock: from the maker's thread that could run between the worker's hand-over and the caller
        taking its lock, and find a slab free whose states the caller is about to map."""
        with self.lock:
            return sum(1 for s in self.slabs if s.size >= want and not s.busy and not s.handed)

    def _spares_in_background(self, want: int) -> None:
        """Where fewer than ``spares()`` free slabs of ``want`` bytes are ready, start making them, one after the
        other, each with room for a somewhat longer call."""
        if not want or (self.maker is not None and self.maker.is_alive()) or self._ready(want) >= self.spares():
            return
        self._make_in_background(want + want // 4, MOST_SPARES, lambda: self._ready(want) >= self.spares())

    def _make_in_background(self, size: int, count: int, enough: Callable[[], bool] = lambda: False) -> None:
        """Start the maker thread: up to ``count`` slabs of ``size`` bytes, one after the other, until ``enough()``."""

        def run() -> None:
            for _ in range(count):
                if enough():
                    return
                try:
                    slab = self._make(size, background=True)
                except OSError as exc:
                    logger.debug("states-through-shared-memory: no slab made ahead (%s)", exc)
                    return
                with self.lock:
                    self.slabs.append(slab)

        self.maker = threading.Thread(target=run, name="vllm_compat_slab", daemon=True)
        self.maker.start()

    def _retire_extra(self, keep: Slab) -> None:
        """Close free slabs but the spares: the smallest that fit the largest call so far. Memory the caller gave back
        goes back, and a slab made for an estimate goes once the calls are known to be smaller. Closed in a thread:
        unregistering from CUDA is not for the call that is starting."""
        with self.lock:
            free = sorted((s for s in self.slabs if s is not keep and s.is_free()), key=lambda s: s.size)
            fitting = [s for s in free if s.size >= self.expected]
            spares = fitting[: self.spares()] if fitting else free[-1:]
            extra = [s for s in free if s not in spares]
            for slab in extra:
                self.slabs.remove(slab)
        if extra:
            closer = threading.Thread(target=_close_all, args=(extra,), name="vllm_compat_slab_close", daemon=True)
            closer.start()
            self.closers = [t for t in self.closers if t.is_alive()] + [closer]

    def close(self) -> None:
        if self.maker is not None:
            self.maker.join(timeout=30)
        for closer in self.closers:
            closer.join(timeout=30)
        with self.lock:
            slabs, self.slabs = self.slabs, []
        for slab in slabs:
            slab.close()


def _close_all(slabs: list[Slab]) -> None:
    for slab in slabs:
        slab.close()


class _Channel:
    """The worker's connection to the generator's process, over which slab descriptors travel."""

    def __init__(self, address: str, key: str) -> None:
        self.token = secrets.token_hex(16)
        self.serial = 0  # hand-overs sent on this connection: the receiver reads them in this order
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self.sock.connect(address)
            self.sock.sendall(_HELLO.pack(_MAGIC, self.token.encode(), os.getpid(), key.encode()))
        except OSError:
            self.sock.close()
            raise
        self.lock = threading.Lock()

    def send(self, size: int, fd: int) -> int:
        """Pass ``fd`` over; the hand-over's serial number."""
        with self.lock:
            self.serial += 1
            socket.send_fds(self.sock, [_HEADER.pack(self.serial, size)], [fd])
            return self.serial


_CHANNEL: list[_Channel | None] = []
_STATS: dict[str, Any] = {}


def _channel() -> _Channel | None:
    """This worker's channel to the generator's process (None where it has none: the states then take the RPC
    reply, the slow way)."""
    if _CHANNEL:
        return _CHANNEL[0]
    address = os.environ.get(ENV_SOCKET)
    channel = None
    if address:
        try:
            channel = _Channel(*_decode_address(address))
        except OSError as exc:
            logger.warning(
                "states-through-shared-memory: cannot reach the generator's process at its socket (%s); captured "
                "states go through vLLM's message queue instead (slower)",
                exc.strerror or exc,
            )
    _CHANNEL.append(channel)
    return channel


def send_slab(slab: Slab, used: int, spec: Any, pieces: list[tuple[int, int]]) -> StatesHandle | None:
    """Hand ``used`` bytes of ``slab`` over: its descriptor goes to the generator's process now, the returned handle
    travels in the RPC reply. None where this worker has no channel (the caller then replies the usual way)."""
    channel = _channel()
    if channel is None:
        return None
    slab.handed, slab.busy = True, False  # from now on, the generator's process's lock says when it is free
    try:
        serial = channel.send(used, slab.fd)
    except OSError as exc:
        raise TransportError(f"cannot pass the states' descriptor to the generator's process ({exc})") from exc
    return StatesHandle(channel.token, os.getpid(), serial, used, spec, pieces)


def worker_stats() -> dict[str, Any]:
    """The last call's hand-over in this worker: bytes, seconds (exposed, after the call's last step),
    overlapped_seconds (spent during the steps), slab_reused, made_now, waited_seconds, pinned, direct."""
    return dict(_STATS)


def record_stats(**values: Any) -> None:
    _STATS.clear()
    _STATS.update(values)


class StatesHandle:
    """A picklable handle to one call's states; unpickling it (in the generator's process) receives the slab."""

    def __init__(self, token: str, pid: int, serial: int, size: int, spec: Any, pieces: list[tuple[int, int]]) -> None:
        self.token, self.pid, self.serial, self.size, self.spec, self.pieces = token, pid, serial, size, spec, pieces

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (open_states, (self.token, self.pid, self.serial, self.size, self.spec, self.pieces))


# -- the generator's side: receiving -------------------------------------------------------------------------------


def _encode_address(address: str, key: str) -> str:
    """The value of ``ENV_SOCKET``: the socket's address (``@`` for an abstract one) and the key a worker presents."""
    return ("@" + address[1:] if address.startswith("\0") else address) + "#" + key


def _decode_address(text: str) -> tuple[str, str]:
    address, _, key = text.rpartition("#")
    if not address:
        address, key = text, ""
    return ("\0" + address[1:] if address.startswith("@") else address), key


class _Pending:
    """A connection accepted but not yet known: the bytes of its hello so far, and when it must have said it all."""

    __slots__ = ("data", "deadline", "peer_pid", "peer_uid")

    def __init__(self, peer_pid: int, peer_uid: int) -> None:
        self.data = b""
        self.deadline = time.monotonic() + _HELLO_TIMEOUT
        self.peer_pid, self.peer_uid = peer_pid, peer_uid


class _Receiver:
    """The generator's process's socket: workers connect once and send each slab's descriptor before their reply.

    A connection is taken only from a process of this user that presents, with its own pid, the key this receiver
    gave its workers through the environment (``ENV_SOCKET``). Connections are read without blocking, each given
    ``_HELLO_TIMEOUT`` to say who it is: a stranger that connects and stays silent is closed then, and never holds up
    a worker's connection meanwhile."""

    def __init__(self) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        name = f"\0vllm-compat-{os.getpid()}-{secrets.token_hex(8)}"  # abstract: no file, gone with the process
        self.listener.bind(name)
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.key = secrets.token_hex(16)
        self.address = _encode_address(name, self.key)
        self.pid = os.getpid()
        self.conns: dict[str, socket.socket] = {}  # worker token -> its connection
        self.pids: dict[str, int] = {}  # worker token -> its pid
        self.pending: dict[socket.socket, _Pending] = {}
        self.lock = threading.Lock()

    def receive(self, token: str, pid: int, serial: int, size: int) -> int:
        """The descriptor the worker ``token`` sent for hand-over ``serial``."""
        deadline = time.monotonic() + _RECV_TIMEOUT
        with self.lock:
            conn = self.conns.get(token) or self._accept_until(token, pid, deadline)
            while True:
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                try:
                    msg, fds, _flags, _addr = socket.recv_fds(conn, _HEADER.size, 1)
                except (TimeoutError, OSError) as exc:
                    raise TransportError(
                        f"no states descriptor from worker pid {pid} (hand-over {serial}): {exc}. Did the worker die?"
                    ) from exc
                if len(msg) != _HEADER.size or len(fds) != 1:
                    for fd in fds:
                        os.close(fd)
                    raise TransportError(f"worker pid {pid} sent a malformed states message ({len(msg)} bytes)")
                got, got_size = _HEADER.unpack(msg)
                if got == serial and got_size == size:
                    return fds[0]
                os.close(fds[0])  # an earlier hand-over whose reply never reached this process
                if got > serial:
                    raise TransportError(f"worker pid {pid} sent hand-over {got} while {serial} was expected")

    def discard(self, token: str, serial: int) -> None:
        """Close, without waiting, the descriptors worker ``token`` sent up to hand-over ``serial`` (its reply is being
        dropped: vllm_compat.recovery)."""
        with self.lock:
            conn = self.conns.get(token)
            if conn is None:
                return  # never accepted: the next receive from it skips the earlier hand-overs
            while True:
                try:
                    msg, fds, _flags, _addr = socket.recv_fds(conn, _HEADER.size, 1, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    return
                for fd in fds:
                    os.close(fd)
                if len(msg) != _HEADER.size or _HEADER.unpack(msg)[0] >= serial:
                    return

    def forget(self, pids: set[int]) -> None:
        """Close the connections of the worker processes ``pids`` (their executor was shut down)."""
        with self.lock:
            for token in [t for t, p in self.pids.items() if p in pids]:
                self._drop(token)

    def _drop(self, token: str) -> None:
        conn = self.conns.pop(token, None)
        self.pids.pop(token, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()

    def _prune(self) -> None:
        """Close the connections whose worker has gone (hung up), so none is kept for a process that exited."""
        poller = select.poll()
        by_fd = {}
        for token, conn in self.conns.items():
            by_fd[conn.fileno()] = token
            poller.register(conn, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        for fd, _events in poller.poll(0):
            self._drop(by_fd[fd])

    def _accept_until(self, token: str, pid: int, deadline: float) -> socket.socket:
        self._prune()
        with selectors.DefaultSelector() as selector:
            selector.register(self.listener, selectors.EVENT_READ)
            for conn in self.pending:
                selector.register(conn, selectors.EVENT_READ)
            while True:
                now = time.monotonic()
                for conn in [c for c, p in self.pending.items() if p.deadline <= now]:
                    self._refuse(selector, conn, "it did not say who it is in time")
                if now >= deadline:
                    raise TransportError(f"worker pid {pid} never connected to this process")
                wait = min([deadline, *(p.deadline for p in self.pending.values())]) - now
                for key, _events in selector.select(max(wait, 0.001)):
                    if key.fileobj is self.listener:
                        self._accept(selector)
                        continue
                    found = self._hello(selector, key.fileobj)
                    if found == token:
                        return self.conns[token]

    def _accept(self, selector: selectors.BaseSelector) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                logger.debug("states-through-shared-memory: accept failed (%s)", exc)
                return
            try:
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                peer_pid, peer_uid, _gid = struct.unpack("3i", creds)
            except (OSError, struct.error):
                conn.close()
                continue
            if peer_uid != os.geteuid():
                logger.warning(
                    "states-through-shared-memory: refused a connection from pid %d (uid %d)", peer_pid, peer_uid
                )
                conn.close()
                continue
            conn.setblocking(False)
            self.pending[conn] = _Pending(peer_pid, peer_uid)
            selector.register(conn, selectors.EVENT_READ)

    def _hello(self, selector: selectors.BaseSelector, conn: Any) -> str | None:
        """Read what ``conn`` has sent of its hello; the worker's token once it is complete and right."""
        pending = self.pending[conn]
        try:
            part = conn.recv(_HELLO.size - len(pending.data))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            part = b""
        if not part:
            self._refuse(selector, conn, "it hung up before saying who it is", quiet=True)
            return None
        pending.data += part
        if len(pending.data) < _HELLO.size:
            return None
        magic, their_token, their_pid, key = _HELLO.unpack(pending.data)
        if magic != _MAGIC or their_pid != pending.peer_pid or not secrets.compare_digest(key, self.key.encode()):
            self._refuse(selector, conn, "it is not one of this process's vLLM workers")
            return None
        del self.pending[conn]
        selector.unregister(conn)
        conn.setblocking(True)
        token = their_token.decode()
        self.conns[token] = conn
        self.pids[token] = their_pid
        return token

    def _refuse(self, selector: selectors.BaseSelector, conn: Any, why: str, quiet: bool = False) -> None:
        pending = self.pending.pop(conn)
        selector.unregister(conn)
        conn.close()
        (logger.debug if quiet else logger.warning)(
            "states-through-shared-memory: refused a connection from pid %d (uid %d): %s",
            pending.peer_pid,
            pending.peer_uid,
            why,
        )


_RECEIVER: list[_Receiver] = []
_RECEIVER_LOCK = threading.Lock()


def forget_workers(pids: set[int]) -> None:
    """Close this process's connections from the worker processes ``pids`` (their executor was shut down)."""
    receiver = _RECEIVER[0] if _RECEIVER and _RECEIVER[0].pid == os.getpid() else None
    if receiver is not None and pids:
        receiver.forget(pids)


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


def receiver_address() -> str | None:
    """The address of this process's receiving socket (made on first use), for the workers it is about to start;
    None where it cannot be made (the states then take the RPC reply)."""
    with _RECEIVER_LOCK:
        if _RECEIVER and _RECEIVER[0].pid == os.getpid():
            return _RECEIVER[0].address
        _RECEIVER.clear()
        try:
            _RECEIVER.append(_Receiver())
        except OSError as exc:
            logger.warning("states-through-shared-memory: no receiving socket (%s); states take the RPC reply", exc)
            return None
        return _RECEIVER[0].address


# -- the generator's side: memory maps the tensors own -------------------------------------------------------------


class _Libc:
    """``mmap``/``munmap`` from the C library: the mapping's life is then the buffer's, and the lease (one descriptor
    with its lock) is held by the buffer's finalizer alone."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols, libc's among them: no library search
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self.munmap = libc.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.madvise = libc.madvise
        self.madvise.restype = ctypes.c_int
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


_LIBC: list[_Libc] = []
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> _Libc:
    if not _LIBC:
        _LIBC.append(_Libc())
    return _LIBC[0]


class _Maps:
    """How many slab mappings this process holds (one per call whose states are alive here)."""

    def __init__(self) -> None:
        self.live = 0


_MAPS = _Maps()


class _Lease:
    """This process's hold on one slab: a descriptor of its own with a shared lock on it, open while any mapping of the
    slab lives (every mapping's finalizer holds the lease)."""

    __slots__ = ("__weakref__", "fd")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        weakref.finalize(self, _close_quietly, fd).atexit = False


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _map_private(lease: _Lease, offset: int, nbytes: int) -> tuple[Any, int]:
    """A private (copy-on-write) mapping of ``nbytes`` of the slab at ``offset``: (buffer, where the bytes start in
    it). The buffer unmaps itself when the last reference to it goes, and lets go of the lease then."""
    libc = _libc()
    start = offset - offset % _PAGE
    span = offset + nbytes - start
    addr = libc.mmap(None, span, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, lease.fd, start)
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

    receiver = _RECEIVER[0] if _RECEIVER and _RECEIVER[0].pid == os.getpid() else None
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
    lease = _Lease(own)
    fcntl.flock(own, fcntl.LOCK_SH)  # the worker leaves the slab alone while any process holds this
    handed = handed_over_type()
    if not size:
        block = torch.empty(0, dtype=torch.uint8)
    else:
        buffer = _map_private(lease, 0, size)[0]
        start = ctypes.addressof(buffer)
        copies = _copy_ahead(buffer, pieces) if copy_mode() else None
        _SOURCES.add(start, start + size, buffer, copies)
        weakref.finalize(buffer, _SOURCES.drop, start).atexit = False
        block = torch.frombuffer(buffer, dtype=torch.uint8)
    return _replace(spec, Slot, lambda slot: _view(block, slot).as_subclass(handed))


def _check_slab(fd: int, size: int, pid: int) -> None:
    st = os.fstat(fd)
    if st.st_size < size:
        raise TransportError(f"worker pid {pid} handed over {st.st_size} bytes of memory for {size} bytes of states")
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & _SEALS != _SEALS:
        raise TransportError(f"worker pid {pid} handed over memory whose size is not sealed (seals {seals:#x})")


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


def __getattr__(name: str) -> Any:
    if name == "HandedOverStates":  # found by name when one is unpickled
        return handed_over_type()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _forget_in_forked_child() -> None:
    """A forked child (a vLLM worker under the fork start method, a DataLoader worker) keeps the mappings and leases
    it inherited (its snapshot), but not this process's socket, channel, slabs or locks: it makes its own."""
    _SOURCES.lock = threading.Lock()
    global _RECEIVER_LOCK
    _RECEIVER_LOCK = threading.Lock()
    for receiver in _RECEIVER:
        with contextlib.suppress(OSError):
            receiver.listener.close()
        for conn in [*receiver.conns.values(), *receiver.pending]:
            with contextlib.suppress(OSError):
                conn.close()
    _RECEIVER.clear()
    _CHANNEL.clear()
    _STATS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_forked_child)
