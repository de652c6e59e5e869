"""The native line's config contract: what ``launch_vllm.py`` hands ``vllm serve`` (speculators 0.5 to 0.9)."""

from __future__ import annotations

import ast

from vllm_compat.probes._kit import evidence, first_found, parse_source
from vllm_compat.probes._native import CHAT, HSC, NATIVE_LINES

from vllm_compat.apiview import ApiView
from vllm_compat.findings import BASELINE, Observation, probe

METHOD = "extract_hidden_states"
LAYER_IDS = "eagle_aux_hidden_state_layer_ids"
# where vLLM reads the draft hf_config's layer ids for the extract_hidden_states method (V1 proposer, V2 speculator,
# the cache-only model)
_LAYER_ID_READERS = (
    "vllm.v1.spec_decode.extract_hidden_states.ExtractHiddenStatesProposer",
    "vllm.v1.worker.gpu.spec_decode.extract_hidden_states.ExtractHiddenStatesSpeculator",
    "vllm.model_executor.models.extract_hidden_states.ExtractHiddenStatesModel",
)


def _has_constant(tree: ast.AST, value: str) -> bool:
    return any(isinstance(n, ast.Constant) and n.value == value for n in ast.walk(tree))


@probe(
    "native.config.method",
    symbol="vllm.config.speculative.SpeculativeConfig",
    summary="SpeculativeConfig accepts method 'extract_hidden_states' (launch_vllm.py's --speculative_config)",
    expected=dict.fromkeys(NATIVE_LINES, "SpeculativeConfig takes method='extract_hidden_states'"),
)
def method(view: ApiView) -> Observation:
    dotted = "vllm.config.speculative.SpeculativeConfig"
    loc = view.locate(dotted)
    if loc is None:
        if view.locate("vllm.config.SpeculativeConfig") is None:
            return Observation("missing", "vllm.config has no SpeculativeConfig: no speculative method at all")
        dotted, loc = "vllm.config.SpeculativeConfig", view.locate("vllm.config.SpeculativeConfig")
    parsed = parse_source(view, dotted)
    if parsed is None:
        return Observation.unknown("SpeculativeConfig's source is not readable", evidence(loc))
    if _has_constant(parsed[0], METHOD):
        return Observation(BASELINE, f"SpeculativeConfig handles method={METHOD!r}", (evidence(loc),))
    return Observation(
        "missing",
        f"SpeculativeConfig never names {METHOD!r}: this vLLM has no hidden-state extraction method "
        "(it appeared in vLLM 0.17.0)",
        (evidence(loc),),
    )


@probe(
    "native.config.layer_ids",
    symbol="draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids",
    summary="the extract_hidden_states path reads the layer ids from the draft hf_config launch_vllm.py passes",
    expected=dict.fromkeys(NATIVE_LINES, f"the extractor reads {LAYER_IDS} from the draft model's hf_config"),
)
def layer_ids(view: ApiView) -> Observation:
    found = [(d, view.locate(d)) for d in _LAYER_ID_READERS]
    found = [(d, loc) for d, loc in found if loc is not None]
    if not found:
        return Observation("missing", "no extract_hidden_states proposer, speculator or model exists")
    readers = []
    for dotted, loc in found:
        parsed = parse_source(view, dotted)
        if parsed is None:
            return Observation.unknown(f"{dotted} is not readable", evidence(loc))
        if _has_constant(parsed[0], LAYER_IDS) or LAYER_IDS in ast.unparse(parsed[0]):
            readers.append(evidence(loc))
    if readers:
        return Observation(BASELINE, f"{LAYER_IDS} is read by the extractor", tuple(readers))
    return Observation(
        "not_read",
        f"the extract_hidden_states code never reads {LAYER_IDS}: the layers launch_vllm.py asks for are ignored",
        tuple(evidence(loc) for _, loc in found),
    )


_DRAFT_CONFIG_READERS = (
    "vllm.v1.worker.gpu.spec_decode.extract_hidden_states_config.ExtractHiddenStatesSpeculatorConfig.configure",
    "vllm.config.speculative.SpeculativeConfig",
)


@probe(
    "native.config.draft_hf_config",
    symbol="vllm.config.speculative.SpeculativeConfig.draft_model_config",
    summary="a draft_model_config given as {'hf_config': {...}} (how launch_vllm.py passes the layer ids) is merged "
    "into the extractor's hf_config",
    expected=dict.fromkeys(
        NATIVE_LINES, "for extract_hidden_states, draft_model_config['hf_config'] is merged into the draft hf_config"
    ),
)
def draft_hf_config(view: ApiView) -> Observation:
    """launch_vllm.py passes ``"draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [...]}}``;
    vLLM takes the dict's ``hf_config`` apart in SpeculativeConfig (0.17 to 0.33) or in the V2 speculator's config
    (0.34). Where nothing reads it, the layer ids never reach the extractor."""
    seen = []
    for dotted in _DRAFT_CONFIG_READERS:
        parsed = parse_source(view, dotted)
        if parsed is None:
            continue
        seen.append(evidence(parsed[1]))
        text = ast.unparse(parsed[0])
        if METHOD in text and "'hf_config' in " in text and "['hf_config']" in text:
            return Observation(BASELINE, "the draft_model_config dict's hf_config is merged", (evidence(parsed[1]),))
    if not seen:
        return Observation("missing", "vLLM has no SpeculativeConfig")
    return Observation(
        "ignored",
        "nothing takes draft_model_config['hf_config'] for extract_hidden_states: the layer ids launch_vllm.py "
        "passes never reach the extractor",
        tuple(seen),
    )


