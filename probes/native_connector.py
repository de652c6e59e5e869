"""The KV connector API the native line's connectors rely on: vLLM's ExampleHiddenStatesConnector (every native
line's ``file`` backend) and hs-connectors' connectors loaded into vLLM (mooncake from 0.8, fp8 from 0.9)."""

from __future__ import annotations

import ast
from collections.abc import Sequence

from vllm_compat.probes._kit import evidence, first_found, parse_source
from vllm_compat.probes._native import BASE, EXAMPLE, HSC, N09, NATIVE_LINES

from vllm_compat.apiview import ApiView, Param
from vllm_compat.findings import BASELINE, Observation, probe

HMA = "vllm.distributed.kv_transfer.kv_connector.v1.base.SupportsHMA"
FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory.KVConnectorFactory"

# hs-connectors' MooncakeHiddenStatesConnector (0.8.0, 0.8.1, 0.9.0: the same overrides): method -> (the class vLLM
# calls it through, the parameters it declares; "*" and "**" for *args / **kwargs)
OVERRIDES: dict[str, tuple[str, tuple[str, ...]]] = {
    "__init__": (BASE, ("vllm_config", "role", "kv_cache_config")),
    "start_load_kv": (BASE, ("*", "**")),
    "wait_for_layer_load": (BASE, ("layer_name",)),
    "save_kv_layer": (BASE, ("layer_name", "kv_layer", "attn_metadata", "**")),
    "wait_for_save": (BASE, ()),
    "register_kv_caches": (BASE, ("kv_caches",)),
    "get_finished": (BASE, ("finished_req_ids",)),
    "get_num_new_matched_tokens": (BASE, ("request", "num_computed_tokens")),
    "update_state_after_alloc": (BASE, ("request", "blocks", "num_external_tokens")),
    "build_connector_meta": (BASE, ("scheduler_output",)),
    "request_finished": (BASE, ("request", "block_ids")),
    "request_finished_all_groups": (HMA, ("request", "block_ids")),
    "get_required_kvcache_layout": (BASE, ("vllm_config",)),
    "prefer_cross_layer_blocks": (BASE, ()),  # a property
}
# overrides that only opt out of a vLLM feature: where the base no longer declares them, the feature is gone
OPT_OUTS = {
    "prefer_cross_layer_blocks": "KVConnectorBase_V1 has no prefer_cross_layer_blocks: vLLM no longer merges KV "
    "blocks across layers (gone in 0.29.0), so the connector's opt-out is moot"
}
# what the mooncake connector uses of the base without overriding it
BASE_USES = ("has_connector_metadata", "_get_connector_metadata")
BASE_STATE = ("_vllm_config", "_kv_transfer_config")


def _fits(override: Sequence[str], base: Sequence[Param]) -> list[str]:
    """What of the base's call shape the override cannot take: vLLM calls the method as the base declares it."""
    takes_args, takes_kwargs = "*" in override, "**" in override
    named = [n for n in override if n not in {"*", "**"}]
    problems = []
    for i, p in enumerate(b for b in base if b.kind not in {"var_positional", "var_keyword"}):
        if p.name in named or takes_kwargs or (takes_args and p.kind != "keyword_only"):
            continue
        if p.kind == "positional_only" and i < len(named):
            continue
        problems.append(f"cannot take {p.name}")
    base_names = {p.name for p in base}
    base_open = any(p.kind in {"var_positional", "var_keyword"} for p in base)
    extra = [n for n in named if n not in base_names]
    if extra and not base_open:
        problems.append(f"expects {','.join(extra)}, which the base does not pass")
    return problems


