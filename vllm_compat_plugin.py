"""vLLM's ``vllm.general_plugins`` entry point for vllm-compat: imports vllm-compat only where the parent opted in.

vLLM loads every general plugin in every process it starts: the workers of speculators' generator, and also each
process of a ``vllm serve`` that has nothing to do with vllm-compat. Importing ``vllm_compat`` installs it (that is
how ``import vllm_compat`` opts a script in), so the entry point lives outside the package, as the pytest plugin
does: loading it imports nothing of vllm-compat unless ``VLLM_COMPAT_ACTIVE=1`` says the process that started this
one opted in (the generator's constructor sets it while it starts its workers). Then ``vllm_compat.plugin`` does
the rest. Merely having vllm-compat installed changes nothing in other vLLM processes.
"""

from __future__ import annotations

import logging
import os

loaded = False  # whether vLLM's plugin loader ran this entry point in this process


def register() -> None:
    """vLLM's plugin loader calls this in each process it starts; idempotent."""
    global loaded
    loaded = True
    if os.environ.get("VLLM_COMPAT_ACTIVE") != "1":  # vllm_compat.engine.ENV_ACTIVE, not imported here on purpose
        return
    try:
        from vllm_compat import plugin
    except Exception:  # as vLLM treats a plugin whose module does not import: logged, and the process goes on
        # (vLLM's model inspection runs `python -m` in the caller's folder, where a checkout's source tree, without
        # vllm_compat.adapters, shadows the installed package; that process needs no adapter)
        logging.getLogger("vllm_compat").exception(
            "vllm-compat: the vLLM plugin could not import vllm_compat in pid %d; this process runs without it",
            os.getpid(),
        )
        return
    plugin.register()
