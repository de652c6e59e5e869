"""Adapters for KV-cache planning, which speculators does by hand before building the Scheduler."""

from __future__ import annotations

import contextvars
import importlib
import inspect
import logging
import os
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import GENERATOR_MODULE, after_construct, on_cpu, rewrite_kwargs

from vllm_compat.adapter import Adapter

logger = logging.getLogger("vllm_compat")

_PLANNING_HELPERS = (
    "_get_kv_cache_groups_uniform_spec",
    "get_kv_cache_config_from_groups",
    "unify_hybrid_kv_cache_specs",
)


class KvPlanningHelpersMoved(Adapter):
    """Re-export the KV-cache planning helpers from ``kv_cache_utils``.

    What broke: vLLM 0.33.0 moved ``_get_kv_cache_groups_uniform_spec``, ``get_kv_cache_config_from_groups``
    and ``unify_hybrid_kv_cache_specs`` to ``vllm.v1.core.kv_cache_planning`` without a re-export, so
    speculators' module-level ``from vllm.v1.core.kv_cache_utils import ...`` raises ImportError.
    Where fixed: vLLM's surface, on import of ``kv_cache_utils`` and before speculators imports from it (a hook
    on speculators' module would run after the failing import). Only missing names are added.
    """

    id = "kv-planning-helpers-moved"
    covers = {f"import.v1.core.kv_cache_utils.{name}": {"moved"} for name in _PLANNING_HELPERS}
    target = "vllm.v1.core.kv_cache_utils"
    first_vllm = "0.33.0"

    def apply(self, module: ModuleType) -> None:
        planning = importlib.import_module("vllm.v1.core.kv_cache_planning")
        for name in _PLANNING_HELPERS:
            if not hasattr(module, name):
                self.set_attr(module, name, getattr(planning, name))