@probe(
    "native.config.layer_index",
    symbol="vllm.model_executor.models.llama.LlamaModel.forward",
    summary="layer id k is the output of decoder layer k, so num_hidden_layers (which launch_vllm.py appends) is the "
    "last layer's output",
    expected=dict.fromkeys(
        NATIVE_LINES,
        "aux hidden state k = output of layer k (0 = embeddings); id num_hidden_layers = the last layer's output",
    ),
)
def layer_index(view: ApiView) -> Observation:
    """Variants: ``baseline`` (``_maybe_add_hidden_state(..., idx + 1, ...)`` after each layer, vLLM 0.18.0 on),
    ``before_layer`` (``if idx in self.aux_hidden_state_layers`` before layer idx runs: id k is layer k's input, and
    id num_hidden_layers is never collected, so the file holds one layer fewer than asked)."""
    dotted = "vllm.model_executor.models.llama.LlamaModel.forward"
    parsed = parse_source(view, dotted)
    if parsed is None:
        return Observation.unknown("LlamaModel.forward is not readable", evidence(view.locate(dotted)))
    tree, loc = parsed
    text = ast.unparse(tree)
    for node in ast.walk(tree):
        adds = isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "_maybe_add_hidden_state"
        if adds and any("+ 1" in ast.unparse(a) for a in node.args):
            return Observation(
                BASELINE,
                "LlamaModel.forward adds the state after each layer under id idx + 1: id num_hidden_layers is the "
                "last layer's output",
                (evidence(loc, "_maybe_add_hidden_state(aux_hidden_states, idx + 1, ...)"),),
            )
    if "aux_hidden_state_layers" in text:
        return Observation(
            "before_layer",
            "LlamaModel.forward collects hidden_states + residual before layer idx runs (id k = input of layer k): "
            "id num_hidden_layers, which launch_vllm.py appends, is never collected",
            (evidence(loc, "if idx in self.aux_hidden_state_layers"),),
        )
    return Observation.unknown("LlamaModel.forward collects aux hidden states in no known way", evidence(loc))


_KV_FIELDS = {
    **dict.fromkeys(NATIVE_LINES, ("kv_connector", "kv_role", "kv_connector_extra_config")),
    **dict.fromkeys(HSC, ("kv_connector", "kv_role", "kv_connector_extra_config", "kv_connector_module_path")),
}


@probe(
    "native.config.kv_transfer_fields",
    symbol="vllm.config.kv_transfer.KVTransferConfig",
    summary="KVTransferConfig takes the fields launch_vllm.py's --kv_transfer_config sets",
    expected={line: f"KVTransferConfig takes {', '.join(fields)}" for line, fields in _KV_FIELDS.items()},
)
def kv_transfer_fields(view: ApiView) -> Observation:
    found = first_found(view, ["vllm.config.kv_transfer.KVTransferConfig", "vllm.config.KVTransferConfig"])
    if found is None:
        return Observation("missing", "vllm.config has no KVTransferConfig")
    dotted, loc = found
    params = view.parameters(dotted)
    if params is None:
        return Observation.unknown(f"could not read the fields of {dotted}", evidence(loc))
    names = {p.name for p in params}
    per_line = {}
    for line, fields in _KV_FIELDS.items():
        lacking = [f for f in fields if f not in names]
        per_line[line] = f"lacks={','.join(lacking)}" if lacking else BASELINE
    return Observation(
        per_line[NATIVE_LINES[0]],
        f"{dotted} fields: {', '.join(sorted(n for n in names if n.startswith('kv_')))}",
        (evidence(loc),),
        per_line=per_line,
    )


@probe(
    "native.config.chunked_prefill_flag",
    symbol="vllm.config.scheduler.SchedulerConfig.enable_chunked_prefill",
    summary="`vllm serve --no-enable-chunked-prefill` (launch_vllm.py from 0.6) names a SchedulerConfig field",
    expected=dict.fromkeys(CHAT, "SchedulerConfig has enable_chunked_prefill"),
)
def chunked_prefill_flag(view: ApiView) -> Observation:
    found = first_found(view, ["vllm.config.scheduler.SchedulerConfig", "vllm.config.SchedulerConfig"])
    if found is None:
        return Observation.unknown("vllm.config has no SchedulerConfig")
    params = view.parameters(found[0])
    if params is None:
        return Observation.unknown("SchedulerConfig has no readable fields", evidence(found[1]))
    if any(p.name == "enable_chunked_prefill" for p in params):
        return Observation(BASELINE, "SchedulerConfig.enable_chunked_prefill exists", (evidence(found[1]),))
    return Observation(
        "missing",
        "SchedulerConfig has no enable_chunked_prefill: `vllm serve` rejects --no-enable-chunked-prefill",
        (evidence(found[1]),),
    )