@probe(
    "native.connector.example",
    symbol=EXAMPLE,
    summary="vLLM ships ExampleHiddenStatesConnector, the connector launch_vllm.py's file backend names",
    expected=dict.fromkeys(NATIVE_LINES, "ExampleHiddenStatesConnector is a KVConnectorBase_V1 vLLM registers"),
)
def example(view: ApiView) -> Observation:
    loc = view.locate(EXAMPLE)
    if loc is None:
        return Observation("missing", "vLLM has no ExampleHiddenStatesConnector (it appeared in vLLM 0.17.0)")
    factory = parse_source(view, FACTORY)
    members = view.members(EXAMPLE)
    if members is None or factory is None:
        return Observation.unknown("ExampleHiddenStatesConnector or KVConnectorFactory is not readable", evidence(loc))
    if "request_finished" not in members or "register_kv_caches" not in members:
        return Observation("not_a_connector", "ExampleHiddenStatesConnector lacks the KVConnectorBase_V1 API",
                           (evidence(loc),))  # fmt: skip
    return Observation(BASELINE, "ExampleHiddenStatesConnector exists", (evidence(loc),))


@probe(
    "native.connector.storage_path",
    symbol=f"{EXAMPLE}.__init__",
    summary="ExampleHiddenStatesConnector writes under kv_connector_extra_config['shared_storage_path'] (the "
    "--hidden-states-path launch_vllm.py passes)",
    expected=dict.fromkeys(NATIVE_LINES, "the connector reads shared_storage_path from kv_connector_extra_config"),
)
def storage_path(view: ApiView) -> Observation:
    parsed = parse_source(view, EXAMPLE)
    if parsed is None:
        return Observation("missing", "vLLM has no ExampleHiddenStatesConnector")
    if "shared_storage_path" in {n.value for n in ast.walk(parsed[0]) if isinstance(n, ast.Constant)}:
        return Observation(BASELINE, "the connector reads shared_storage_path", (evidence(parsed[1]),))
    return Observation(
        "ignored",
        "ExampleHiddenStatesConnector never reads shared_storage_path: the files go elsewhere than the client reads",
        (evidence(parsed[1]),),
    )


@probe(
    "native.connector.module_path",
    symbol=f"{FACTORY}.get_connector_class",
    summary="vLLM loads a connector class from kv_connector_module_path (how hs-connectors' connectors get in)",
    expected=dict.fromkeys(HSC, "KVConnectorFactory imports kv_connector_module_path and takes kv_connector from it"),
)
def module_path(view: ApiView) -> Observation:
    parsed = parse_source(view, FACTORY)
    if parsed is None:
        loc = view.locate(FACTORY)
        if loc is None:
            return Observation("missing", "vLLM has no KVConnectorFactory")
        return Observation.unknown("KVConnectorFactory is not readable", evidence(loc))
    tree, loc = parsed
    text = ast.unparse(tree)
    if "kv_connector_module_path" in text and "import_module" in text:
        return Observation(BASELINE, "KVConnectorFactory imports kv_connector_module_path", (evidence(loc),))
    return Observation(
        "ignored",
        "KVConnectorFactory never reads kv_connector_module_path: hs-connectors' connectors cannot be loaded",
        (evidence(loc),),
    )


@probe(
    "native.connector.overrides",
    symbol=BASE,
    summary="every method hs-connectors' mooncake connector overrides is one vLLM calls, with a call shape it takes",
    expected=dict.fromkeys(
        HSC,
        "KVConnectorBase_V1 / SupportsHMA declare " + ", ".join(OVERRIDES) + " with parameters the overrides take",
    ),
)
def overrides(view: ApiView) -> Observation:
    if view.locate(BASE) is None:
        return Observation("missing", "vLLM has no KVConnectorBase_V1")
    problems, seen, notes = [], [], []
    for name, (owner, params) in OVERRIDES.items():
        loc = view.locate(f"{owner}.{name}")
        if loc is None and name in OPT_OUTS:
            notes.append(OPT_OUTS[name])
            continue
        if loc is None:
            problems.append(f"{name}: not on {owner.rsplit('.', 1)[1]}")
            continue
        seen.append(evidence(loc))
        if name == "prefer_cross_layer_blocks":
            continue
        base_params = view.parameters(f"{owner}.{name}")
        if base_params is None:
            return Observation.unknown(f"the parameters of {owner}.{name} are not readable", evidence(loc))
        problems += [f"{name}: {p}" for p in _fits(params, base_params)]
    if problems:
        return Observation(
            "changed=" + ",".join(sorted({p.split(":")[0] for p in problems})),
            "; ".join(problems),
            tuple(seen[:3]),
        )
    note = f" ({'; '.join(notes)})" if notes else ""
    return Observation(BASELINE, f"the overridden methods are declared and fit{note}", tuple(seen[:2]))


