"""vllm.v1.engine.core.EngineCore: the start-up speculators' generator skips, step by step.

speculators builds its executor, Scheduler and KV cache by hand and never runs EngineCore. Whatever EngineCore asks the
executor (and so every worker) to do between building it and the first step is either done by speculators, replayed
by an adapter, or not needed for a prefill-only extraction without KV connectors. Each step vLLM 0.11.0 to 0.34.0 asks
for is reviewed below; a step no review covers is drift no adapter handles, since nobody knows whether the hand-built
engine needs it (vLLM 0.34.0's ``extend_kv_cache`` was such a step: skipping it crashed the first large call on a GPU).
"""

from __future__ import annotations

import ast

from vllm_compat.probes._kit import LINES, evidence, parse_source

from vllm_compat.apiview import ApiView
from vllm_compat.findings import BASELINE, Observation, probe

_STARTUP = ("vllm.v1.engine.core.EngineCore.__init__", "vllm.v1.engine.core.EngineCore._initialize_kv_caches")
_EXECUTOR = {"self.model_executor", "model_executor", "executor"}

# step -> why speculators' hand-built engine is right without EngineCore doing it
REVIEWED: dict[str, str] = {
    "get_kv_cache_specs": "speculators asks the workers itself (collective_rpc('get_kv_cache_spec'))",
    "initialize_from_config": "speculators calls it with the KV-cache config it planned",
    "determine_available_memory": "speculators sizes the KV cache from its own memory query",
    "compile_or_warm_up_model": "replayed after initialize_from_config by warm-up-after-initialize",
    "get_supported_kv_cache_layouts": "replayed by kv-cache-layout before planning",
    "set_kv_cache_layout": "replayed by kv-cache-layout before planning",
    "extensible_kv_cache_unsupported_reason": "the cache is never extensible there (extensible-kv-cache-off)",
    "disable_extensible_kv_cache": "the cache is never extensible there (extensible-kv-cache-off)",
    "extend_kv_cache": "the cache is committed whole at initialisation (extensible-kv-cache-off)",
    "register_failure_callback": "EngineCore's report to its client; the generator has none and checks its executor",
    "collective_rpc(initialize_cache)": "workers size the cache from the KVCacheConfig given to initialize_from_config",
    "collective_rpc(update_max_model_len)": "only after vLLM fits max_model_len itself; speculators sets it",
    "get_kv_connector_handshake_metadata": "KV connectors only; speculators configures none",
    "init_kv_output_aggregator": "KV connectors only; speculators configures none",
    "init_ec_output_aggregator": "encoder-cache connectors only; speculators configures none",
    "get_simple_cpu_offload_num_blocks": "SimpleCPUOffloadConnector only; speculators configures none",
}


def executor_calls(tree: ast.AST) -> set[str]:
    """What a function body asks of the executor: ``executor.m(...)`` gives ``m``, ``collective_rpc("m")`` (on the
    executor or on EngineCore itself) gives ``collective_rpc(m)``."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner, name = ast.unparse(node.func.value), node.func.attr
        if name == "collective_rpc" and node.args and isinstance(node.args[0], ast.Constant):
            if owner in _EXECUTOR or owner == "self":
                found.add(f"collective_rpc({node.args[0].value})")
        elif owner in _EXECUTOR:
            found.add(name)
    return found


@probe(
    "engine.startup_steps",
    symbol="vllm.v1.engine.core.EngineCore._initialize_kv_caches",
    summary="every step EngineCore's start-up asks of the executor was reviewed against speculators' hand-built engine",
    expected=dict.fromkeys(LINES, "EngineCore's start-up asks the executor only for reviewed steps"),
)
def startup_steps(view: ApiView) -> Observation:
    steps: set[str] = set()
    where: list[str] = []
    for dotted in _STARTUP:
        parsed = parse_source(view, dotted)
        if parsed is not None:
            steps |= executor_calls(parsed[0])
            where.append(evidence(parsed[1]))
    if not where:
        return Observation.unknown("EngineCore.__init__ and EngineCore._initialize_kv_caches are not readable")
    new = sorted(steps - set(REVIEWED))
    if new:
        return Observation(
            f"unreviewed={','.join(new)}",
            f"EngineCore's start-up asks the executor for {', '.join(new)}, which speculators' generator skips and no "
            "review covers: it may need replaying (as warm-up-after-initialize does) or turning off (as "
            "extensible-kv-cache-off does)",
            tuple(where),
        )
    reviewed = f"EngineCore's start-up steps: {', '.join(sorted(steps))}; each reviewed"
    return Observation(BASELINE, reviewed, tuple(where))
