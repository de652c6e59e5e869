"""Worker-side adapters for model families whose conventions differ from the Llama decoder speculators assumes.

The facts come from probes/model.py (one probe per fact and family). Every adapter here is applied in vLLM's worker
processes when a family's probe finds the drift it covers, and then acts on the loaded model only where that model
needs it: a Llama model goes through untouched. Anything it does not recognise raises AdapterError.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import WORKER_MODULE
from vllm_compat.adapters.worker import base_model_of
from vllm_compat.probes.model import FAMILIES

from vllm_compat.adapter import Adapter
from vllm_compat.errors import AdapterError

_SETUP = "HiddenStatesWorkerExtension._setup_hidden_states_capture"
_WRAPPERS = [f for f in FAMILIES if len(f.hops) > 1]  # multimodal wrappers around a language model
_TOP_CLASSES = frozenset(name for f in FAMILIES for name in (f.short(f.top), *f.architectures))
_LLAMA_4_SCALING = {"extra=llama_4_scaling", "extra=llama_4_scaling;sequence_parallel_gather"}


def _family_covers(fact: str, variants: set[str], families: Any = FAMILIES) -> dict[str, set[str]]:
    return {f"{fam.prefix}.{fact}": set(variants) for fam in families}


@contextlib.contextmanager
def _temporarily(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` reads ``value`` inside the block: an instance attribute, set past ``nn.Module.__setattr__`` (so
    it registers no submodule) and removed afterwards."""
    if getattr(owner, name, None) is value:
        yield
        return
    if isinstance(getattr(type(owner), name, None), property):
        raise AdapterError(f"{type(owner).__name__}.{name} is a property; cannot point it at the decoder stack")
    saved = owner.__dict__.get(name, _UNSET)
    object.__setattr__(owner, name, value)
    try:
        yield
    finally:
        if saved is _UNSET:
            owner.__dict__.pop(name, None)
        else:
            object.__setattr__(owner, name, saved)


_UNSET = object()


def _decoder_stack(model: Any) -> Any:
    """The module holding the decoder layers, checked for what speculators' patched forward uses."""
    base = base_model_of(model)
    missing = [a for a in ("layers", "start_layer", "end_layer", "norm") if not hasattr(base, a)]
    if missing:
        raise AdapterError(f"{type(model).__name__}: the decoder stack {type(base).__name__} has no {missing}")
    return base