@probe(
    "native.connector.base_state",
    symbol=f"{BASE}.__init__",
    summary="the base's state and helpers hs-connectors' mooncake connector uses without overriding them",
    expected=dict.fromkeys(
        HSC,
        "KVConnectorBase_V1 sets self._vllm_config, self._kv_transfer_config and has has_connector_metadata, "
        "_get_connector_metadata; KVTransferConfig has get_from_extra_config",
    ),
)
def base_state(view: ApiView) -> Observation:
    parsed = parse_source(view, f"{BASE}.__init__")
    if parsed is None:
        return Observation("missing", "KVConnectorBase_V1.__init__ is not there")
    text = ast.unparse(parsed[0])
    missing = [f"self.{a}" for a in BASE_STATE if not _sets(text, a)]
    missing += [m for m in BASE_USES if view.locate(f"{BASE}.{m}") is None]
    cfg = first_found(view, ["vllm.config.kv_transfer.KVTransferConfig.get_from_extra_config"])
    if cfg is None:
        missing.append("KVTransferConfig.get_from_extra_config")
    if missing:
        return Observation("lacks=" + ",".join(missing), f"missing: {', '.join(missing)}", (evidence(parsed[1]),))
    return Observation(BASELINE, "the base state and helpers are there", (evidence(parsed[1]),))


@probe(
    "native.connector.write_tensors",
    symbol=f"{EXAMPLE}._write_tensors",
    summary="hs-connectors 0.9.0's fp8 connector overrides ExampleHiddenStatesConnector's private _write_tensors",
    expected={N09: "a staticmethod _write_tensors(tensors, event, filename, lock_fd) the connector calls through self"},
)
def write_tensors(view: ApiView) -> Observation:
    fn_name = "_write_tensors"
    dotted = f"{EXAMPLE}.{fn_name}"
    cls = parse_source(view, EXAMPLE)
    if cls is None:
        return Observation("missing", "vLLM has no ExampleHiddenStatesConnector")
    loc = view.locate(dotted)
    if loc is None:
        return Observation(
            "missing",
            "ExampleHiddenStatesConnector has no _write_tensors (it writes its files inline): the fp8 connector's "
            "override is never called and the files are written unquantized (vLLM 0.22.0 added it)",
            (evidence(cls[1]),),
        )
    params = view.parameters(dotted)
    fn = parse_source(view, dotted)
    if params is None or fn is None:
        return Observation.unknown("_write_tensors is not readable", evidence(loc))
    names = tuple(p.name for p in params)
    func = next(  # in the class's tree: a method's own source leaves its decorators out
        (n for n in ast.walk(cls[0]) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == fn_name),
        None,
    )
    static = func is not None and any(ast.unparse(d) == "staticmethod" for d in func.decorator_list)
    through_self = "self._write_tensors" in ast.unparse(cls[0])
    if names != ("tensors", "event", "filename", "lock_fd") or not static:
        return Observation(
            "changed",
            f"_write_tensors({', '.join(names)}){' is not a staticmethod' if not static else ''}: the fp8 "
            "override (a staticmethod of tensors, event, filename, lock_fd) no longer fits",
            (evidence(loc),),
        )
    if not through_self:
        return Observation("not_called", "the connector no longer calls self._write_tensors", (evidence(loc),))
    return Observation(BASELINE, "staticmethod _write_tensors(tensors, event, filename, lock_fd), called through "
                       "self", (evidence(loc),))  # fmt: skip


