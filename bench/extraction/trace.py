"""``--trace-slabs``: when the worker's slab work and its stalls happened, against each call's own times.

Installed in the capturing worker through an RPC (sent by value: the worker need not import this package), it records
with ``time.perf_counter`` (CLOCK_MONOTONIC, one clock for every process of the host):

- each chunk of pages put in place (``madvise``), each piece registered or unregistered with CUDA, each unmapping;
- each slab made or closed (start and end), each take, and when the pool was told a call started or ended;
- stalls: a thread that asks to sleep 1 ms and records each wake-up more than 3 ms late (the GIL or the scheduler
  kept it waiting), in the worker and in the generator's process. It touches no new memory, so it does not see a
  wait for the process's address-space lock (which unmapping holds).

The extract side stores the worker's events and the generator's stalls in its results, with each call's start, first
step and end on the same clock; ``summary.py`` does not read them (they are for reading by hand, or by a script).
"""

from __future__ import annotations

import threading
import time

from .common import pickle_by_value

_LATE = 0.003  # a 1 ms sleep that woke later than this is a stall


class StallWatch:
    """A thread that sleeps 1 ms at a time and records ``(when, seconds late)`` for each wake-up over ``_LATE``."""

    def __init__(self) -> None:
        self.stalls: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench_stall_watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            began = time.perf_counter()
            time.sleep(0.001)
            woke = time.perf_counter()
            late = woke - began - 0.001
            if late > _LATE:
                self.stalls.append((round(began, 6), round(late, 6)))

    def take(self) -> list[tuple[float, float]]:
        out, self.stalls = self.stalls, []
        return out


def install_slab_trace(worker=None) -> bool:
    """In a worker: record the slabs' work and the worker's stalls (see the module). False where vllm-compat's
    transport is not there."""
    try:
        from vllm_compat import capture
        from vllm_compat.transport import slabs
    except ImportError:
        return False
    if getattr(slabs, "_bench_trace", None) is not None:
        return True
    events: list[tuple] = []
    slabs._bench_trace = events
    slabs._bench_watch = StallWatch()

    def record(kind: str, began: float, **info) -> None:
        events.append((kind, round(began, 6), round(time.perf_counter(), 6), threading.current_thread().name, info))

    class Traced:
        """``real``, with each call of the methods named in ``kinds`` recorded: name -> (kind, index of the argument
        that gives its bytes, or None)."""

        def __init__(self, real, kinds: dict) -> None:
            self.real, self.kinds = real, kinds

        def __getattr__(self, name):
            method = getattr(self.real, name)
            if name not in self.kinds:
                return method
            kind, size_at = self.kinds[name]

            def call(*a):
                began = time.perf_counter()
                try:
                    return method(*a)
                finally:
                    record(kind, began, **({} if size_at is None else {"bytes": a[size_at]}))

            return call

    real_libc = slabs._libc
    slabs._libc = lambda: Traced(real_libc(), {"madvise": ("fill", 1), "munmap": ("munmap", 1)})

    import torch

    real_cudart = torch.cuda.cudart
    cuda_kinds = {"cudaHostRegister": ("register", 1), "cudaHostUnregister": ("unregister", None)}
    torch.cuda.cudart = lambda: Traced(real_cudart(), cuda_kinds)

    def timed(owner, name: str, kind: str, size=None) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return

        def call(*a, **kw):
            began = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                record(kind, began, **({"bytes": size(a, kw)} if size else {}))

        setattr(owner, name, call)

    pool = capture.SLABS
    timed(pool, "take", "take", lambda a, kw: a[0] if a else kw.get("size"))
    timed(pool, "call_started", "call_started")
    timed(pool, "call_ended", "call_ended")
    timed(slabs.Slab, "make", "make", lambda a, kw: a[0] if a else kw.get("size"))
    original_close = slabs.Slab.close

    def close(self, *a, **kw):
        began, size = time.perf_counter(), self.size
        try:
            return original_close(self, *a, **kw)
        finally:
            record("close", began, bytes=size)

    slabs.Slab.close = close
    return True


def read_slab_trace(worker=None) -> dict | None:
    """In a worker: the events and stalls recorded since the last read; cleared."""
    try:
        from vllm_compat.transport import slabs
    except ImportError:
        return None
    events = getattr(slabs, "_bench_trace", None)
    if events is None:
        return None
    out = {"events": list(events), "stalls": slabs._bench_watch.take()}
    events.clear()
    return out


pickle_by_value(__name__)
