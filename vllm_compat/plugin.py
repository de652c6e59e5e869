"""What vLLM's ``vllm.general_plugins`` entry point does in a worker of a generator guarded by vllm-compat.

vLLM calls ``load_general_plugins()`` in every process it starts, in the workers before it resolves
``worker_extension_cls`` (every release from 0.11.0 to 0.34.0). The entry point itself is the top-level module
``vllm_compat_plugin``, which imports this package only where the parent process opted in: the generator's
constructor, guarded by vllm-compat, sets ``VLLM_COMPAT_ACTIVE=1`` while it starts the workers, which inherit it.
Importing ``vllm_compat`` installs it, so an entry point inside the package installed vllm-compat in every vLLM
process, ``vllm serve``'s included; now merely having vllm-compat installed changes nothing for other vLLM users,
nor for other vLLM processes the same script starts.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
from typing import Any

logger = logging.getLogger("vllm_compat")

PLUGIN_NAME = "vllm_compat"
PLUGIN_ROUTE = "plugin"  # vllm-compat reached this worker through the entry point
FALLBACK_ROUTE = "worker-extension-fallback"  # through vllm_compat.worker.HiddenStatesWorkerExtension
loaded = False  # whether register() ran in this process (through the entry point, where the parent opted in)
route: str | None = None  # how vllm-compat was activated in this vLLM worker process (None: not a worker of ours)


def register() -> None:
    """Install vllm-compat in this process if the parent opted in; re-entrant and idempotent (``vllm_compat_plugin``
    calls it only then; the check stays for a direct call)."""
    global loaded
    from vllm_compat.engine import ENV_ACTIVE, engine

    loaded = True
    if os.environ.get(ENV_ACTIVE) != "1":
        return
    if engine.starting_workers == os.getpid():
        return  # the generator's own process, while its constructor runs (it set the variable): not a worker
    import vllm_compat

    activated_in_worker(PLUGIN_ROUTE)
    vllm_compat.install()
    logger.debug("vllm-compat plugin active in pid %d", os.getpid())


def entry_point_loaded() -> bool:
    """Whether vLLM's plugin loader ran vllm-compat's entry point in this process, whether or not it opted in."""
    return loaded or bool(getattr(sys.modules.get("vllm_compat_plugin"), "loaded", False))


def activated_in_worker(how: str) -> None:
    """Record how vllm-compat came into this vLLM worker process, and let the worker exit without tearing its heap down.

    vLLM gives a worker ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (5 s) to exit, then sends SIGTERM. A worker's last
    seconds are CPython's own finalization: collecting the whole heap of torch, transformers and vLLM objects
    (about 700,000), several times over. Measured on 2 loaded cores: 5.2 to 6.3 s for a bare interpreter that only
    imported those, so half the shutdowns ended in SIGTERM. ``gc.freeze()`` at exit, after the Python-level clean-up
    registered since (vLLM's worker shutdown), leaves those objects to the kernel instead: 0.6 to 0.8 s. Only in
    vLLM's workers, which run no code of the user's that could want a collection at exit.

    Objects never finalised made Triton's nanobind extension (Triton 3.9) print ``nanobind: leaked N instances``,
    about 27 lines per worker, from its C-level exit hook, after the interpreter is torn down. So a worker that is a
    multiprocessing child whose ``run()`` ended (``_bootstrap`` computed its exit code and ran multiprocessing's own
    clean-up) ends as vLLM's fork-started workers always end, with ``os._exit`` and that exit code, once every
    ``atexit`` handler has run: see ``_at_exit``.
    """
    global route
    if route is None:
        route = how
        _watch_run_end()
        atexit.register(_at_exit)


_exit_code: int | None = None  # this multiprocessing child's exit code, as _bootstrap computes it once run() ended
_INTERPRETER_CLEAR = "cpython.PyInterpreterState_Clear"  # audit event: Py_FinalizeEx, after the module teardown


def _watch_run_end() -> None:
    """In a multiprocessing child, learn the exit code its ``run()`` leaves: ``Process._bootstrap`` calls
    ``multiprocessing.util._exit_function()`` in the ``finally`` after ``run()``, where ``sys.exc_info()`` holds what
    ``run()`` raised (nothing: exit code 0). Elsewhere nothing is wrapped and the exit stays Python's own."""
    import multiprocessing
    import multiprocessing.util

    import wrapt

    if multiprocessing.parent_process() is None:
        return  # not started by multiprocessing (the generator's own process, a uniprocess executor)
    if isinstance(multiprocessing.util._exit_function, wrapt.FunctionWrapper):
        return

    def exit_function(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        global _exit_code
        _exit_code = _code_of(sys.exc_info()[1])
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(multiprocessing.util, "_exit_function", exit_function)


def _code_of(exc: BaseException | None) -> int:
    """The exit code ``multiprocessing.process.BaseProcess._bootstrap`` gives a ``run()`` that raised ``exc``."""
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        if exc.code is None:
            return 0
        return exc.code if isinstance(exc.code, int) else 1
    return 1


def _at_exit() -> None:
    gc.freeze()  # the collections left at exit skip the heap (see activated_in_worker)
    if _exit_code is None:
        return  # not a multiprocessing child whose run() ended: Python's own exit
    end = _ender(_exit_code)
    # The first collection after the atexit handlers is the one Py_FinalizeEx starts before tearing the modules down
    # (where gc is enabled); the audit event comes after the teardown, before the C-level exit hooks. Both are added
    # only now: nothing runs while the worker works.
    # Both bind what they use: after the teardown, module globals are None.
    gc.callbacks.append(lambda phase, info, fin=sys.is_finalizing: end() if phase == "start" and fin() else None)
    sys.addaudithook(lambda event, args, name=_INTERPRETER_CLEAR: end() if event == name else None)


def _ender(code: int) -> Any:
    """End the process with ``code`` once every Python-level exit handler has run, as a fork-started worker ends
    (multiprocessing calls ``os._exit`` after ``_bootstrap``): what is skipped is the teardown of a heap left to the
    kernel anyway, and C-level exit hooks such as nanobind's leak report. Everything it needs is bound now: module
    globals may be gone when it runs."""
    streams = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    exit_now = os._exit

    def end() -> None:
        for stream in streams:
            try:
                if stream is not None:
                    stream.flush()
            except Exception:  # a closed or broken stream: nothing more can be written to it anyway
                pass
        exit_now(code)

    return end