_REQUEST_FIELDS = ("request_id", "kv_transfer_params", "all_token_ids", "prompt_token_ids")


def _sets(text: str, attr: str) -> bool:
    return f"self.{attr} =" in text or f"self.{attr}:" in text


@probe(
    "native.connector.request_fields",
    symbol="vllm.v1.request.Request",
    summary="the Request and SchedulerOutput fields hs-connectors' mooncake connector reads",
    expected=dict.fromkeys(
        HSC, "Request has " + ", ".join(_REQUEST_FIELDS) + "; SchedulerOutput.scheduled_new_reqs[i].req_id"
    ),
)
def request_fields(view: ApiView) -> Observation:
    parsed = parse_source(view, "vllm.v1.request.Request")
    if parsed is None:
        return Observation("missing", "vllm.v1.request has no Request")
    text = ast.unparse(parsed[0])
    members = view.members("vllm.v1.request.Request") or frozenset()
    missing = [f for f in _REQUEST_FIELDS if not _sets(text, f) and f not in members]
    out = view.parameters("vllm.v1.core.sched.output.SchedulerOutput")
    new = view.parameters("vllm.v1.core.sched.output.NewRequestData")
    if out is None or new is None:
        return Observation.unknown("SchedulerOutput or NewRequestData has no readable fields", evidence(parsed[1]))
    if "scheduled_new_reqs" not in {p.name for p in out}:
        missing.append("SchedulerOutput.scheduled_new_reqs")
    if "req_id" not in {p.name for p in new}:
        missing.append("NewRequestData.req_id")
    if missing:
        return Observation("lacks=" + ",".join(missing), f"missing: {', '.join(missing)}", (evidence(parsed[1]),))
    return Observation(BASELINE, "Request and SchedulerOutput have the fields read", (evidence(parsed[1]),))


@probe(
    "native.connector.creation",
    symbol="vllm.v1.worker.extensible_kv_cache.extend_kv_cache",
    summary="when a worker's KV connector is made, and how it reaches the KV cache (vLLM 0.34.0's extensible cache)",
    expected=dict.fromkeys(
        NATIVE_LINES,
        "the worker's connector is made with the KV cache it registers, reaching it in process",
    ),
    accepts={line: {BASELINE, "after_warmup_in_process"} for line in NATIVE_LINES},
)
def creation(view: ApiView) -> Observation:
    """Variants: ``baseline`` (made in initialize_kv_cache, before the cache is allocated), ``after_warmup_in_process``
    (vLLM 0.34.0 with the extensible KV cache, on by default on CUDA: made in ``extend_kv_cache`` once the warm-up is
    done, against views rebuilt over the committed bytes; ``KVConnectorBase_V1.kv_cache_access()`` defaults to
    IN_PROCESS, which neither ExampleHiddenStatesConnector nor hs-connectors' connectors override: accepted),
    ``after_warmup_registers`` (the default access would have the connector register or export the memory)."""
    ext = parse_source(view, "vllm.v1.worker.extensible_kv_cache.extend_kv_cache")
    if ext is None:
        return Observation(BASELINE, "no extensible KV cache: the connector is made with the KV cache")
    if "ensure_kv_transfer_initialized" not in ast.unparse(ext[0]):
        return Observation(BASELINE, "extend_kv_cache makes no connector", (evidence(ext[1]),))
    access = parse_source(view, f"{BASE}.kv_cache_access")
    if access is None:
        return Observation.unknown(
            "the connector is made in extend_kv_cache, but KVConnectorBase_V1.kv_cache_access is not readable",
            evidence(ext[1]),
        )
    returns = [ast.unparse(n.value) for n in ast.walk(access[0]) if isinstance(n, ast.Return) and n.value]
    if returns == ["KVCacheAccess.IN_PROCESS"]:
        return Observation(
            "after_warmup_in_process",
            "the worker's connector is made in extend_kv_cache after the warm-up; kv_cache_access() defaults to "
            "IN_PROCESS (not overridden by the hidden-states connectors)",
            (evidence(ext[1]), evidence(access[1])),
        )
    return Observation(
        "after_warmup_registers",
        f"the connector is made in extend_kv_cache and kv_cache_access() defaults to {' / '.join(returns) or '?'}",
        (evidence(ext[1]), evidence(access[1])),
    )


