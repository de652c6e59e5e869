"""How a worker makes, pins and fills its states slabs (vllm_compat.transport, vllm_compat.capture), on the CPU.

The hand-over between real processes is tested end to end in tests/e2e/test_transport.py and measured on a GPU by
bench/extraction_throughput.py and bench/pin_registration.py. Here: what those cannot isolate. A slab made in a
thread lets the worker's own thread run meanwhile (Python's ``mmap`` holds the GIL while it populates a mapping,
which on an H200 host held a call up 0.26 s); CUDA registration goes in pieces, and a failed piece leaves nothing
registered; a copy across the border of two pieces is split there (the driver refuses it whole) and lands intact.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import threading
import time

import pytest

torch = pytest.importorskip("torch")
from vllm_compat import capture, transport  # noqa: E402
from vllm_compat.transport import slabs  # noqa: E402

MIB = 1 << 20


def test_piece_ranges_split_only_at_borders() -> None:
    assert transport.piece_ranges(0, 100, 0) == [(0, 100)]
    assert transport.piece_ranges(10, 20, 32) == [(10, 20)]
    assert transport.piece_ranges(0, 64, 32) == [(0, 32), (32, 32)]
    assert transport.piece_ranges(30, 40, 32) == [(30, 2), (32, 32), (64, 6)]
    assert transport.piece_ranges(32, 32, 32) == [(32, 32)]
    for offset in range(0, 100, 7):
        for nbytes in range(1, 90, 11):
            ranges = transport.piece_ranges(offset, nbytes, 16)
            assert sum(n for _, n in ranges) == nbytes and ranges[0][0] == offset
            assert all(at // 16 == (at + n - 1) // 16 for at, n in ranges), "no range crosses a border"
            assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(ranges)), "contiguous"


def test_a_slab_is_sealed_shared_memory_with_every_page_in_place() -> None:
    slab = transport.Slab.make(3 * MIB, device=None, pin=False)
    try:
        assert slab.size == 4 * MIB and not slab.pinned
        assert slab.block.numel() == slab.size and int(slab.block.sum()) == 0
        seals = fcntl.fcntl(slab.fd, fcntl.F_GET_SEALS)
        assert seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) == fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        slab.block[-1] = 7  # the worker's own mapping writes
        assert slab.block[-1] == 7
    finally:
        slab.close()
    assert slab.block is None and slab.fd == -1


def test_a_kernel_without_populate_on_request_gets_a_whole_slab(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before Linux 5.14 ``MADV_POPULATE_WRITE`` is EINVAL: the slab is then allocated by fallocate and mapped
    populated, and is as usable."""
    monkeypatch.setattr(slabs, "_MADV_POPULATE_WRITE", 0x7FFF)  # an advice no kernel knows: EINVAL
    slab = transport.Slab.make(5 * MIB, device=None, pin=False)
    try:
        assert slab.size == 6 * MIB and int(slab.block.sum()) == 0
        slab.block.fill_(1)
        assert int(slab.block.sum()) == 6 * MIB
    finally:
        slab.close()


def test_a_slab_is_not_populated_through_pythons_mmap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python's ``mmap`` keeps the GIL while it populates a mapping, which stopped the worker's steps while a spare
    slab was made in a thread (0.26 s on an H200 host): slabs are mapped and filled through the C library, whose
    calls through ctypes release the GIL."""

    def refuse(*args, **kwargs):
        raise AssertionError("mmap.mmap used to make a slab")

    monkeypatch.setattr(slabs.mmap, "mmap", refuse)
    slab = transport.Slab.make(4 * MIB, device=None, pin=False, gate=lambda: None)  # made in the background
    try:
        slab.block.fill_(3)
        assert int(slab.block[::4096].sum()) == 3 * (4 * MIB // 4096)
    finally:
        slab.close()
    libc = slabs._libc()
    for call in (libc.mmap, libc.madvise, libc.munmap):  # not PyDLL's (which keeps the GIL)
        assert not call._flags_ & slabs.ctypes._FUNCFLAG_PYTHONAPI, "a ctypes.CDLL call: the GIL is released"


class FakeCudart:
    """Records what transport asks of CUDA; fails the ``fail_at``-th registration where asked."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.registered: dict[int, int] = {}
        self.calls = 0

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        self.registered[address] = nbytes
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        del self.registered[address]
        return 0


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch):
    def install(cudart: FakeCudart) -> FakeCudart:
        monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
        return cudart

    return install


