"""The worker's side: the slabs a vLLM worker writes each call's captured states into.

Runs in the vLLM worker process of the rank that captures (vllm_compat.capture keeps one ``Slabs`` there). A slab is
made (anonymous shared memory with every page in place, by a few threads with the GIL released), registered with
CUDA as pinned memory in pieces, and sealed; ``Slabs`` gives each call a free slab that fits (``_take_free``), keeps
spares ready from a maker thread, and closes the slabs it no longer needs. A slab handed over is free again once no
process holds a lock on it (vllm_compat.transport.caller takes that lock in the generator's process).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import math
import mmap
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from vllm_compat.transport._libc import _MAP_FAILED, _Libc, _libc
from vllm_compat.transport.layout import ENV_PINNED_LIMIT, SIZE_SEALS

logger = logging.getLogger("vllm_compat")

_STEP = 2 << 20  # slab sizes are whole 2 MiB
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # map every page up front: no page faults while copying
_MADV_POPULATE_WRITE = 23  # Linux 5.14: put a range's pages in place, an error (not SIGBUS) where memory is short
_FILL_THREADS = 8  # a slab's pages are put in place by up to this many threads at once (the kernel zero-fills each)
# Where a slab is made in the background, each thread fills its share in chunks of this size, each between calls: a
# chunk begun just before a call goes on into its first step. 2 MiB took 2 to 3 ms on an H100 host between calls,
# and up to 0.22 s in a gap where the generator's process did memory work of its own (bench --trace-slabs).
_FILL_CHUNK = _STEP
# Slabs are registered with CUDA in pieces of this size, with a pause between pieces when made while a call runs:
# the driver holds up the worker's kernel launches and copies while it registers (on an H200, 27 ms for a 640 MiB
# slab at once, under 1.2 ms with pieces). A copy may not cross the border of two registrations (the driver refuses
# it: invalid argument), so the capture splits copies at these borders.
PIN_PIECE = 32 << 20
_PIN_PAUSE = 0.001
GATE_SECONDS = 10.0  # the longest a piece or chunk of background work waits for the call in flight to end
_F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1; Python's fcntl does not name it


def _round(n: int, step: int = _STEP) -> int:
    return max(-(-n // step) * step, step)


class Slab:
    """Sealed anonymous shared memory the worker writes a call's states into; handed over by descriptor."""

    def __init__(self, fd: int, size: int, buffer: Any, block: Any, piece: int, device: int | None) -> None:
        self.fd, self.size, self.buffer, self.block = fd, size, buffer, block
        self.piece, self.device = piece, device  # piece: registered with CUDA in pieces of this size (0: pageable)
        self.busy = False  # taken by a call whose states are being written
        self.handed = False  # handed over, and maybe still mapped by the generator's process
        self.call = 0  # the number of the call that took it last (Slabs.takes then)
        self.free_since: float | None = None  # when the pool last saw it free (None while taken or handed over)
        self.serial = 0  # the hand-over it was sent in last (the channel's serial)

    @property
    def pinned(self) -> bool:
        return self.piece > 0

    @classmethod
    def make(
        cls, size: int, device: int | None, pin: bool, gate: Callable[[], None] | None = None, pause: bool = False
    ) -> Slab:
        """A slab of ``size`` bytes (whole 2 MiB) with every page in place; OSError where memory is short.

        Everything slow here runs with the GIL released (the kernel zero-filling the pages, by a few threads; CUDA
        registering them, in pieces), so a slab made in the background while a call runs does not hold the call up:
        Python's own ``mmap`` keeps the GIL while it populates a mapping, which stopped a worker's steps for as long
        (0.26 s for 640 MiB on an H200 host). ``gate``: given for a slab made in the background, called before each
        chunk of pages is put in place and before each piece is registered (see ``Slabs.between_calls``).
        ``pause``: a pause after each piece registered (implied by ``gate``), for a slab made in the background
        that a call may need before the next gap."""
        size = _round(size)
        fd = os.memfd_create("vllm-compat-states", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            addr = _map_filled(fd, size, gate)
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
        pause_s = _PIN_PAUSE if gate is not None or pause else 0.0
        piece = _pin(block, device, pause_s, gate) if pin and device is not None else 0
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

    def close(self, gate: Callable[[], None] | None = None) -> None:
        """Unregister and let go: the mapping goes with the last tensor viewing it. ``gate``: given where closed while
        calls may run (pieces unregistered with pauses between them, each after ``gate()``)."""
        if self.block is None:
            return
        if self.pinned:
            _unpin(self.block, self.device, self.piece, _PIN_PAUSE if gate else 0.0, gate)
            self.piece = 0
        self.block = self.buffer = None
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1


def _map_filled(fd: int, size: int, gate: Callable[[], None] | None = None) -> int:
    """Map ``size`` bytes of ``fd`` shared, every page in place (ENOMEM/ENOSPC now, not SIGBUS at the first write):
    by a few threads at once where the kernel populates ranges on request (``MADV_POPULATE_WRITE``), else by
    ``fallocate`` and a populated mapping. The address; the calls go through ctypes, which releases the GIL.
    ``gate``: called before each chunk (``_FILL_CHUNK``) of each thread's share, for a slab made in the background."""
    libc = _libc()
    addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
    try:
        if _populate(libc, addr, size, gate):
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


def _populate(libc: _Libc, addr: int, size: int, gate: Callable[[], None] | None = None) -> bool:
    """Put every page of the mapping in place, split among threads: False where this kernel cannot (before 5.14).
    With ``gate``, each thread fills its share a chunk at a time, each chunk after ``gate()``: zero-filling takes the
    host's memory bandwidth and the worker's address-space lock, which the worker's steps need too."""
    threads = max(1, min(_FILL_THREADS, os.cpu_count() or 1, size // _STEP))
    share = _round(-(-size // threads))
    ranges = [(at, min(share, size - at)) for at in range(0, size, share)]
    errors: list[int] = []
    chunk = _FILL_CHUNK if gate is not None else size

    def fill(at: int, n: int) -> None:
        for start in range(at, at + n, chunk):
            if gate is not None:
                gate()
            if libc.madvise(addr + start, min(chunk, at + n - start), _MADV_POPULATE_WRITE) != 0:
                errors.append(ctypes.get_errno())
                return

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
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS | _F_SEAL_FUTURE_WRITE)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # a kernel before 5.1 knows no future-write seal: seal the size only
            raise
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)


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


def _pin(block: Any, device: int, pause: float, gate: Callable[[], None] | None = None) -> int:
    """Register the slab with CUDA (page-locked) in pieces of ``PIN_PIECE``, so copies from the GPU into it are
    asynchronous DMAs: the piece size, or 0 where it cannot be registered (copies then work at pageable speed)."""
    import torch

    start, size = block.data_ptr(), block.numel()
    done: list[int] = []
    try:
        cudart = torch.cuda.cudart()
        with torch.cuda.device(device):
            for at in range(0, size, PIN_PIECE):
                if gate is not None:
                    gate()
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


def _unpin(
    block: Any, device: int | None, piece: int, pause: float = 0.0, gate: Callable[[], None] | None = None
) -> None:
    start = block.data_ptr()
    _unregister([start + at for at in range(0, block.numel(), piece)], device, pause, gate)


def _unregister(
    addresses: list[int], device: int | None, pause: float = 0.0, gate: Callable[[], None] | None = None
) -> None:
    """Unregister each piece; with ``pause`` between pieces, as registering does: a slab closed in the background
    while a call runs unpins up to gigabytes, and each piece holds the CUDA driver's lock that the worker's steps
    need to launch their work (on an H200 the two slow large-preset calls of eight were those during which 4 GiB
    slabs were closed and right-sized ones made)."""
    import torch

    with contextlib.suppress(Exception), torch.cuda.device(device):
        cudart = torch.cuda.cudart()
        for k, address in enumerate(addresses):
            if pause and k:
                time.sleep(pause)  # the driver is the worker's steps' meanwhile
            if gate is not None:
                gate()
            cudart.cudaHostUnregister(address)


def _raise_descriptor_limit() -> None:
    """Let this worker open as many descriptors as its hard limit allows: each slab whose states the caller keeps
    holds one here, and a soft limit of 1024 (a common default) stopped a caller keeping every result at about call
    938. vLLM raises the same limit in its own server processes."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))  # the hard limit stays as it was
            logger.debug("states-through-shared-memory: descriptor limit raised from %d to %d", soft, target)
    except (ImportError, ValueError, OSError) as exc:
        logger.debug("states-through-shared-memory: descriptor limit left as it is (%r)", exc)


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
AHEAD = 2  # slabs made at start besides the spares: a call's and the previous call's results' (see prepare)
RECENT_CALLS = 16  # spares are sized for the largest of the last this many calls: they shrink when calls do
OVERSIZE = 2  # a free slab more than this many times the largest recent call is closed, not kept as a spare
MEMORY_SHARE = 4  # slabs made ahead (at start, and spares) take at most 1/this of the memory still available
GRACE_SLABS = 2  # free slabs of the right size kept beyond the spares for a while after they were given back
GRACE_SECONDS = (1.0, 30.0)  # that while: three times the longest recent interval between calls, within these


def available_memory() -> int | None:
    """Bytes this process can still take before the host or its memory cgroup runs out, or None where neither says.

    The smaller of the host's ``MemAvailable`` and the cgroup's limit less what it holds, its reclaimable page cache
    (``inactive_file``) not counted as held: cgroup v2 (``memory.max``) or v1 (``memory.limit_in_bytes``). A slab is
    shared memory charged to the worker's cgroup, so a container's limit is what a worker must stay under."""
    found: list[int] = []
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    with contextlib.suppress(OSError, ValueError):
        room = _cgroup_room()
        if room is not None:
            found.append(room)
    return min(found) if found else None


def _cgroup_room() -> int | None:
    """The room left under the memory limit of this process's cgroup (v2, or v1's memory controller), None where no
    limit is set or none can be read. In a cgroup namespace the process's own cgroup is the root of the mount."""
    with open("/proc/self/cgroup") as f:
        entries = [line.rstrip("\n").split(":", 2) for line in f]
    for _id, controllers, path in entries:
        if controllers == "":  # v2 (mounted alone, or beside v1 as "unified")
            bases = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
            files = ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1
            bases = ("/sys/fs/cgroup/memory",)
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        for base in bases:
            for folder in (os.path.join(base, path.lstrip("/")), base):
                if os.path.exists(os.path.join(folder, files[0])):
                    return _room_in(folder, *files)
    return None


def _room_in(folder: str, limit_file: str, usage_file: str, inactive: str) -> int | None:
    with open(os.path.join(folder, limit_file)) as f:
        text = f.read().strip()
    if text == "max" or int(text) >= 1 << 60:
        return None  # no limit here
    with open(os.path.join(folder, usage_file)) as f:
        used = int(f.read())
    with contextlib.suppress(OSError, ValueError), open(os.path.join(folder, "memory.stat")) as f:
        for line in f:
            key, _, value = line.partition(" ")
            if key == inactive:
                used -= int(value)
    return max(int(text) - used, 0)


class Slabs:
    """A worker's slabs: a call takes a free one that fits (the right size, in turn), and a thread keeps spares ready.

    Host memory: the slabs the generator's process still maps (a slab per call whose results are alive there) plus
    at most ``MOST_SPARES`` free ones (one where making a slab takes less time than a call: see ``spares``), each
    between the largest of the last ``RECENT_CALLS`` calls and ``OVERSIZE`` times it, and for ``grace()`` seconds after
    the caller gave slabs back up to ``GRACE_SLABS`` more of that size. Before the first call, ``AHEAD`` slabs for the
    estimated first call and the results a loop keeps while the next runs, and the spares, all within
    ``1/MEMORY_SHARE`` of the memory available. A slab the caller lets go of is found free when the caller says so
    (``reclaim``), not at the next call. Pinned memory: at most ``_pinned_limit()``; slabs beyond it stay pageable
    (copies into them are synchronous, slower).
    """

    def __init__(self) -> None:
        self.slabs: list[Slab] = []
        self.lock = threading.Lock()
        self.added = threading.Condition(self.lock)  # notified each time the maker adds a slab
        self.adds = 0  # slabs the maker added so far
        self.maker: threading.Thread | None = None
        self.device: int | None = None
        self.estimate = 0  # the first call's size as guessed before it (prepare)
        self.recent: deque[int] = deque(maxlen=RECENT_CALLS)  # the sizes of the last calls
        self.intervals: deque[float] = deque(maxlen=RECENT_CALLS)  # the seconds between the last calls' takes
        self.timer: threading.Timer | None = None  # closes slabs kept for a while once the while is over
        self.takes = 0  # calls that took a slab so far
        self.limit: int | None = None
        self.warned_unpinned = False
        self.closers: list[threading.Thread] = []
        self.make_seconds = 0.0  # how long making the last slab in the background took
        self.call_seconds: float | None = None  # the shortest time between two calls' takes so far
        self.last_take: float | None = None
        self.between_calls = threading.Event()  # set while no call is in flight: from a hand-over to the next plan
        self.between_calls.set()
        self.made = [0, 0]  # slabs made over the worker's life, and their bytes (see history)
        self.closed = [0, 0]  # slabs let go of (closed, or handed to a closing thread), and their bytes

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

    def _make(self, size: int, background: bool = False, gated: bool = True) -> Slab:
        """A slab of ``size`` bytes. ``background``: made by the maker thread while calls may run, its slow work
        between calls where ``gated``, else at once (with pauses between CUDA pieces)."""
        if self.limit is None:
            self.limit = _pinned_limit()
            _raise_descriptor_limit()
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
        gate = self.wait_between_calls if background and gated else None
        slab = Slab.make(size, self.device, pin, gate, pause=background)
        if background:
            self.make_seconds = time.perf_counter() - started
        with self.lock:
            self.made[0] += 1
            self.made[1] += slab.size
        return slab

    def wait_between_calls(self) -> None:
        """Hold background slab work (a chunk of pages filled, a piece registered or unregistered) until no call is
        in flight: each piece holds the CUDA driver's lock that the worker's steps launch their work under, and
        zero-filling takes the host's memory bandwidth; on an H200 a call beside which a slab was made lost 25 to
        35 ms (70 ms for 1.25 GiB), on an H100 one beside 4 GiB unregistered 13 %. Between calls the GPU waits for
        the generator's process anyway. A call longer than ``GATE_SECONDS`` lets it through."""
        self.between_calls.wait(GATE_SECONDS)

    def call_started(self) -> None:
        """A call is in flight from its plan's arrival (before its first step launches its work) to its hand-over."""
        self.between_calls.clear()

    def call_ended(self) -> None:
        """The call in flight handed its states over, failed, or was given up: background slab work may run."""
        self.between_calls.set()

    def history(self) -> dict[str, int]:
        """Slabs made and let go of so far, and their bytes: the difference between two calls is the background work
        (populating, pinning, unpinning) that ran beside the later one's steps."""
        with self.lock:
            return {
                "slabs_made": self.made[0],
                "bytes_made": self.made[1],
                "slabs_closed": self.closed[0],
                "bytes_closed": self.closed[1],
            }

    def prepare(self, size: int, device: int | None) -> None:
        """Make, in a thread, what a loop needs before its first call (``size`` bytes each, an estimate): the call's
        slab, the slab of the previous call's results (``results = generate(...)`` in a loop keeps them while the next
        call runs) and the spares. Made in the loop's first calls instead, each ran 25-35 ms slower beside the making
        (an H200, vLLM 0.34.0 and 0.26.0, 0.13 s calls). Later spares follow the calls actually made.

        The first ``AHEAD`` are made at once, whether a call is in flight or not: where vLLM's warm-up sent its plan
        before they were made, a call that found none free waited for the maker, which fills only between calls
        (on an H100, the large preset's second call waited 3.8 s for 4 GiB slabs: 0.21x prefill's speed). A call
        beside them loses less than that. The spares wait for the gaps, and are not made at all once a call shows
        the estimate more than ``OVERSIZE`` times too large (see ``_estimate_too_large``).

        All of them within ``1/MEMORY_SHARE`` of the memory available now: the estimate is the largest call the
        scheduler allows (its most sequences at the context length), 2 GiB a slab for a small model at 16k tokens,
        and three such slabs got a worker OOM-killed under a 4 GiB container limit before its first call."""
        self.device = device
        if self.recent or self.slabs:
            return
        count = AHEAD + self.spares()
        room = available_memory()
        if room is not None:
            budget = room // MEMORY_SHARE
            if budget < _STEP:
                logger.debug("states-through-shared-memory: no slab made ahead (%d bytes available)", room)
                return
            size = min(size, budget)
            count = max(1, min(count, budget // _round(size)))
        self.estimate = size
        logger.debug("states-through-shared-memory: %d slab(s) of %d bytes made ahead (available: %s)", count, size,
                     room)  # fmt: skip
        self._make_in_background(size, count, lambda: self._estimate_too_large(size), at_once=AHEAD)

    def _estimate_too_large(self, size: int) -> bool:
        """Whether calls so far show a slab of ``size`` bytes more than ``OVERSIZE`` times too large: it would only
        stand in until spares of the right size replace it, and while the maker makes it (a chunk each gap) no spare
        of the right size can be begun (the 8B-class preset's calls are a quarter of the scheduler's estimate)."""
        recent = list(self.recent)
        return bool(recent) and size > _round(OVERSIZE * max(recent))

    def reclaim(self, serials: list[int]) -> None:
        """The generator's process let go of the states of hand-overs ``serials``: close the slabs that are free now
        beyond the spares, instead of at the next call (which may never come, or fail for want of that memory)."""
        self._retire_extra(keep=None, released=set(serials))

    def _judged(self, slab: Slab, released: set[int] | None) -> bool:
        """Whether ``slab``'s lock may be asked now. Always from a call's own take (the caller took the lock of every
        earlier hand-over before it made this call); from a thread, only for a slab handed over before the last take
        or one the caller said it let go of: between a hand-over and the caller taking its lock, the slab looks free
        and is not."""
        return released is None or not slab.handed or slab.call < self.takes or slab.serial in released

    def expected(self) -> int:
        """The size spares are made for: the largest of the last calls, or the estimate before the first."""
        return max(self.recent) if self.recent else self.estimate

    def take(self, size: int) -> tuple[Slab, dict[str, Any]]:
        """A free slab of at least ``size`` bytes for one call (made now only where none is ready)."""
        started = time.perf_counter()
        if self.last_take is not None:
            interval = started - self.last_take
            self.call_seconds = interval if self.call_seconds is None else min(self.call_seconds, interval)
            self.intervals.append(interval)
        self.last_take = started
        slab = self._take_free(size)
        if slab is None:
            slab = self._take_next_made(size)
        waited = time.perf_counter() - started
        made = slab is None
        if slab is None:
            slab = self._make(size)
        with self.lock:
            self.takes += 1
            self.slabs.append(slab)
            slab.busy, slab.call = True, self.takes  # in use by this call until it is handed over (or given back)
        self.call_started()  # again, after any wait for the maker above: its pieces needed the gate open
        self.recent.append(size)
        self._retire_extra(keep=slab)
        self._spares_in_background(self.expected())
        return slab, {"waited_seconds": waited, "made_now": made, "slab_bytes": slab.size, "pinned": slab.pinned}

    def _take_next_made(self, size: int) -> Slab | None:
        """Where the maker is at work, the first slab it adds that fits ``size`` (None once it stops without one).
        Not the end of its run: at start it makes the spares too, and a call of the large preset on an H100 that
        waited for the maker's whole run waited 3.8 s for three 4 GiB slabs (0.21x prefill's speed) where it needed
        one. While the call waits its driver work must not wait for the call: the gate stays open until the take."""
        maker = self.maker
        if maker is None:
            return None
        self.between_calls.set()
        while True:
            with self.lock:
                seen = self.adds
            slab = self._take_free(size)
            if slab is not None or not maker.is_alive():
                return slab or self._take_free(size)
            with self.added:
                self.added.wait_for(lambda seen=seen: self.adds != seen, timeout=0.05)  # 0.05: the maker may stop

    def _take_free(self, size: int) -> Slab | None:
        """The free slab of the right size (``size`` to ``OVERSIZE`` times it) that has been free the longest, else the
        smallest that fits. Taking the smallest first left a larger slab of the right size free call after call (the
        first call's estimate-sized slabs beside smaller spares made since) until the grace period closed it, and its
        replacement was made at the next take: on an H200 (vLLM 0.34.0, 512 MiB calls 0.13 s apart) 5 slabs made and 2
        closed over 24 calls, the slowest calls beside them. Taken in turn, every slab the loop needs stays in use."""
        with self.lock:
            free = [s for s in self.slabs if s.size >= size and s.is_free()]
            right = [s for s in free if s.size <= _round(OVERSIZE * size)]
            if right:
                slab = min(right, key=lambda s: math.inf if s.free_since is None else s.free_since)
            else:
                slab = min(free, key=lambda s: s.size) if free else None
            if slab is not None:
                self.slabs.remove(slab)
                slab.free_since = None
        return slab

    def _ready(self, want: int) -> int:
        """Free slabs of ``want`` to ``OVERSIZE`` times ``want`` bytes known to be free: never handed over, or found
        free by a take since. A larger one is not counted: it stands in until a spare of the right size replaces it.
        Never asks a handed slab's lock: from the maker's thread that could run between the worker's hand-over and the
        caller taking its lock, and find a slab free whose states the caller is about to map."""
        most = _round(OVERSIZE * want)
        with self.lock:
            return sum(1 for s in self.slabs if want <= s.size <= most and not s.busy and not s.handed)

    def _spares_in_background(self, want: int) -> None:
        """Where fewer than ``spares()`` free slabs of ``want`` bytes are ready, start making them, one after the
        other, each with room for a somewhat longer call."""
        if not want or (self.maker is not None and self.maker.is_alive()) or self._ready(want) >= self.spares():
            return
        size, count = want + want // 4, MOST_SPARES
        room = available_memory()
        if room is not None and count * _round(size) > room // MEMORY_SHARE:
            count = room // MEMORY_SHARE // _round(size)
            if not count:  # short of memory: each call makes its own slab when it comes
                logger.debug("states-through-shared-memory: no spare made (%d bytes available)", room)
                return
        self._make_in_background(size, count, lambda: self._ready(want) >= self.spares(), tidy=True)

    def _make_in_background(
        self,
        size: int,
        count: int,
        enough: Callable[[], bool] = lambda: False,
        tidy: bool = False,
        at_once: int = 0,
    ) -> None:
        """Start the maker thread: up to ``count`` slabs of ``size`` bytes, one after the other, until ``enough()``;
        then, where ``tidy``, close the free slabs the new ones replace. The first ``at_once`` are made whether a
        call is in flight or not (and whatever ``enough()`` says), the rest only between calls."""

        def run() -> None:
            for k in range(count):
                if k >= at_once and enough():
                    return
                try:
                    slab = self._make(size, background=True, gated=k >= at_once)
                except OSError as exc:
                    logger.debug("states-through-shared-memory: no slab made ahead (%s)", exc)
                    return
                with self.added:
                    self.slabs.append(slab)
                    self.adds += 1
                    self.added.notify_all()
            if tidy:
                self._retire_extra(keep=None, released=set())  # spares ready: a larger free slab they replace can go

        self.maker = threading.Thread(target=run, name="vllm_compat_slab", daemon=True)
        self.maker.start()

    def grace(self) -> float:
        """How long a free slab of the right size stays beyond the spares after it was given back: three times the
        longest of the last intervals between calls (between ``GRACE_SECONDS``), so that a caller whose number of
        kept calls varies from call to call finds it again at its next call."""
        longest = max(self.intervals, default=0.0)
        low, high = GRACE_SECONDS
        return min(high, max(low, 3 * longest))

    def _retire_extra(self, keep: Slab | None, released: set[int] | None = None) -> None:
        """Close free slabs but the spares: the smallest that fit the largest recent call and are at most ``OVERSIZE``
        times it (a larger one stands in only until spares of the right size are ready). Memory the caller gave back
        goes back, and a slab made for an estimate, or for calls larger than today's, goes once the calls are known
        to be smaller. Closed in a thread: unregistering from CUDA is not for the call that is starting. ``released``:
        from a thread, the hand-overs the caller said it let go of (see ``_judged``); None from a call's take.

        Up to ``GRACE_SLABS`` free slabs of the right size beyond the spares stay for ``grace()`` seconds after they
        were found free, then go (a timer comes back for them, with or without another call). A caller that keeps
        each call's results while the next runs gives a slab back after the next call took a spare; closing it then
        and making its replacement at the next take made one slab and closed one beside every call's steps (replayed
        on a CPU from the benchmark's calls: 1.25 GiB pinned and unpinned a call on its large preset). Slabs beyond
        those go at once: a caller dropping many calls' results gets their memory back before its next call."""
        now = time.monotonic()
        with self.lock:
            expected = self.expected()
            candidates = [s for s in self.slabs if s is not keep and self._judged(s, released)]
            free = sorted((s for s in candidates if s.is_free()), key=lambda s: s.size)
            for slab in free:
                slab.free_since = now if slab.free_since is None else slab.free_since
            fitting = [s for s in free if s.size >= expected]
            right = [s for s in fitting if s.size <= _round(OVERSIZE * expected)]  # whole 2 MiB, as slabs are
            spares = (right + [s for s in fitting if s not in right])[: self.spares()]
            grace = self.grace()
            waiting = [s for s in right if s not in spares and now - (s.free_since or now) < grace][:GRACE_SLABS]
            extra = [s for s in free if s not in spares and s not in waiting]
            for slab in extra:
                self.slabs.remove(slab)
                self.closed[0] += 1
                self.closed[1] += slab.size
            if waiting:
                self._come_back(min(s.free_since or now for s in waiting) + grace - now)
        if extra:
            closer = threading.Thread(
                target=_close_all, args=(extra, self.wait_between_calls), name="vllm_compat_slab_close", daemon=True
            )
            closer.start()
            self.closers = [t for t in self.closers if t.is_alive()] + [closer]

    def _come_back(self, seconds: float) -> None:
        """Look at the free slabs again in ``seconds`` (with the lock held), unless a look is due already."""
        if self.timer is not None and self.timer.is_alive() and self.timer is not threading.current_thread():
            return
        self.timer = threading.Timer(
            max(seconds, 0.0) + 0.01, self._retire_extra, kwargs={"keep": None, "released": set()}
        )
        self.timer.name, self.timer.daemon = "vllm_compat_slab_grace", True
        self.timer.start()

    def close(self) -> None:
        self.between_calls.set()  # no call comes any more: nothing waits for one to end
        if self.timer is not None:
            self.timer.cancel()
        if self.maker is not None:
            self.maker.join(timeout=30)
        for closer in self.closers:
            closer.join(timeout=30)
        with self.lock:
            slabs, self.slabs = self.slabs, []
        for slab in slabs:
            slab.close()


def _close_all(slabs: list[Slab], gate: Callable[[], None]) -> None:
    """Close slabs from a thread of their own, while calls may run (their driver work between calls)."""
    for slab in slabs:
        slab.close(gate)


_STATS: dict[str, Any] = {}


def worker_stats() -> dict[str, Any]:
    """The last call's hand-over in this worker: bytes, seconds (exposed, after the call's last step),
    overlapped_seconds (spent during the steps), slab_reused, made_now, waited_seconds, pinned, direct; where direct,
    the worker's slab history so far (``Slabs.history``)."""
    return dict(_STATS)


def record_stats(**values: Any) -> None:
    _STATS.clear()
    _STATS.update(values)


def _forget_in_forked_child() -> None:
    _STATS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_forked_child)
