"""The ``vllm.general_plugins`` entry point: activates vllm-compat inside vLLM worker processes.

vLLM calls ``load_general_plugins()`` in every worker before it resolves
``worker_extension_cls`` (every release from 0.11.0 to 0.33.0). The plugin acts only when the
parent process opted in: the generator's constructor, guarded by vllm-compat, sets ``VLLM_COMPAT_ACTIVE=1``
while it starts the workers, which inherit it. Merely having vllm-compat installed (or imported) changes nothing
for other vLLM users, nor for other vLLM processes the same script starts.
"""

from __future__ import annotations

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
    global loaded, route
    from vllm_compat.engine import ENV_ACTIVE, engine

    loaded = True
    if os.environ.get(ENV_ACTIVE) != "1":
        return
    if engine.starting_workers == os.getpid():
        return  # the generator's own process, while its constructor runs (it set the variable): not a worker
    import vllm_compat

    route = route or PLUGIN_ROUTE
    vllm_compat.install()
    logger.debug("vllm-compat plugin active in pid %d", os.getpid())