@probe(
    "native.runner.extract_hidden_states",
    symbol="vllm.config.VllmConfig.use_v2_model_runner",
    summary="the model runner `vllm serve` picks can run the extract_hidden_states method",
    expected=dict.fromkeys(NATIVE_LINES, "the runner vLLM picks has an extract_hidden_states proposer"),
    accepts={line: {BASELINE, "v1_fallback", "v2"} for line in NATIVE_LINES},
)
def runner(view: ApiView) -> Observation:
    """Variants: ``baseline`` (only Model Runner V1, which has the extract_hidden_states proposer), ``v1_fallback``
    (V2 exists and lacks it, and V1 runs the method: opt-in V2 in 0.17 to 0.22; in 0.23 to 0.28 the chooser lists it
    as unsupported on V2, and VLLM_USE_V2_MODEL_RUNNER=1 makes V2 refuse it at start-up: vLLM #49562), ``v2`` (V2 has an
    ExtractHiddenStatesSpeculator: vLLM 0.29.0 on), ``v2_refuses`` (V2 is what runs and has none)."""
    v1 = view.locate("vllm.v1.spec_decode.extract_hidden_states.ExtractHiddenStatesProposer")
    v1_runner = view.has_module("vllm.v1.worker.gpu_model_runner")
    v2_runner = view.has_module("vllm.v1.worker.gpu.model_runner")
    v2 = view.locate("vllm.v1.worker.gpu.spec_decode.extract_hidden_states.ExtractHiddenStatesSpeculator")
    if v1 is None and v2 is None:
        return Observation("missing", "no model runner has an extract_hidden_states proposer")
    if v2_runner and v2 is not None:
        return Observation("v2", "Model Runner V2 has an ExtractHiddenStatesSpeculator", (evidence(v2),))
    if not v2_runner:
        if v1_runner and v1 is not None:
            return Observation(BASELINE, "Model Runner V1 has the extract_hidden_states proposer", (evidence(v1),))
        return Observation("missing", "no model runner has an extract_hidden_states proposer")
    if not (v1_runner and v1 is not None):
        return Observation("v2_refuses", "Model Runner V2 runs and has no extract_hidden_states speculator")
    chooser = parse_source(view, "vllm.config.VllmConfig.use_v2_model_runner")
    if chooser is None:
        return Observation("v1_fallback", "Model Runner V2 is opt-in (VLLM_USE_V2_MODEL_RUNNER=1) and lacks the "
                           "extractor; V1 runs it", (evidence(v1),))  # fmt: skip
    unsupported = parse_source(view, "vllm.config.VllmConfig._get_v2_model_runner_unsupported_features")
    if unsupported is not None and "speculative method" in ast.unparse(unsupported[0]):
        return Observation(
            "v1_fallback",
            "Model Runner V2 lacks the extractor and VllmConfig sends unsupported speculative methods to V1; with "
            "VLLM_USE_V2_MODEL_RUNNER=1 V2 refuses the method at start-up (vLLM #49562, until 0.29.0): leave it unset",
            (evidence(unsupported[1]), evidence(v1)),
        )
    return Observation(
        "v2_refuses",
        "Model Runner V2 lacks an extract_hidden_states speculator and nothing sends the method to V1",
        (evidence(chooser[1]),),
    )