def test_a_slab_is_registered_in_pieces_and_unregistered_whole(fake_cuda, monkeypatch) -> None:
    monkeypatch.setattr(slabs, "PIN_PIECE", 2 * MIB)
    cudart = fake_cuda(FakeCudart())
    slab = transport.Slab.make(7 * MIB, device=0, pin=True)
    base = slab.block.data_ptr()
    assert slab.pinned and slab.piece == 2 * MIB
    assert cudart.registered == {base + k * 2 * MIB: 2 * MIB for k in range(4)}, "8 MiB in four pieces"
    slab.close()
    assert cudart.registered == {}


def test_a_slab_closed_in_the_background_unregisters_with_pauses(fake_cuda, monkeypatch) -> None:
    """Each piece's unregistration holds the driver's lock the worker's steps launch under: between pieces, the
    closing thread sleeps, as registering does; a slab closed at shutdown does not wait."""
    monkeypatch.setattr(slabs, "PIN_PIECE", 2 * MIB)
    cudart = fake_cuda(FakeCudart())
    sleeps: list[float] = []
    monkeypatch.setattr(slabs.time, "sleep", sleeps.append)
    for background, pauses in ((True, 3), (False, 0)):
        slab = transport.Slab.make(8 * MIB, device=0, pin=True)
        sleeps.clear()
        slab.close(gate=(lambda: None) if background else None)
        assert cudart.registered == {}
        assert sleeps == [slabs._PIN_PAUSE] * pauses, "a pause between each two of the four pieces, in the background"


def test_a_failed_piece_leaves_nothing_registered(fake_cuda, monkeypatch) -> None:
    monkeypatch.setattr(slabs, "PIN_PIECE", 2 * MIB)
    cudart = fake_cuda(FakeCudart(fail_at=3))
    slab = transport.Slab.make(8 * MIB, device=0, pin=True)
    try:
        assert not slab.pinned and cudart.registered == {}, "pageable, and the two pieces made went back"
    finally:
        slab.close()


def test_copies_across_piece_borders_land_intact() -> None:
    """Rows that straddle a border are copied piece by piece (contiguous or not) and read back as they were."""
    g = torch.Generator().manual_seed(0)
    block = torch.zeros(4096, dtype=torch.uint8)
    copier = capture._Copier(block, torch.device("cpu"), piece=96)
    rows = torch.randn(10, 12, generator=g).to(torch.bfloat16)  # 24-byte rows: borders fall inside rows
    strided = torch.randn(12, 20, generator=g).to(torch.bfloat16)[:, ::2]  # not contiguous
    keep: list = []
    copier.copy([(40, rows[1:9]), (1000, strided)], keep)
    copier.finish()
    got = block.narrow(0, 40, 8 * 24).view(torch.bfloat16).view(8, 12)
    assert torch.equal(got, rows[1:9])
    got = block.narrow(0, 1000, strided.numel() * 2).view(torch.bfloat16).view(strided.shape)
    assert torch.equal(got, strided)
    assert int(block[:40].sum()) == 0 and int(block[40 + 8 * 24 : 1000].sum()) == 0, "nothing written elsewhere"