class ExtensibleKvCacheOff(Adapter):
    """Commit the whole KV cache when the workers initialise it, as every release before vLLM 0.34.0 did.

    What broke: vLLM 0.34.0 turns the extensible KV cache on by default on CUDA and ROCm
    (``VllmConfig._resolve_extensible_kv_cache``): the workers reserve the cache's address range, commit only the
    pages the warm-up touches, and EngineCore commits the rest with ``finalize_extensible_kv_cache()`` and
    ``executor.extend_kv_cache()``. speculators' generator skips EngineCore and plans the cache itself, so its
    Scheduler hands out blocks that were never committed: on an H200 the first call larger than the warm-up died
    with an illegal memory access.
    Where fixed: speculators' CacheConfig call (``enable_extensible_kv_cache=False``), so the cache is allocated whole
    in ``initialize_from_config`` from the budget speculators computed, before the warm-up. The extensible cache
    sizes the cache after CUDA-graph capture; speculators runs eagerly, so it gains nothing from it.
    Removable when: speculators drives vLLM's engine, or its generator extends the cache itself.
    """

    id = "extensible-kv-cache-off"
    covers = {"kv_cache.commitment": {"on_by_default"}}
    target = GENERATOR_MODULE
    first_vllm = "0.34.0"

    def apply(self, module: ModuleType) -> None:
        def fix(cls: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            if kwargs.setdefault("enable_extensible_kv_cache", False) is not False:
                logger.info("vllm-compat: speculators asked for the extensible KV cache; left as asked")
            return kwargs

        self.wrap(module, "CacheConfig", rewrite_kwargs(fix))


class KvCacheSpecsKwarg(Adapter):
    """``get_kv_cache_config_from_groups`` lost its ``kv_cache_specs`` parameter.

    What broke: vLLM 0.12.0 removed ``kv_cache_specs`` (the groups carry their specs); speculators 0.3.0 still
    passes it (TypeError), and 0.4.0.1 omits it, which 0.11.x requires.
    Where fixed: speculators' call; when the parameter is required it is rebuilt from the groups.
    """

    id = "kv-cache-specs-kwarg"
    covers = {"kv_cache.config_from_groups_kwargs": {"rejects=kv_cache_specs", "requires=kv_cache_specs"}}
    target = GENERATOR_MODULE
    first_vllm = "0.12.0"

    def apply(self, module: ModuleType) -> None:
        def fix(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            wants = "kv_cache_specs" in inspect.signature(fn).parameters
            if not wants:
                kwargs.pop("kv_cache_specs", None)
            elif "kv_cache_specs" not in kwargs:
                kwargs["kv_cache_specs"] = {
                    layer: group.kv_cache_spec for group in kwargs["kv_cache_groups"] for layer in group.layer_names
                }
            return kwargs

        self.wrap(module, "get_kv_cache_config_from_groups", rewrite_kwargs(fix))


class KvCacheLayout(Adapter):
    """Resolve the KV-cache layout before planning, as EngineCore does.

    What broke: from vLLM 0.29.0 ``get_kv_cache_config_from_groups`` reads
    ``cache_config.get_resolved_kv_cache_layout()``, which raises ValueError until the layout is resolved from
    what the workers' attention backends support and pushed to them with ``set_kv_cache_layout``. speculators
    never does this. 0.33.0 added a second argument (the context-parallel interleave size).
    Where fixed: right after speculators' MultiprocExecutor is built (the first moment the workers exist).
    """

    id = "kv-cache-layout"
    covers = {"kv_cache.layout_precondition": {"layout_required"}}
    target = GENERATOR_MODULE
    first_vllm = "0.29.0"

    def apply(self, module: ModuleType) -> None:
        self.wrap(module, "MultiprocExecutor", after_construct(resolve_kv_cache_layout))
        self.wrap(module, "get_kv_cache_config_from_groups", _record_layout)


def resolve_kv_cache_layout(executor: Any) -> None:
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout as resolve

    config = executor.vllm_config
    specs = executor.collective_rpc("get_kv_cache_spec")
    layout = resolve(config, executor.get_supported_kv_cache_layouts(), [s for per in specs for s in per.values()])
    if len(inspect.signature(executor.set_kv_cache_layout).parameters) >= 2:
        executor.set_kv_cache_layout(layout.name, config.parallel_config.cp_kv_cache_interleave_size)
    else:
        executor.set_kv_cache_layout(layout.name)
    logger.info("vllm-compat: KV-cache layout resolved to %s", layout.name)


def _record_layout(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    config = kwargs.get("vllm_config", args[0] if args else None)
    layout = getattr(getattr(config, "cache_config", None), "kv_cache_layout", None)
    if layout is not None and hasattr(result, "kv_cache_layout") and result.kv_cache_layout is None:
        result.kv_cache_layout = layout
    return result


_IN_GENERATOR_INIT: contextvars.ContextVar[bool] = contextvars.ContextVar("vllm_compat_in_init", default=False)


class CpuKvCacheMemory(Adapter):
    """Size the KV cache from vLLM's CPU platform when vLLM runs on the CPU.

    What broke: speculators sizes the cache from the accelerator's free memory: 0.3.0 calls
    ``torch.cuda.mem_get_info()`` (raises without a CUDA driver; (0, 0) with a CPU build of torch) and 0.4.0.1
    its own ``mem_get_info()`` ((0, 0) on CPU). A zero budget fails in the Scheduler. vLLM's CPU workers take
    their KV space from ``VLLM_CPU_KVCACHE_SPACE`` (GiB; vLLM's own CPU default is 4).
    Where fixed: only on the CPU platform, only inside the generator's constructor: the accelerator query
    answers without touching CUDA, and the planning call gets the CPU budget.
    """

    id = "cpu-kv-cache-memory"
    always = "a run-time condition: vLLM runs on its CPU platform (checked on every call)"
    target = GENERATOR_MODULE
    first_vllm = "every release with a CPU build (0.11.0 on)"
    remove_when = "speculators sizes the KV cache through vLLM's platform API"

    def apply(self, module: ModuleType) -> None:
        def constructor(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            token = _IN_GENERATOR_INIT.set(True)
            try:
                return wrapped(*args, **kwargs)
            finally:
                _IN_GENERATOR_INIT.reset(token)

        def no_accelerator_query(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if _IN_GENERATOR_INIT.get() and on_cpu():
                return (cpu_kv_cache_bytes(), cpu_kv_cache_bytes())
            return wrapped(*args, **kwargs)

        def budget(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            if on_cpu() and "available_memory" in kwargs:
                kwargs["available_memory"] = cpu_kv_cache_bytes()
            return kwargs

        self.wrap(module, "VllmHiddenStatesGenerator.__init__", constructor)
        self.wrap(module, "get_kv_cache_config_from_groups", rewrite_kwargs(budget))
        if hasattr(module, "mem_get_info"):  # speculators 0.4
            self.wrap(module, "mem_get_info", no_accelerator_query)
        else:  # speculators 0.3 calls torch.cuda.mem_get_info() through the torch module
            self.wrap(module.torch.cuda, "mem_get_info", no_accelerator_query)


def cpu_kv_cache_bytes() -> int:
    """The KV-cache budget on vLLM's CPU platform: ``VLLM_CPU_KVCACHE_SPACE`` GiB, 4 GiB if unset."""
    raw = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    gib = float(raw) if raw else 4.0
    return int(gib * (1 << 30))


class CpuBlockSize(Adapter):
    """Use a KV block size the CPU attention backend accepts.

    What broke: vLLM 0.29.0's CPU attention kernels accept only block sizes that are multiples of 32;
    speculators hard-codes 16.
    Where fixed: speculators' CacheConfig call, on the CPU platform only; the Scheduler then takes the block
    size from the config (see scheduler-block-size and the 0.4.0.1 call, which reads the config).
    """

    id = "cpu-block-size"
    covers = {"platform.cpu_block_size": {"multiple_of_32"}}
    target = GENERATOR_MODULE
    first_vllm = "0.29.0"

    def apply(self, module: ModuleType) -> None:
        def fix(cls: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            size = kwargs.get("block_size")
            if on_cpu() and isinstance(size, int) and size % 32:
                kwargs["block_size"] = size + (-size % 32)
            return kwargs

        def scheduler_block_size(cls: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            if on_cpu() and "block_size" in kwargs:
                kwargs["block_size"] = kwargs["vllm_config"].cache_config.block_size
            return kwargs

        self.wrap(module, "CacheConfig", rewrite_kwargs(fix))
        self.wrap(module, "Scheduler", rewrite_kwargs(scheduler_block_size))
