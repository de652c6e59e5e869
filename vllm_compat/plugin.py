"""The ``vllm.general_plugins`` entry point: activates vllm-compat inside vLLM worker processes.

vLLM calls ``load_general_plugins()`` in every worker before it resolves
``worker_extension_cls`` (every release from 0.11.0 to 0.33.0). The plugin acts only when the
parent process opted in: the generator's constructor, guarded by vllm-compat, sets ``VLLM_COMPAT_ACTIVE=1``
while it starts the workers, which inherit it. Merely having vllm-compat installed (or imported) changes nothing
for other vLLM users, nor for other vLLM processes the same script starts.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os

logger = logging.getLogger("vllm_compat")

PLUGIN_NAME = "vllm_compat"
PLUGIN_ROUTE = "plugin"  # vllm-compat reached this worker through the entry point
FALLBACK_ROUTE = "worker-extension-fallback"  # through vllm_compat.worker.HiddenStatesWorkerExtension
loaded = False  # whether vLLM's plugin loader ran this entry point in this process
route: str | None = None  # how vllm-compat was activated in this vLLM worker process (None: not a worker of ours)


def register() -> None:
    """Install vllm-compat in this process if the parent opted in; re-entrant and idempotent."""
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


def activated_in_worker(how: str) -> None:
    """Record how vllm-compat came into this vLLM worker process, and let the worker exit without a full collection.

    vLLM gives a worker ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (5 s) to exit, then sends SIGTERM. A worker's last
    seconds are CPython's own finalization: collecting the whole heap of torch, transformers and vLLM objects
    (about 700,000), several times over. Measured on 2 loaded cores: 5.2 to 6.3 s for a bare interpreter that only
    imported those, so half the shutdowns ended in SIGTERM. ``gc.freeze()`` at exit, after every Python-level
    clean-up has run (atexit handlers, vLLM's worker shutdown), leaves those objects to the kernel instead: 0.6 to
    0.8 s. Only in vLLM's workers, which run no code of the user's that could want a collection at exit.
    """
    global route
    if route is None:
        route = how
        atexit.register(gc.freeze)
