"""vllm.config: the dataclasses speculators builds by hand, and the defaults it relies on."""

from __future__ import annotations

import ast

from vllm_compat.probes._kit import LINES, V030, V040, call_probe, calls, evidence, parse_source

from vllm_compat.apiview import ApiView
from vllm_compat.findings import BASELINE, Observation, probe

call_probe(
    "config.vllm_config_kwargs",
    ["vllm.config.VllmConfig"],
    {
        key: [
            "model_config",
            "cache_config",
            "parallel_config",
            "scheduler_config",
            "device_config",
            "load_config",
        ]
        for key in LINES
    },
    "VllmConfig takes the six sub-configs by keyword",
)
call_probe(
    "config.model_config_kwargs",
    ["vllm.config.ModelConfig"],
    {key: ["model", "tokenizer", "trust_remote_code", "dtype", "max_model_len", "enforce_eager"] for key in LINES},
    "ModelConfig takes model, tokenizer, trust_remote_code, dtype, max_model_len, enforce_eager",
)
call_probe(
    "config.cache_config_kwargs",
    ["vllm.config.CacheConfig"],
    {
        V030: ["block_size", "gpu_memory_utilization"],
        V040: ["block_size", "gpu_memory_utilization", "enable_prefix_caching"],
    },
    "CacheConfig takes block_size, gpu_memory_utilization (and enable_prefix_caching in 0.4)",
)
call_probe(
    "config.parallel_config_kwargs",
    ["vllm.config.ParallelConfig"],
    {key: ["tensor_parallel_size", "worker_extension_cls"] for key in LINES},
    "ParallelConfig takes tensor_parallel_size and worker_extension_cls",
)
call_probe(
    "config.scheduler_config_kwargs",
    ["vllm.config.SchedulerConfig"],
    {
        V030: ["max_num_seqs", "max_model_len", "max_num_batched_tokens"],
        V040: ["max_num_seqs", "max_model_len", "max_num_batched_tokens", "is_encoder_decoder"],
    },
    "SchedulerConfig is built from max_num_seqs, max_model_len, max_num_batched_tokens (+ is_encoder_decoder)",
)
call_probe("config.device_config_kwargs", ["vllm.config.DeviceConfig"], {key: [] for key in LINES}, "DeviceConfig()")
call_probe("config.load_config_kwargs", ["vllm.config.LoadConfig"], {key: [] for key in LINES}, "LoadConfig()")


def _default_of(view: ApiView, dotted: str, name: str) -> tuple[str | None, str]:
    params = view.parameters(dotted) or ()
    for p in params:
        if p.name == name:
            return p.default, evidence(view.locate(dotted), f"{name}={p.default}")
    return None, evidence(view.locate(dotted), f"no {name}")


@probe(
    "config.async_scheduling_default",
    symbol="vllm.config.SchedulerConfig.async_scheduling",
    summary="a hand-built VllmConfig keeps async scheduling off unless asked",
    expected=dict.fromkeys(LINES, "async_scheduling defaults to False: execute_model runs synchronously"),
    accepts={key: {"off"} for key in LINES},
)
def async_scheduling_default(view: ApiView) -> Observation:
    default, where = _default_of(view, "vllm.config.SchedulerConfig", "async_scheduling")
    if default is None:
        if view.parameters("vllm.config.SchedulerConfig") is None:
            return Observation.unknown("SchedulerConfig has no readable fields")
        return Observation("off", "SchedulerConfig has no async_scheduling field", (where,))
    if default in {"False", "Field(default=False)"}:
        return Observation("off", f"async_scheduling defaults to {default}", (where,))
    resolver = parse_source(view, "vllm.config.VllmConfig.__post_init__")
    how = ""
    if resolver is not None and "async_scheduling" in ast.unparse(resolver[0]):
        how = evidence(resolver[1], "VllmConfig.__post_init__ resolves None to True for mp/uni executors")
    return Observation(
        "auto",
        f"async_scheduling defaults to {default}: VllmConfig turns it on for the executor speculators uses",
        tuple(e for e in (where, how) if e),
    )


