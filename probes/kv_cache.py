"""vllm.v1.core.kv_cache_utils: the KV-cache planning helpers speculators calls before the Scheduler."""

from __future__ import annotations

from vllm_compat.probes._kit import LINES, V030, V040, call_probe, calls, evidence, first_found, parse_source

from vllm_compat.apiview import ApiView
from vllm_compat.findings import BASELINE, Observation, probe

_HOMES = ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning")


def _homes(name: str) -> list[str]:
    return [f"{module}.{name}" for module in _HOMES]


call_probe(
    "kv_cache.config_from_groups_kwargs",
    _homes("get_kv_cache_config_from_groups"),
    {
        V030: ["vllm_config", "kv_cache_groups", "kv_cache_specs", "available_memory"],
        V040: ["vllm_config", "kv_cache_groups", "available_memory"],
    },
    "get_kv_cache_config_from_groups(vllm_config=, kv_cache_groups=, [kv_cache_specs=,] available_memory=)",
)
call_probe(
    "kv_cache.uniform_spec_groups_call",
    _homes("_get_kv_cache_groups_uniform_spec"),
    {key: [] for key in LINES},
    "_get_kv_cache_groups_uniform_spec(kv_cache_spec) positionally",
    positional_by_line=dict.fromkeys(LINES, 1),
)
call_probe(
    "kv_cache.unify_hybrid_specs_call",
    _homes("unify_hybrid_kv_cache_specs"),
    {key: [] for key in LINES},
    "unify_hybrid_kv_cache_specs(kv_cache_spec) positionally",
    positional_by_line=dict.fromkeys(LINES, 1),
)


@probe(
    "kv_cache.layout_precondition",
    symbol="vllm.v1.core.kv_cache_utils.get_kv_cache_config_from_groups",
    summary="planning the KV cache needs nothing set up beforehand",
    expected=dict.fromkeys(LINES, "get_kv_cache_config_from_groups works on a fresh VllmConfig"),
)
def layout_precondition(view: ApiView) -> Observation:
    found = first_found(view, _homes("get_kv_cache_config_from_groups"))
    if found is None:
        return Observation.unknown("get_kv_cache_config_from_groups not found")
    parsed = parse_source(view, found[0])
    if parsed is None:
        return Observation.unknown("its source is not readable", evidence(found[1]))
    if "get_resolved_kv_cache_layout" in calls(parsed[0]):
        return Observation(
            "layout_required",
            "it reads cache_config.get_resolved_kv_cache_layout(): the KV-cache layout must be resolved and "
            "set on the workers first (as EngineCore does), or it raises ValueError",
            (evidence(found[1]),),
        )
    return Observation(BASELINE, "no precondition found in its body", (evidence(found[1]),))
