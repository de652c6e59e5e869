"""A CPU-only harness setting of ``bench/extraction_throughput.py --cpu-unpinned-staging`` (native side).

vLLM's ``ExampleHiddenStatesConnector`` stages each request's states in pinned host memory
(``torch.empty_like(..., pin_memory=True)``) and then polls a CUDA event (``Event.query()``) to learn that the copy
is done. vLLM's CPU worker fakes CUDA streams, events and ``Tensor.pin_memory``, but not these two: a CPU build of
torch has no pinned-memory allocator, and vLLM's CPU event stand-in has no ``query``, so the engine dies after the
first call. Importing this module in vLLM's worker (as the ``worker_extension_cls``, whose class adds nothing)
fills both gaps in that process only, where no CUDA device exists: ``pin_memory=True`` is dropped from
``torch.empty_like``, and the event stand-in answers ``query()`` with True (on a CPU the copy has happened when
the call returns). The connector's own code runs unchanged, so the bench's native side (file waits, read-back,
state check) is proven on a CPU. Never on a GPU.
"""

from __future__ import annotations

import functools

import torch


class UnpinnedStagingOnCpu:
    """The worker extension vLLM mixes into its worker: nothing; importing the module is the point."""


def _complete_event_stand_ins() -> None:
    """Give vLLM's CPU event stand-in (not torch's own Event) a ``query`` that says the work is done."""
    for event in {torch.cuda.Event, getattr(torch, "Event", None)}:
        if event is not None and event.__module__.startswith("vllm") and not hasattr(event, "query"):
            event.query = lambda self: True


def _install() -> None:
    if torch.cuda.is_available() or getattr(torch.empty_like, "_bench_unpinned", False):
        return
    original = torch.empty_like

    @functools.wraps(original)
    def empty_like(*args, **kwargs):
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
            _complete_event_stand_ins()  # vLLM's CPU worker has replaced torch's events by now
        return original(*args, **kwargs)

    empty_like._bench_unpinned = True  # type: ignore[attr-defined]
    torch.empty_like = empty_like
    _complete_event_stand_ins()
    print("[bench cpu-unpinned-staging] pinned staging -> ordinary memory; CPU event stand-in gets query()", flush=True)


_install()
