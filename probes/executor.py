"""vllm.v1.executor: the MultiprocExecutor speculators starts, and its call conventions."""

from __future__ import annotations

import ast

from vllm_compat.probes._kit import LINES, V030, V040, call_probe, calls, evidence, parse_source

from vllm_compat.apiview import ApiView
from vllm_compat.findings import BASELINE, Observation, probe

EXECUTOR = "vllm.v1.executor.multiproc_executor.MultiprocExecutor"

call_probe(
    "executor.multiproc_kwargs",
    [EXECUTOR],
    {key: ["vllm_config"] for key in LINES},
    "MultiprocExecutor(vllm_config=...)",
)


@probe(
    "executor.execute_model_protocol",
    symbol=f"{EXECUTOR}.execute_model",
    summary="one call runs a step, or execute_model() must be followed by sample_tokens()",
    expected={
        V030: "execute_model(scheduler_output) runs the whole step (0.3.0 never calls sample_tokens)",
        V040: "execute_model() returns None and sample_tokens() finishes the step (0.4.0.1 calls both)",
    },
    accepts={V030: {"single_phase"}, V040: {"two_phase"}},
)
def execute_model_protocol(view: ApiView) -> Observation:
    members = view.members(EXECUTOR)
    if members is None:
        return Observation.unknown(f"{EXECUTOR} is not readable")
    if "sample_tokens" in members:
        return Observation(
            "two_phase",
            "execute_model() returns None after the forward; sample_tokens() must be called before the next "
            "execute_model(), or the worker raises 'State error: sample_tokens() must be called'",
            (evidence(view.locate(f"{EXECUTOR}.sample_tokens")),),
        )
    return Observation(
        "single_phase",
        "execute_model() runs forward and sampling in one call",
        (evidence(view.locate(f"{EXECUTOR}.execute_model")),),
    )


def _returns_single_reply(tree: ast.AST) -> bool | None:
    """True for ``return responses[0] if rank is not None else responses``; False for a plain list; None (unknown)
    when some return builds a value of another shape (a dict, a tuple...), which neither line was written for."""
    verdict = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Return) and node.value is not None:
            value = node.value
            if isinstance(value, ast.IfExp) and any(
                isinstance(v, ast.Subscript) and isinstance(v.slice, ast.Constant) and v.slice.value == 0
                for v in (value.body, value.orelse)
            ):
                return True
            if isinstance(value, ast.Dict | ast.DictComp | ast.Set | ast.SetComp | ast.Tuple) or (
                isinstance(value, ast.Constant) and value.value is not None
            ):
                return None
            if isinstance(value, ast.Name | ast.List | ast.ListComp):
                verdict = False
    return verdict


@probe(
    "executor.unique_reply_shape",
    symbol=f"{EXECUTOR}.collective_rpc",
    summary="what collective_rpc(..., unique_reply_rank=0) returns",
    expected={
        V030: "a one-element list (0.3.0 indexes [0])",
        V040: "the single reply itself (0.4.0.1 uses it as a dict)",
    },
    accepts={V030: {"list"}, V040: {"single"}},
)
def unique_reply_shape(view: ApiView) -> Observation:
    parsed = parse_source(view, f"{EXECUTOR}.collective_rpc")
    if parsed is None:
        return Observation.unknown("collective_rpc's source is not readable")
    tree, loc = parsed
    single = _returns_single_reply(tree)
    if single is None:
        return Observation.unknown("no return statement of a known shape", evidence(loc))
    if single:
        return Observation("single", "with unique_reply_rank set it returns responses[0], not a list", (evidence(loc),))
    return Observation("list", "it returns the list of replies, one element with unique_reply_rank", (evidence(loc),))


@probe(
    "executor.warmup_in_initialize",
    symbol=f"{EXECUTOR}.initialize_from_config",
    summary="initialize_from_config() also compiles and warms up the model",
    expected=dict.fromkeys(LINES, "initialize_from_config() allocates the KV cache and warms the model up"),
)
def warmup_in_initialize(view: ApiView) -> Observation:
    parsed = parse_source(view, f"{EXECUTOR}.initialize_from_config")
    if parsed is None:
        return Observation.unknown("initialize_from_config's source is not readable")
    tree, loc = parsed
    if "'compile_or_warm_up_model'" in calls(tree):
        return Observation(BASELINE, "it calls compile_or_warm_up_model on the workers", (evidence(loc),))
    separate = view.locate(f"{EXECUTOR}.compile_or_warm_up_model")
    if separate is not None:
        return Observation(
            "separate",
            "warm-up moved to Executor.compile_or_warm_up_model(), which EngineCore calls separately",
            (evidence(loc), evidence(separate)),
        )
    return Observation("none", "no warm-up is run on this path", (evidence(loc),))
