"""Every ``from vllm... import NAME`` in speculators' generator and worker extension."""

from __future__ import annotations

from vllm_compat.probes._kit import LINES, V030, V040, import_probe

_PLANNING = ("vllm.v1.core.kv_cache_planning",)

# (module, name, speculators lines that import it, known new homes)
IMPORTS: tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("vllm.config", "CacheConfig", LINES, ()),
    ("vllm.config", "DeviceConfig", LINES, ()),
    ("vllm.config", "LoadConfig", LINES, ()),
    ("vllm.config", "ModelConfig", LINES, ()),
    ("vllm.config", "ParallelConfig", LINES, ()),
    ("vllm.config", "SchedulerConfig", LINES, ()),
    ("vllm.config", "VllmConfig", LINES, ()),
    ("vllm.sampling_params", "SamplingParams", LINES, ()),
    ("vllm.utils.hashing", "get_hash_fn_by_name", (V040,), ("vllm.utils",)),
    ("vllm.v1.core.kv_cache_utils", "_get_kv_cache_groups_uniform_spec", LINES, _PLANNING),
    ("vllm.v1.core.kv_cache_utils", "get_kv_cache_config_from_groups", LINES, _PLANNING),
    ("vllm.v1.core.kv_cache_utils", "unify_hybrid_kv_cache_specs", LINES, _PLANNING),
    ("vllm.v1.core.kv_cache_utils", "get_request_block_hasher", (V040,), _PLANNING),
    ("vllm.v1.core.kv_cache_utils", "init_none_hash", (V040,), _PLANNING),
    ("vllm.v1.core.sched.scheduler", "Scheduler", LINES, ()),
    ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor", LINES, ()),
    ("vllm.v1.request", "Request", LINES, ()),
    ("vllm.v1.request", "RequestStatus", LINES, ()),
    ("vllm.v1.structured_output", "StructuredOutputManager", LINES, ()),
    ("vllm.distributed", "get_pp_group", LINES, ("vllm.distributed.parallel_state",)),
    ("vllm.distributed", "get_tp_group", LINES, ("vllm.distributed.parallel_state",)),
    ("vllm.model_executor.models.interfaces", "supports_eagle3", (V030,), ()),
    ("vllm.sequence", "IntermediateTensors", LINES, ()),
)

PROBES = [import_probe(module, name, lines, moved) for module, name, lines, moved in IMPORTS]