class _Caller:
    """The generator's process as the worker sees it: a handed-over slab stays locked (by a description of its own,
    as the caller's mapping holds it) until the caller lets go of the call's states and says so."""

    def __init__(self, pool: slabs.Slabs) -> None:
        self.pool = pool
        self.locks: dict[int, int] = {}

    def call(self, size: int) -> transport.Slab:
        slab, _ = self.pool.take(size)
        slab.handed, slab.busy = True, False  # what the hand-over does
        self.pool.call_ended()
        fd = os.open(f"/proc/self/fd/{slab.fd}", os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        self.locks[id(slab)] = fd
        self.settle()
        return slab

    def drop(self, slab: transport.Slab) -> None:
        os.close(self.locks.pop(id(slab)))
        self.pool.reclaim([slab.serial])
        self.settle()

    def settle(self) -> None:
        if self.pool.maker is not None:
            self.pool.maker.join()
        for closer in self.pool.closers:
            closer.join()

    def close(self) -> None:
        for fd in self.locks.values():
            os.close(fd)
        self.pool.close()


@pytest.mark.parametrize("spares", [1, 2])
@pytest.mark.parametrize("estimate", [1, 4])
@pytest.mark.parametrize("kept", [(1,), (0,), (2,), (1, 2), (0, 2), (1, 3)])
def test_a_loop_keeping_results_settles_without_making_or_closing_slabs(monkeypatch, spares, estimate, kept):
    """The benchmark's caller (2026-12-05), replayed: keeping a warm-up's results and each call's while the next
    ran, it got one slab made (populated, pinned) and one closed (unpinned) beside every call's steps: the slab the
    caller gave back was closed as one too many, and its replacement made at the next take. Here callers keep the
    results of the last ``kept`` calls (in turn, where it varies: speculators' saving threads), with the slabs made
    for an estimate ``estimate`` times a call. Once those are replaced, the loop reuses what it has; after it, the
    free slabs go down to the spares within the grace period, without another call."""
    monkeypatch.setattr(slabs.Slabs, "spares", lambda self: spares)  # whether making a slab is slower than a call
    monkeypatch.setattr(slabs, "GRACE_SECONDS", (0.15, 0.15))  # each call here takes milliseconds
    pool = slabs.Slabs()
    size = 4 * MIB
    caller = _Caller(pool)
    try:
        pool.prepare(estimate * size, None)
        caller.settle()
        caller.call(size)  # the warm-up, kept all along
        alive: list[transport.Slab] = []
        history = []
        for n in range(12):
            alive.append(caller.call(size))
            while len(alive) > kept[n % len(kept)]:
                caller.drop(alive.pop(0))
            history.append(pool.history())
        assert history[-1] == history[4], f"slabs made or closed after the fifth call: {history}"
        for slab in alive:
            caller.drop(slab)
        free = [s.size for s in pool.slabs if s.is_free()]
        assert len(free) <= spares + slabs.GRACE_SLABS and all(s <= slabs.OVERSIZE * size for s in free), free
        time.sleep(0.2)
        if pool.timer is not None:
            pool.timer.join()
        caller.settle()
        free = [s.size for s in pool.slabs if s.is_free()]
        assert len(free) <= spares, f"free slabs once the grace period is over: {free}"
    finally:
        caller.close()


@pytest.fixture
def h200_caller(monkeypatch: pytest.MonkeyPatch):
    """A pool as on the H200, where making a slab is slower than a call (two spares), with its grace period scaled to
    these tests' calls of milliseconds, and a caller of it: (pool, caller)."""
    monkeypatch.setattr(slabs.Slabs, "spares", lambda self: 2)  # making a slab takes longer than a call there
    monkeypatch.setattr(slabs, "GRACE_SECONDS", (0.25, 30.0))  # 3x the longest interval: 1 s there, 0.25 s here
    pool = slabs.Slabs()
    caller = _Caller(pool)
    yield pool, caller
    caller.close()


@pytest.mark.parametrize("estimate", [1.5, 2])
def test_a_loop_reuses_slabs_of_the_right_size_in_turn(h200_caller, estimate):
    """The benchmark's caller on an H200 (vLLM 0.34.0, 2026-12-05), replayed with time passing: the warm-up's slabs
    were made for an estimate of twice the real call (still the right size), the spares made since are smaller, and the
    caller keeps the previous call's results and, from the fourth call on, one call's for good. Taking the smallest
    free slab first left a larger one free call after call until the grace period closed it, and the next take made
    its replacement: slabs made and closed beside the steps (5 and 2 in 24 calls there). Taken in turn, none idles."""
    pool, caller = h200_caller
    size = 4 * MIB
    pool.prepare(int(estimate * size), None)
    caller.settle()
    caller.drop(caller.call(size))  # the warm-up's results, dropped
    previous, kept, history = None, None, []
    for n in range(20):
        slab = caller.call(size)
        time.sleep(0.06)  # the call's steps
        if previous is not None and previous is not kept:
            caller.drop(previous)  # the caller's results of the call before go when this one returns
        kept = slab if n == 3 else kept
        previous = slab
        history.append(pool.history())
    made = [h["slabs_made"] for h in history]
    closed = [h["slabs_closed"] for h in history]
    assert made[-1] == made[7] and closed[-1] == closed[7], f"made {made}, closed {closed}"


_SMALLER_THAN_THE_ESTIMATE = pytest.mark.xfail(
    strict=True,
    reason="open (issue 33): slabs made for an estimate more than twice the real calls are replaced while the loop "
    "runs. The work waits for the gaps between calls (an H100, vLLM 0.34.0, large preset, 2026-12-06: 0 of 16 and 0 "
    "of 48 calls below 0.97x prefill's in two runs, 6 of 64 in a third, worst 0.80x after the longest gap), and "
    "takes dozens of calls",
)


@pytest.mark.parametrize("estimate", [1, 2, pytest.param(4, marks=_SMALLER_THAN_THE_ESTIMATE)])
def test_a_loop_keeping_the_previous_results_makes_no_slab_beside_its_calls(h200_caller, estimate):
    """speculators' loop (``results = generate(batch)``, then saved) keeps one call's results while the next runs:
    the call's slab, the previous results' and the spares. On an H200 (vLLM 0.34.0 and 0.26.0, 2026-12-06) the start
    made the call's slab and the spares only, the loop made the rest beside its first calls, and those calls ran
    25-35 ms (up to 22 %) slower. Made before the first call, from the warm-up on no slab is made or closed.

    The start sizes its slabs for the largest call the scheduler allows (``max_num_seqs`` at the context length): 4
    times the calls on the benchmark's large preset, more for speculators' data generation. Such slabs are not the
    right size, and today the first takes close them and make spares of the right size while the calls run."""
    pool, caller = h200_caller
    size = 4 * MIB
    pool.prepare(estimate * size, None)
    caller.settle()
    started = pool.history()
    caller.drop(caller.call(size))  # the warm-up's results, dropped
    previous = None
    for _ in range(12):
        slab = caller.call(size)
        time.sleep(0.06)  # the call's steps
        if previous is not None:
            caller.drop(previous)  # the results of the call before go when this one returns
        previous = slab
        assert pool.history() == started, f"made or closed in the loop: {started} then {pool.history()}"


def test_background_driver_work_waits_until_no_call_is_in_flight(fake_cuda, monkeypatch) -> None:
    """Registering or unregistering a piece holds the CUDA driver's lock the worker's steps launch their work under:
    on an H200 a call beside which a slab was registered lost 25 to 35 ms, on an H100 one beside 4 GiB unregistered
    13 %. A slab made or closed in the background does that driver work only between calls (from a hand-over to the
    next take); a slab a call needs at once is made at once."""
    monkeypatch.setattr(slabs, "PIN_PIECE", 2 * MIB)
    cudart = fake_cuda(FakeCudart())
    monkeypatch.setattr(slabs.Slabs, "_spares_in_background", lambda self, want: None)  # made by hand here
    pool = slabs.Slabs()
    pool.device = 0
    try:
        slab, _ = pool.take(4 * MIB)  # a call in flight, its slab made at once and registered
        assert slab.pinned and len(cudart.registered) == 2
        pool._make_in_background(4 * MIB, 1)
        time.sleep(0.3)
        assert len(cudart.registered) == 2 and pool.maker.is_alive(), "a spare registered while the call ran"
        pool.call_ended()  # the call handed its states over
        pool.maker.join(timeout=5)
        assert len(cudart.registered) == 4 and len(pool.slabs) == 2
        spare = next(s for s in pool.slabs if s is not slab)
        pool.take(4 * MIB)  # the next call takes it: the first slab is free, and closing it waits for a gap
        closer = threading.Thread(target=slabs._close_all, args=([slab], pool.wait_between_calls))
        with pool.lock:
            pool.slabs.remove(slab)
        closer.start()
        time.sleep(0.3)
        assert len(cudart.registered) == 4 and closer.is_alive(), "a slab unregistered while the call ran"
        pool.call_ended()
        closer.join(timeout=5)
        assert len(cudart.registered) == 2 and spare.pinned
    finally:
        pool.close()
    assert cudart.registered == {}


class RecordingLibc:
    """The C library, with each range put in place recorded (``madvise``), as the worker's slabs ask it."""

    def __init__(self, real: object) -> None:
        self.real = real
        self.filled: list[int] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)

    def madvise(self, address: int, nbytes: int, advice: int) -> int:
        self.filled.append(nbytes)
        return self.real.madvise(address, nbytes, advice)


