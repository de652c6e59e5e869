"""The fallback for workers where vLLM's plugin loader will not run vllm-compat."""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import GENERATOR_MODULE, SPECULATORS_WORKER_EXTENSION, rewrite_kwargs

from vllm_compat.adapter import Adapter
from vllm_compat.plugin import FALLBACK_ROUTE, PLUGIN_ROUTE

logger = logging.getLogger("vllm_compat")
FALLBACK_EXTENSION = "vllm_compat.worker.HiddenStatesWorkerExtension"


def plugin_reaches_workers() -> bool:
    """Whether vLLM's workers will load the ``vllm_compat`` general plugin."""
    return plugin_blocked() is None


def plugin_blocked() -> str | None:
    """Why vLLM's workers will not load the ``vllm_compat`` general plugin; None where they will."""
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and "vllm_compat" not in {p.strip() for p in allowed.split(",")}:
        return f"VLLM_PLUGINS={allowed!r} leaves vllm_compat out"
    import importlib.metadata

    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    # vllm_compat_plugin:register; vllm_compat.plugin:register where installed before 2026-12-05 (it works too)
    if not any(ep.value.startswith(("vllm_compat_plugin:", "vllm_compat.plugin:")) for ep in points):
        return "no vllm.general_plugins entry point of vllm_compat is installed (importable, not installed)"
    return None


def workers_route() -> tuple[str, str]:
    """The route by which vllm-compat reaches the workers a generator starts now, and why."""
    blocked = plugin_blocked()
    if blocked is None:
        return PLUGIN_ROUTE, "the vllm_compat entry point, loaded by vLLM in each worker"
    return FALLBACK_ROUTE, f"{FALLBACK_EXTENSION} as the worker extension: {blocked}"


class WorkerExtensionFallback(Adapter):
    """Name vllm-compat's subclass as the worker extension when the plugin cannot reach the workers.

    What it solves: worker-side adapters must be active in every vLLM worker process, which vLLM spawns. The
    normal route is the ``vllm.general_plugins`` entry point, which vLLM loads in each worker before resolving
    ``worker_extension_cls``. When ``VLLM_PLUGINS`` leaves vllm-compat out, or vllm-compat is on the path but not
    installed as a distribution, no entry point runs; then the generator's ParallelConfig names
    ``vllm_compat.worker.HiddenStatesWorkerExtension``, which installs vllm-compat in the worker and subclasses
    speculators' extension unchanged. The adapter is armed in every generator's process and acts only then;
    ``vllm_compat.status()["worker_route"]`` says which route the workers took (in the generator's process and in
    each worker), and the guard's summary line says it too.
    """

    id = "worker-extension-fallback"
    always = "a safety net, armed always: acts only where the vllm_compat plugin cannot reach vLLM's workers"
    target = GENERATOR_MODULE
    remove_when = "never: it is the safety net of the plugin route"

    def apply(self, module: ModuleType) -> None:
        def fix(cls: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            if kwargs.get("worker_extension_cls") == SPECULATORS_WORKER_EXTENSION:
                route, why = workers_route()
                if route == FALLBACK_ROUTE:
                    logger.debug("vllm-compat: the workers are reached through %s", why)  # the summary says it
                    kwargs["worker_extension_cls"] = FALLBACK_EXTENSION
            return kwargs

        self.wrap(module, "ParallelConfig", rewrite_kwargs(fix))
