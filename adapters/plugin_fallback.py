"""The fallback for workers where vLLM's plugin loader will not run vllm-compat."""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import GENERATOR_MODULE, SPECULATORS_WORKER_EXTENSION, rewrite_kwargs

from vllm_compat.adapter import Adapter

logger = logging.getLogger("vllm_compat")
FALLBACK_EXTENSION = "vllm_compat.worker.HiddenStatesWorkerExtension"


def plugin_reaches_workers() -> bool:
    """Whether vLLM's workers will load the ``vllm_compat`` general plugin."""
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and "vllm_compat" not in {p.strip() for p in allowed.split(",")}:
        return False
    import importlib.metadata

    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    return any(ep.value.startswith("vllm_compat.plugin") for ep in points)


class WorkerExtensionFallback(Adapter):
    """Name vllm-compat's subclass as the worker extension when the plugin cannot reach the workers.

    What it solves: worker-side adapters must be active in every vLLM worker process, which vLLM spawns. The
    normal route is the ``vllm.general_plugins`` entry point, which vLLM loads in each worker before resolving
    ``worker_extension_cls``. When ``VLLM_PLUGINS`` leaves vllm-compat out, or vllm-compat is on the path but not
    installed as a distribution, no entry point runs; then the generator's ParallelConfig names
    ``vllm_compat.worker.HiddenStatesWorkerExtension``, which installs vllm-compat in the worker and subclasses
    speculators' extension unchanged.
    """

    id = "worker-extension-fallback"
    always = "a run-time condition: the vllm_compat plugin is filtered out or not installed"
    target = GENERATOR_MODULE
    remove_when = "never: it is the safety net of the plugin route"

    def apply(self, module: ModuleType) -> None:
        def fix(cls: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            if kwargs.get("worker_extension_cls") == SPECULATORS_WORKER_EXTENSION and not plugin_reaches_workers():
                logger.info("vllm-compat: plugin not loadable in workers; using %s", FALLBACK_EXTENSION)
                kwargs["worker_extension_cls"] = FALLBACK_EXTENSION
            return kwargs

        self.wrap(module, "ParallelConfig", rewrite_kwargs(fix))
