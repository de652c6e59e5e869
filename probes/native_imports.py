"""Every vLLM name hs-connectors imports, at the release each native line runs inside vLLM.

hs-connectors declares no vLLM requirement, yet its connectors, which vLLM loads in its workers and scheduler through
``kv_connector_module_path``, import these at module level (or lazily, or for type checking only, as noted). Read
from hs-connectors 0.8.0, 0.8.1 (``mooncake_hidden_states_connector.py``, the same imports) and 0.9.0 (that module and
``fp8_hidden_states_connector.py``). speculators 0.5 to 0.7 run no hs-connectors code inside vLLM.
"""

from __future__ import annotations

from vllm_compat.probes._kit import import_probe
from vllm_compat.probes._native import BASE_MODULE, CONNECTOR_MODULE, HSC, N09

_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"
_MODELS = "vllm.model_executor.models.extract_hidden_states"

# (module, name, lines, how it is imported)
IMPORTS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("vllm.config", "VllmConfig", HSC, "module level"),
    ("vllm.config", "get_layers_from_vllm_config", HSC, "module level"),
    (BASE_MODULE, "KVConnectorBase_V1", HSC, "module level; the mooncake connector's base"),
    (BASE_MODULE, "KVConnectorMetadata", HSC, "module level; subclassed for the connector's metadata"),
    (BASE_MODULE, "KVConnectorRole", HSC, "module level"),
    (BASE_MODULE, "SupportsHMA", HSC, "module level; the mooncake connector's second base"),
    (CONNECTOR_MODULE, "ExampleHiddenStatesConnector", HSC, "module level"),
    (CONNECTOR_MODULE, "extract_from_kv_cache", HSC, "module level; the mooncake connector reads the cache with it"),
    (_V1, "example_hidden_states_connector", (N09,), "module level; the fp8 connector subclasses its connector"),
    ("vllm.distributed.parallel_state", "get_tensor_model_parallel_rank", HSC, "module level"),
    ("vllm.logger", "init_logger", HSC, "module level"),
    ("vllm.v1.attention.backend", "AttentionMetadata", HSC, "module level"),
    ("vllm.v1.core.sched.output", "SchedulerOutput", HSC, "module level"),
    ("vllm.v1.kv_cache_interface", "HiddenStateCacheSpec", HSC, "lazily, when the connector is made"),
    (_MODELS, "CacheOnlyAttentionLayer", HSC, "lazily, in register_kv_caches"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheBlocks", HSC, "for type checking only"),
    ("vllm.v1.kv_cache_interface", "KVCacheConfig", HSC, "for type checking only"),
    ("vllm.v1.request", "Request", HSC, "for type checking only"),
)

PROBES = [
    import_probe(
        module,
        name,
        lines,
        id_prefix="native.import.",
        surface="native_imports",
        summary=f"hs-connectors' `from {module} import {name}` succeeds ({how})",
    )
    for module, name, lines, how in IMPORTS
]