# What vLLM's CPU platform lacks and the connector's copy off its cache uses, through the module's ``torch`` name:
# the calls adapters/native_connector.py's ``native-connector-on-cpu`` replaces there (anything else CUDA-only is
# a copy path it does not know)
CUDA_CALLS = frozenset({"torch.cuda.Stream", "torch.cuda.Event", "torch.cuda.stream"})
PINNING_FACTORIES = frozenset({"torch.empty", "torch.empty_like", "torch.zeros", "torch.zeros_like"})


def cuda_only_uses(tree: ast.AST) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """The CUDA-only calls in ``tree`` as (text, line): those ``native-connector-on-cpu`` knows, and the others
    (another ``torch.cuda`` call, a name imported from ``torch.cuda``, pinned memory asked for another way)."""
    known: list[tuple[str, int]] = []
    other: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.cuda"):
            other.append((f"from {node.module} import ...", node.lineno))
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        pinned = any(
            k.arg == "pin_memory" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
            for k in node.keywords
        )
        if func in CUDA_CALLS or (pinned and func in PINNING_FACTORIES):
            known.append((f"{func}(...)" + (" with pin_memory" if pinned else ""), node.lineno))
        elif func.startswith(("torch.cuda.", "cuda.")) or pinned or func.endswith(".pin_memory"):
            other.append((f"{func}(...)", node.lineno))
    return known, other


@probe(
    "native.connector.device_copy",
    symbol=EXAMPLE,
    summary="how ExampleHiddenStatesConnector copies the states off its cache to host memory: vLLM's CPU platform "
    "has no CUDA streams, events or pinned memory",
    expected=dict.fromkeys(NATIVE_LINES, "a copy that needs nothing CUDA-only (a plain .cpu(), vLLM 0.17 to 0.21)"),
)
def device_copy(view: ApiView) -> Observation:
    """Variants: ``baseline`` (no CUDA-only call: the states are copied with ``.cpu()`` and written inline),
    ``cuda_copy_stream`` (vLLM 0.22.0 on: a ``torch.cuda.Stream``, ``torch.cuda.Event`` and ``torch.cuda.stream``
    around a non-blocking copy into ``pin_memory=True`` memory, its event waited for by the writer thread and polled
    by ``get_finished``; works on a GPU, kills the engine at the first request on vLLM's CPU platform, and
    ``native-connector-on-cpu`` makes it synchronous there), ``cuda_other`` (CUDA-only calls that adapter does not
    know: unhandled)."""
    parsed = parse_source(view, EXAMPLE)
    if parsed is None:
        loc = view.locate(EXAMPLE)
        if loc is None:
            return Observation("missing", "vLLM has no ExampleHiddenStatesConnector")
        return Observation.unknown("ExampleHiddenStatesConnector is not readable", evidence(loc))
    tree, loc = parsed
    known, other = cuda_only_uses(tree)

    def at(uses: list[tuple[str, int]]) -> tuple[str, ...]:
        first = {text: line for text, line in sorted(uses, key=lambda u: -u[1])}  # each call's first line
        ordered = sorted(first.items(), key=lambda item: item[1])
        where = [f"{text} at line {loc.line + line - 1}" if loc and loc.line else text for text, line in ordered]
        return (evidence(loc, "; ".join(where)),)

    if other:
        return Observation(
            "cuda_other",
            "the connector's copy off its cache uses CUDA-only calls native-connector-on-cpu does not know: "
            + ", ".join(sorted({text for text, _ in other})),
            at(other),
        )
    if known:
        return Observation(
            "cuda_copy_stream",
            "the connector copies the states on a torch.cuda.Stream into pinned memory and tracks it with "
            "torch.cuda.Event: CUDA-only, so on vLLM's CPU platform the first request kills the engine "
            "(native-connector-on-cpu makes the copy synchronous there; on a GPU it is left as it is)",
            at(known),
        )
    return Observation(BASELINE, "the connector copies the states with nothing CUDA-only", (evidence(loc),))