class BaseModelLookup(Adapter):
    """Point speculators at the decoder stack of a multimodal wrapper.

    What broke: speculators 0.3.0 takes the decoder stack as ``model.model``, which a multimodal wrapper such as
    Qwen3-VL (``Qwen3VLForConditionalGeneration``, every vLLM from 0.11.0) or Kimi-K2.5
    (``KimiK25ForConditionalGeneration``, vLLM 0.15.0+) does not have: its language model is
    ``model.get_language_model()``, whose ``.model`` holds the layers (AttributeError at setup). In vLLM 0.15.0,
    Kimi-K2.5's language model *is* the decoder stack (``DeepseekV2Model``, no ``.model``), which breaks 0.4.0.1's
    ``model.get_language_model().model`` too.
    Where fixed: the worker extension's setup. While speculators' setup runs, the name it reads (``model.model``, and
    ``get_language_model().model``) answers the decoder stack; the instance attributes are removed afterwards, so
    the model is left as vLLM built it (plus speculators' own forward on the decoder stack).
    """

    id = "base-model-lookup"
    covers = _family_covers("layer_path", {"language_model", "language_model_is_base"}, _WRAPPERS)
    target = WORKER_MODULE
    side = "worker"
    first_vllm = "0.11.0 (Qwen3-VL), 0.15.0 (Kimi-K2.5)"

    def apply(self, module: ModuleType) -> None:
        def setup(wrapped: Any, ext: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            model = ext.model_runner.model
            if not hasattr(model, "get_language_model"):
                return wrapped(*args, **kwargs)  # a text model: model.model is the decoder stack already
            base = _decoder_stack(model)
            language_model = model.get_language_model()
            with _temporarily(model, "model", base), _temporarily(language_model, "model", base):
                return wrapped(*args, **kwargs)

        self.wrap(module, _SETUP, setup)


class Eagle3InterfaceCheck(Adapter):
    """Let speculators 0.3.0 accept a known family that has the decoder stack but does not declare SupportsEagle3.

    What broke: 0.3.0's setup refuses any model for which ``supports_eagle3(model)`` is False, although it uses
    nothing of that interface: it needs the decoder stack only. DeepSeek-V3 (``DeepseekV3ForCausalLM``) and
    Kimi-K2.5 declare SupportsEagle3 only from vLLM 0.18.0, Qwen3-VL from 0.12.0.
    Where fixed: ``supports_eagle3`` as speculators' worker module binds it: it answers True for a model whose class
    is one of the families vllm-compat probes (probes/model.py) and whose decoder stack has layers, start_layer,
    end_layer and norm; anything else gets vLLM's answer.
    """

    id = "eagle3-interface-check"
    covers = _family_covers("eagle3_interface", {"undeclared"})
    speculators = "==0.3.*"
    target = WORKER_MODULE
    side = "worker"
    first_vllm = "0.11.0 (DeepSeek-V3, Qwen3-VL)"
    remove_when = "speculators 0.3.x is no longer served"

    def apply(self, module: ModuleType) -> None:
        declared = module.supports_eagle3

        def supports_eagle3(model: Any) -> bool:
            if declared(model):
                return True
            if type(model).__name__ not in _TOP_CLASSES:
                return False
            _decoder_stack(model)  # raises if the stack is not what speculators' forward needs
            return True

        self.set_attr(module, "supports_eagle3", supports_eagle3)


def _all_zero(value: Any) -> bool:
    tensors = getattr(value, "tensors", value)  # IntermediateTensors, a dict, or a tensor
    items = tensors.values() if isinstance(tensors, Mapping) else [tensors]
    return all(not bool(t.any()) for t in items)


class BaseForwardExtraKwargs(Adapter):
    """Take the deepstack embeddings Qwen3-VL passes to its language model, which 0.3.0's forward does not accept.

    What broke: Qwen3-VL's wrapper calls its decoder stack with ``deepstack_input_embeds=`` (every vLLM from 0.11.0);
    speculators 0.3.0's replacement forward takes (input_ids, positions, intermediate_tensors, inputs_embeds) only:
    TypeError on the first batch. (0.4.0.1 takes ``**_kwargs`` and drops them.)
    Where fixed: the replacement forward, right after speculators' setup put it on the decoder stack: it takes the
    deepstack embeddings and drops them when they are None or zero, which they are for the text-only prompts the
    generator sends (vLLM fills them from images only); otherwise it raises AdapterError instead of returning states
    that leave out the visual features.
    """

    id = "base-forward-extra-kwargs"
    covers = {"model.qwen3_vl.forward_params": {"extra=deepstack_input_embeds"}}
    speculators = "==0.3.*"
    target = WORKER_MODULE
    side = "worker"
    first_vllm = "0.11.0 (Qwen3-VL)"
    remove_when = "speculators 0.3.x is no longer served"

    def apply(self, module: ModuleType) -> None:
        def setup(wrapped: Any, ext: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = wrapped(*args, **kwargs)
            base = base_model_of(ext.model_runner.model)
            patched = base.forward

            def forward(input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **extra):
                for name, value in extra.items():
                    if name != "deepstack_input_embeds":
                        raise AdapterError(f"base-forward-extra-kwargs: the decoder stack was called with {name}=")
                    if value is not None and not _all_zero(value):
                        raise AdapterError(
                            "base-forward-extra-kwargs: deepstack_input_embeds carry visual features; speculators "
                            "0.3.0's forward cannot apply them"
                        )
                return patched(input_ids, positions, intermediate_tensors, inputs_embeds)

            base.forward = forward
            return result

        self.wrap(module, _SETUP, setup)


class LayerExtraInputs(Adapter):
    """Give DeepSeek's decoder layers what vLLM's own loop gives them and speculators' loop does not.

    What broke: from vLLM 0.12.0, ``DeepseekV2Model.forward`` passes each layer a fourth argument,
    ``llama_4_scaling`` (a per-position attention scale computed from ``config.llama_4_scaling``; None for
    DeepSeek-V3 and Kimi configs, which do not set it); from 0.25.0 its loop also all-gathers the residual stream
    when sequence-parallel MoE is on. speculators' loop (both lines) calls ``layer(hidden_states=, positions=,
    residual=)`` only: for a config with ``llama_4_scaling`` the attention would silently lose its scale.
    Where fixed: the decoder stack after speculators' setup. If the config sets ``llama_4_scaling``, each layer gets
    the value vLLM's forward computes (its module's ``_get_llama_4_scaling`` of the positions); sequence-parallel MoE
    (expert parallelism with data_parallel_size > 1, never set by the generator) raises AdapterError.
    """

    id = "layer-extra-inputs"
    covers = _family_covers("layer_inputs", _LLAMA_4_SCALING, [f for f in FAMILIES if "deepseek" in f.layer])
    target = WORKER_MODULE
    side = "worker"
    first_vllm = "0.12.0 (DeepSeek-V3, Kimi-K2.5)"

    def apply(self, module: ModuleType) -> None:
        def setup(wrapped: Any, ext: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = wrapped(*args, **kwargs)
            base = base_model_of(ext.model_runner.model)
            layers = list(base.layers)[base.start_layer : base.end_layer]
            if any(getattr(layer, "use_sequence_parallel_moe", False) for layer in layers):
                raise AdapterError(
                    "layer-extra-inputs: sequence-parallel MoE is on; speculators' loop does not gather the "
                    "residual stream between layers"
                )
            scaling = getattr(getattr(base, "config", None), "llama_4_scaling", None)
            if scaling is not None:
                _pass_llama_4_scaling(base, layers, scaling)
            return result

        self.wrap(module, _SETUP, setup)


def _pass_llama_4_scaling(base: Any, layers: list[Any], scaling: Mapping[str, Any]) -> None:
    compute = getattr(sys.modules.get(type(base).__module__), "_get_llama_4_scaling", None)
    if compute is None:
        raise AdapterError(f"layer-extra-inputs: {type(base).__module__} has no _get_llama_4_scaling")

    def with_scaling(forward: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if len(args) < 4 and kwargs.get("llama_4_scaling") is None:
                positions = kwargs["positions"] if "positions" in kwargs else args[0]
                kwargs["llama_4_scaling"] = compute(
                    original_max_position_embeddings=scaling["original_max_position_embeddings"],
                    scaling_beta=scaling["beta"],
                    positions=positions,
                )
            return forward(*args, **kwargs)

        return call

    for layer in layers:
        layer.forward = with_scaling(layer.forward)