def test_a_slab_made_in_the_background_fills_its_pages_only_between_calls(monkeypatch) -> None:
    """Zero-filling a slab's pages takes the host's memory bandwidth and the worker's address-space lock: made in the
    background (no CUDA here, so nothing to register), its pages are put in place a chunk at a time, and only while
    no call is in flight. A slab a call needs at once is filled whole, at once."""
    libc = RecordingLibc(slabs._libc())
    monkeypatch.setattr(slabs, "_libc", lambda: libc)
    monkeypatch.setattr(slabs, "_FILL_CHUNK", 2 * MIB)
    monkeypatch.setattr(slabs.Slabs, "_spares_in_background", lambda self, want: None)  # made by hand here
    pool = slabs.Slabs()
    try:
        pool.take(8 * MIB)  # a call in flight; its own slab filled at once
        assert sum(libc.filled) == 8 * MIB
        libc.filled.clear()
        pool._make_in_background(8 * MIB, 1)
        time.sleep(0.3)
        assert libc.filled == [] and pool.maker.is_alive(), "pages filled while the call ran"
        pool.call_ended()
        pool.maker.join(timeout=5)
        assert sum(libc.filled) == 8 * MIB and max(libc.filled) == 2 * MIB, "in chunks, once the call handed over"
        assert len(pool.slabs) == 2
    finally:
        pool.close()


