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
loaded = False  # whether vLLM's plugin loader ran this entry point in this process


def register() -> None:
    """Install vllm-compat in this process if the parent opted in; re-entrant and idempotent."""
    global loaded
    from vllm_compat.engine import ENV_ACTIVE

    loaded = True
    if os.environ.get(ENV_ACTIVE) != "1":
        return
    import vllm_compat

    vllm_compat.install()
    logger.debug("vllm-compat plugin active in pid %d", os.getpid())