@probe(
    "config.prefix_caching_default",
    symbol="vllm.config.CacheConfig.enable_prefix_caching",
    summary="prefix caching stays off when speculators 0.3 does not mention it",
    expected={V030: "enable_prefix_caching defaults to off (0.3.0 passes no block hasher)"},
    accepts={V030: {"off"}},
)
def prefix_caching_default(view: ApiView) -> Observation:
    default, where = _default_of(view, "vllm.config.CacheConfig", "enable_prefix_caching")
    if default is None and view.parameters("vllm.config.CacheConfig") is None:
        return Observation.unknown("CacheConfig has no readable fields")
    if default in {"None", "False", None}:
        return Observation("off", f"enable_prefix_caching defaults to {default}", (where,))
    return Observation(
        "on",
        f"enable_prefix_caching defaults to {default}: requests without a block hasher trip "
        "BlockPool.cache_full_blocks, and repeated prompts would skip computing (and capturing) cached tokens",
        (where,),
    )


@probe(
    "config.model_runner_default",
    symbol="vllm.config.VllmConfig.use_v2_model_runner",
    summary="which model runner vLLM's workers use, and whether VLLM_USE_V2_MODEL_RUNNER pins it",
    expected=dict.fromkeys(LINES, "workers use the V1 model runner, which has input_batch.req_id_to_index"),
    accepts={key: {BASELINE, "v2_opt_in"} for key in LINES},
)
def model_runner_default(view: ApiView) -> Observation:
    """Variants: ``baseline`` (only V1 exists), ``v2_opt_in`` (V2 exists, VLLM_USE_V2_MODEL_RUNNER=1 selects it),
    ``v2_default`` (VllmConfig.use_v2_model_runner picks V2 for some or all models; the variable pins either),
    ``v2_only`` (V1 is gone, or the chooser always answers V2), ``unpinned`` (the chooser ignores the variable).
    Which runner vllm-compat then runs is decided from these and the runners' own facts (vllm_compat/runners.py)."""
    has_v1 = view.has_module("vllm.v1.worker.gpu_model_runner")
    if not view.has_module("vllm.v1.worker.gpu.model_runner"):
        if not has_v1:
            return Observation.unknown("neither vllm.v1.worker.gpu_model_runner nor vllm.v1.worker.gpu exists")
        return Observation(BASELINE, "only the V1 model runner exists")
    v2 = view.locate("vllm.v1.worker.gpu.model_runner.GPUModelRunner")
    if not has_v1:
        return Observation(
            "v2_only", "Model Runner V1 is gone (no vllm.v1.worker.gpu_model_runner): workers run V2", (evidence(v2),)
        )
    chooser = view.locate("vllm.config.VllmConfig.use_v2_model_runner")
    if chooser is None:
        return Observation(
            "v2_opt_in",
            "Model Runner V2 exists but only VLLM_USE_V2_MODEL_RUNNER=1 selects it",
            (evidence(v2),),
        )
    tree = parse_source(view, "vllm.config.VllmConfig.use_v2_model_runner")
    if tree is None:
        return Observation.unknown("VllmConfig.use_v2_model_runner is not readable", evidence(chooser))
    if _always_true(tree[0]):
        return Observation("v2_only", "VllmConfig.use_v2_model_runner always answers True", (evidence(chooser),))
    if "VLLM_USE_V2_MODEL_RUNNER" not in ast.unparse(tree[0]):
        return Observation(
            "unpinned",
            "VllmConfig.use_v2_model_runner never reads VLLM_USE_V2_MODEL_RUNNER: the runner cannot be pinned",
            (evidence(chooser),),
        )
    names = calls(tree[0])
    return Observation(
        "v2_default",
        "VllmConfig.use_v2_model_runner picks Model Runner V2 by default for some or all models "
        "(VLLM_USE_V2_MODEL_RUNNER pins either runner); V2 has no input_batch (batch order is a per-step local)",
        (evidence(chooser, ", ".join(sorted(n for n in names if "v2" in n.lower())[:3])), evidence(v2)),
    )


def _always_true(tree: ast.AST) -> bool:
    """Whether a function's body, docstring aside, is ``return True``."""
    func = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)), None)
    if func is None:
        return False
    body = [s for s in func.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return (
        len(body) == 1
        and isinstance(body[0], ast.Return)
        and isinstance(body[0].value, ast.Constant)
        and body[0].value.value is True
    )