def test_a_call_is_in_flight_from_the_arrival_of_its_plan() -> None:
    """The plan reaches the worker before the call's first step launches its work: background slab work (filling
    pages, registering pieces) waits from then, not from the first step's capture, which came after that step's
    launches (on an H100, the large preset's calls beside such work still lost 3-6 %). A call given up opens it."""
    call = capture.CallCapture([("r0", 4)], "0.4.0.1")
    try:
        assert not capture.SLABS.between_calls.is_set(), "a call is in flight once its plan arrived"
    finally:
        call.release()
    assert capture.SLABS.between_calls.is_set(), "a call given up before its first step leaves none in flight"


def _hold_slabs_after_the_first(monkeypatch) -> tuple[threading.Event, list[int]]:
    """Every slab made after the first waits until the returned event is set; the list records each size asked."""
    hold = threading.Event()
    real_make = slabs.Slab.make
    made: list[int] = []

    def make(size, device, pin, gate=None, pause=False):
        if made:
            hold.wait(10)
        made.append(size)
        return real_make(size, device, pin, gate, pause)

    monkeypatch.setattr(slabs.Slab, "make", staticmethod(make))
    return hold, made


def test_a_call_waiting_for_the_maker_takes_the_first_slab_that_fits(monkeypatch) -> None:
    """At start the maker makes the call's slab, the previous results' and the spares, one after the other. A call
    that found none free waited for the maker's whole run: on an H100 (the large preset, 4 GiB slabs made for the
    scheduler's estimate) a call waited 3.8 s for three slabs where it needed one, and ran at 0.21x prefill's speed.
    It takes the first that fits, while the maker goes on."""
    hold, made = _hold_slabs_after_the_first(monkeypatch)
    pool = slabs.Slabs()
    try:
        pool.prepare(4 * MIB, None)
        pool.call_started()  # the call's plan arrived: a gate closed, as in a worker
        taken: list = []
        taker = threading.Thread(target=lambda: taken.append(pool.take(4 * MIB)))
        taker.start()
        taker.join(timeout=5)
        assert taken, "the call waited for more than the slab it needed"
        slab, stats = taken[0]
        assert made == [4 * MIB] and pool.maker.is_alive() and not stats["made_now"]
        assert slab.size == 4 * MIB and slab.busy
    finally:
        hold.set()
        pool.close()


