"""vllm.model_executor.models: what the worker extension's patched forward calls on a Llama model."""

from __future__ import annotations

from vllm_compat.probes._kit import LINES, V030, V040, evidence, parse_source

from vllm_compat.apiview import ApiView
from vllm_compat.findings import BASELINE, Observation, probe

LLAMA = "vllm.model_executor.models.llama"


@probe(
    "model.embedding_method",
    symbol=f"{LLAMA}.LlamaModel.embed_input_ids",
    summary="the base model's token-embedding method",
    expected={
        V030: "LlamaModel.get_input_embeddings(input_ids)",
        V040: "LlamaModel.embed_input_ids(input_ids)",
    },
    accepts={V030: {"get_input_embeddings", "both"}, V040: {"embed_input_ids", "both"}},
)
def embedding_method(view: ApiView) -> Observation:
    members = view.members(f"{LLAMA}.LlamaModel")
    if members is None:
        return Observation.unknown("LlamaModel is not readable")
    has_old, has_new = "get_input_embeddings" in members, "embed_input_ids" in members
    where = evidence(view.locate(f"{LLAMA}.LlamaModel"))
    if has_old and has_new:
        return Observation("both", "LlamaModel has get_input_embeddings and embed_input_ids", (where,))
    if has_new:
        return Observation(
            "embed_input_ids",
            "LlamaModel.get_input_embeddings was renamed embed_input_ids",
            (evidence(view.locate(f"{LLAMA}.LlamaModel.embed_input_ids")),),
        )
    if has_old:
        return Observation("get_input_embeddings", "LlamaModel has only get_input_embeddings", (where,))
    return Observation("missing", "LlamaModel has neither embedding method", (where,))


@probe(
    "model.forward_params",
    symbol=f"{LLAMA}.LlamaModel.forward",
    summary="the base model's forward takes (input_ids, positions, intermediate_tensors, inputs_embeds)",
    expected=dict.fromkeys(LINES, "forward(input_ids, positions, intermediate_tensors=None, inputs_embeds=None)"),
)
def forward_params(view: ApiView) -> Observation:
    params = view.parameters(f"{LLAMA}.LlamaModel.forward")
    if params is None:
        return Observation.unknown("LlamaModel.forward is not readable")
    names = [p.name for p in params if p.kind not in {"var_positional", "var_keyword"}]
    where = evidence(view.locate(f"{LLAMA}.LlamaModel.forward"))
    expected = ["input_ids", "positions", "intermediate_tensors", "inputs_embeds"]
    extra_required = [p.name for p in params if p.required and p.name not in expected]
    if names[:4] != expected or extra_required:
        return Observation("changed", f"forward({', '.join(names)})", (where,))
    return Observation(BASELINE, f"forward({', '.join(p.name for p in params)})", (where,))


@probe(
    "model.decoder_layer_call",
    symbol=f"{LLAMA}.LlamaDecoderLayer.forward",
    summary="layer(hidden_states=, positions=, residual=) returns (hidden_states, residual)",
    expected=dict.fromkeys(LINES, "layer(hidden_states=, positions=, residual=) -> (hidden_states, residual)"),
)
def decoder_layer_call(view: ApiView) -> Observation:
    dotted = f"{LLAMA}.LlamaDecoderLayer.forward"
    params = view.parameters(dotted)
    parsed = parse_source(view, dotted)
    if params is None or parsed is None:
        return Observation.unknown("LlamaDecoderLayer.forward is not readable")
    names = {p.name for p in params}
    required = {p.name for p in params if p.required}
    where = evidence(parsed[1])
    text = view.source(dotted).text  # type: ignore[union-attr]
    if not {"hidden_states", "positions", "residual"} <= names or required - {
        "hidden_states",
        "positions",
        "residual",
    }:
        return Observation("changed", f"forward({', '.join(p.name for p in params)})", (where,))
    if "return hidden_states, residual" not in text:
        return Observation("changed", "forward no longer returns (hidden_states, residual)", (where,))
    return Observation(BASELINE, "layer(positions, hidden_states, residual) -> (hidden_states, residual)", (where,))


@probe(
    "model.layer_attributes",
    symbol=f"{LLAMA}.LlamaModel.layers",
    summary="the base model keeps layers, start_layer, end_layer and a fused-residual final norm",
    expected=dict.fromkeys(LINES, "self.layers / start_layer / end_layer; norm(hidden, residual) -> (out, _)"),
)
def layer_attributes(view: ApiView) -> Observation:
    init = view.source(f"{LLAMA}.LlamaModel.__init__")
    forward = view.source(f"{LLAMA}.LlamaModel.forward")
    if init is None or forward is None:
        return Observation.unknown("LlamaModel is not readable")
    missing = [a for a in ("self.layers", "self.start_layer", "self.end_layer", "self.norm") if a not in init.text]
    if "self.norm(hidden_states, residual)" not in forward.text:
        missing.append("self.norm(hidden_states, residual)")
    where = evidence(view.locate(f"{LLAMA}.LlamaModel.__init__"))
    if missing:
        return Observation("changed", "not found: " + ", ".join(missing), (where,))
    return Observation(BASELINE, "layers, start_layer, end_layer, norm(hidden_states, residual)", (where,))


@probe(
    "model.eagle3_interface",
    symbol=f"{LLAMA}.LlamaForCausalLM",
    summary="Llama declares SupportsEagle3 (0.3.0 refuses models that do not)",
    expected={V030: "supports_eagle3(LlamaForCausalLM) is True"},
)
def eagle3_interface(view: ApiView) -> Observation:
    src = view.source(f"{LLAMA}.LlamaForCausalLM")
    if src is None:
        return Observation.unknown("LlamaForCausalLM is not readable")
    header = src.text.split(":", 1)[0]
    where = evidence(view.locate(f"{LLAMA}.LlamaForCausalLM"))
    if "SupportsEagle3" in header:
        return Observation(BASELINE, "LlamaForCausalLM subclasses SupportsEagle3", (where,))
    return Observation("missing", "LlamaForCausalLM does not declare SupportsEagle3", (where,))
