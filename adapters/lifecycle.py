"""Adapters for the end of a generator's life: its workers are shut down before the interpreter tears itself down."""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import GENERATOR_MODULE, after_construct, wrap_instance_method

from vllm_compat import transport
from vllm_compat.adapter import Adapter

logger = logging.getLogger("vllm_compat")
SHUT_AT_EXIT = "_vllm_compat_shut_at_exit"  # on a generator whose executor the exit hook shut down

_live: weakref.WeakSet[Any] = weakref.WeakSet()  # generators built in this process and not yet collected
_hooked = threading.Event()


class ShutdownAtExit(Adapter):
    """Shut down the workers of every generator still alive at interpreter exit, before module teardown.

    What broke (a speculators defect, on every vLLM): ``VllmHiddenStatesGenerator.__del__`` shuts the executor down.
    A generator still alive when the interpreter exits (a module-level variable; or one in a reference cycle, which
    only the garbage collector frees) is finalized during module teardown, when the modules' globals are already
    None: 0.3.0's ``log.warning`` in its ``except`` then fails, and the user sees ``Exception ignored in: <function
    VllmHiddenStatesGenerator.__del__ ...> ... AttributeError: 'NoneType' object has no attribute 'warning'`` after a
    run that succeeded; vLLM's own shutdown code, run that late, meets the same half-torn-down modules.
    Where fixed: each generator built is held weakly; an ``atexit`` hook, registered when the first one is built (so
    it runs before the hooks vLLM registered at import), shuts each live generator's executor down while every
    module is intact, and its ``__del__`` then has nothing left to do. A generator collected before exit is shut down
    by its own ``__del__`` as before.
    """

    id = "shutdown-at-exit"
    always = "a speculators defect: a generator alive at interpreter exit is shut down during module teardown"
    target = GENERATOR_MODULE
    remove_when = "speculators shuts its generator down before interpreter exit (or >= 0.5)"

    def apply(self, module: ModuleType) -> None:
        def init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = wrapped(*args, **kwargs)
            _live.add(instance)
            if not _hooked.is_set():
                _hooked.set()
                atexit.register(shut_down_live_generators)
            return result

        def finalize(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            # runs during module teardown too: only the instance's own dict and literals here, no module globals
            if instance.__dict__.get("_vllm_compat_shut_at_exit"):
                return None
            return wrapped(*args, **kwargs)

        self.wrap(module, "VllmHiddenStatesGenerator.__init__", init)
        self.wrap(module, "VllmHiddenStatesGenerator.__del__", finalize)


def shut_down_live_generators() -> None:
    """The exit hook: shut down the executor of every generator still alive (each once)."""
    for generator in list(_live):
        executor = generator.__dict__.get("executor")
        if executor is None or generator.__dict__.get(SHUT_AT_EXIT):
            continue
        try:
            executor.shutdown()
        except Exception:
            logger.warning("vllm-compat: could not shut a generator's executor down at exit", exc_info=True)
        generator.__dict__[SHUT_AT_EXIT] = True


class ReleaseAtShutdown(Adapter):
    """Close what a generator's workers held open in the generator's process once its executor is shut down.

    What broke (vllm-compat's own hand-over, found on vLLM CPU 0.32.0): each worker that hands states over connects
    to the generator's process once, and the receiving socket kept every such connection for good: 20 generators made
    and shut down in turn left 20 connections (one descriptor each) behind.
    Where fixed: ``shutdown`` of speculators' executor object (its own, its monitor's on a worker's death, speculators'
    ``__del__``, the exit hook): once it returns, the connections of that executor's worker processes are closed.
    The receiving socket also closes the connection of any worker that hung up whenever a new worker connects. And
    vLLM's executor is never freed (its own ``weakref.finalize(self, self.shutdown)`` holds it until the interpreter
    exits), so the ``multiprocessing`` handle of each of its worker processes kept its two pipe descriptors open:
    once a worker has exited, its handle is closed (``Process.close()``).
    """

    id = "release-at-shutdown"
    always = "vllm-compat's receiving socket kept each shut-down generator's worker connections"
    target = GENERATOR_MODULE

    def apply(self, module: ModuleType) -> None:
        def shutdown(wrapped: Any, executor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            pids = worker_pids(executor)
            try:
                return wrapped(*args, **kwargs)
            finally:
                transport.forget_workers(pids)
                close_exited_workers(executor)

        self.wrap(
            module,
            "MultiprocExecutor",
            after_construct(lambda ex: wrap_instance_method(ex, "shutdown", shutdown)),
        )


def worker_pids(executor: Any) -> set[int]:
    """The process ids of the executor's workers (none where it has no such list)."""
    pids = set()
    for worker in getattr(executor, "workers", None) or []:
        try:
            pid = getattr(getattr(worker, "proc", None), "pid", None)
        except ValueError:  # a handle closed by an earlier shutdown
            continue
        if isinstance(pid, int):
            pids.add(pid)
    return pids


def close_exited_workers(executor: Any) -> None:
    """Release the ``multiprocessing`` handles of the executor's worker processes that have exited (their pipes)."""
    for worker in getattr(executor, "workers", None) or []:
        proc = getattr(worker, "proc", None)
        close = getattr(proc, "close", None)
        try:
            if close is not None and proc.exitcode is not None:
                close()
        except (ValueError, AttributeError, OSError) as exc:  # still running, or already closed
            logger.debug("vllm-compat: a worker's process handle stays open (%r)", exc)