def test_the_slabs_the_first_two_calls_need_are_made_while_a_call_is_in_flight(monkeypatch) -> None:
    """Where vLLM's warm-up sends its plan before the start has made its slabs, the maker filled pages only between
    calls, and a call that found none free waited for it: on an H100 (the large preset) 3.8 s, then about 1.25 s for
    the one 4 GiB slab it needed. The call's slab and the previous results' are made at once; the spares wait."""
    monkeypatch.setattr(slabs.Slabs, "spares", lambda self: 2)
    monkeypatch.setattr(slabs, "GATE_SECONDS", 30.0)
    monkeypatch.setattr(slabs, "_FILL_CHUNK", 2 * MIB)
    pool = slabs.Slabs()
    try:
        pool.call_started()  # the warm-up's plan arrived first
        pool.prepare(8 * MIB, None)
        with pool.added:
            made = pool.added.wait_for(lambda: pool.adds >= slabs.AHEAD, timeout=5)
        assert made, f"{pool.adds} slab(s) made while a call was in flight; a loop's first two calls need two"
        time.sleep(0.2)
        assert pool.adds == slabs.AHEAD and pool.maker.is_alive(), "a spare made while the call was in flight"
        pool.call_ended()
        pool.maker.join(timeout=5)
        assert pool.adds == slabs.AHEAD + 2 and all(s.size == 8 * MIB for s in pool.slabs)
    finally:
        pool.close()  # opens the gate first


def test_the_start_stops_making_spares_once_a_call_shows_its_estimate_too_large(monkeypatch) -> None:
    """The start's slabs are sized for the scheduler's largest call; the 8B-class preset's calls are a quarter of
    that. A spare of that size only stands in until spares of the right size replace it, and while the maker makes
    it (a chunk each gap, 4 GiB on an H100) none of the right size can be begun. Once a call shows the estimate more
    than ``OVERSIZE`` times too large, the start makes no more spares."""
    monkeypatch.setattr(slabs.Slabs, "spares", lambda self: 2)
    hold, made = _hold_slabs_after_the_first(monkeypatch)
    pool = slabs.Slabs()
    try:
        pool.prepare(16 * MIB, None)
        slab, stats = pool.take(4 * MIB)  # the first call: a quarter of the estimate
        assert slab.size == 16 * MIB and not stats["made_now"]
        hold.set()
        pool.call_ended()
        pool.maker.join(timeout=5)
        assert made.count(16 * MIB) == slabs.AHEAD, f"start-up slabs made: {made}"
    finally:
        hold.set()
        pool.close()
