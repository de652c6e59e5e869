"""Model families: plan scoping, the generator guard per model, and the family adapters on stand-in models.

The stand-ins mimic what speculators' worker extension touches (no vLLM or torch needed): 0.3.0's setup takes
``model.model`` after ``supports_eagle3(model)``, 0.4.0.1's takes ``model.get_language_model().model`` for wrappers.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest
from packaging.version import Version
from vllm_compat.adapters.model_families import (
    BaseForwardExtraKwargs,
    BaseModelLookup,
    Eagle3InterfaceCheck,
    LayerExtraInputs,
)
from vllm_compat.adapters.worker import base_model_of
from vllm_compat.probes.model import FAMILIES, PROBES, families_for

import vllm_compat.adapter as adapter_module
import vllm_compat.engine as engine_module
import vllm_compat.findings as findings_module
from vllm_compat.errors import AdapterError, UnhandledDrift
from vllm_compat.findings import Observation, probe
from vllm_compat.lines import LineVerdict
from vllm_compat.models import ENV_FAMILIES, architectures_of, model_families
from vllm_compat.plan import DEFAULT_FAMILIES, make_plan

# -- stand-ins ------------------------------------------------------------------------------------------------


class Tensor:
    """Enough of a tensor for the adapters: ``any()``."""

    def __init__(self, nonzero: bool) -> None:
        self.nonzero = nonzero

    def any(self) -> bool:
        return self.nonzero


class Layer:
    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.use_sequence_parallel_moe = False

    def forward(self, positions=None, hidden_states=None, residual=None, llama_4_scaling=None):
        self.calls.append({"positions": positions, "llama_4_scaling": llama_4_scaling})
        return hidden_states, residual


class DecoderStack:
    def __init__(self, config: object = None) -> None:
        self.layers = [Layer(), Layer()]
        self.start_layer, self.end_layer = 0, 2
        self.norm = object()
        self.config = config or types.SimpleNamespace()

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return "vllm"


class CausalLM:
    def __init__(self, stack: DecoderStack) -> None:
        self.model = stack


def named(name: str, base: type = object, **attrs) -> type:
    return type(name, (base,), dict(attrs))


def wrapper_model(name: str, language_model: object) -> object:
    cls = named(name, get_language_model=lambda self: language_model)
    return cls()


def worker_module(line: str) -> types.ModuleType:
    """speculators' custom_worker as far as the adapters care, for one line."""
    module = types.ModuleType("fake_custom_worker")

    def _patched_forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kw):
        if line == "0.3.0" and kw:
            raise TypeError(f"_patched_forward() got an unexpected keyword argument {next(iter(kw))!r}")
        return ("speculators", input_ids)

    class HiddenStatesWorkerExtension:
        def __init__(self, model: object) -> None:
            self.model_runner = types.SimpleNamespace(model=model)

        def _setup_hidden_states_capture(self, layer_ids):
            model = self.model_runner.model
            if line == "0.3.0":
                if not module.supports_eagle3(model):
                    raise ValueError(f"Model {type(model).__name__} does not support hidden state extraction")
                base = model.model
            elif hasattr(model, "get_language_model"):
                base = model.get_language_model().model
            else:
                base = model.model
            base._extension = self
            base.forward = types.MethodType(module._patched_forward, base)

    module._patched_forward = _patched_forward
    module.HiddenStatesWorkerExtension = HiddenStatesWorkerExtension
    module.supports_eagle3 = lambda model: bool(getattr(model, "supports_eagle3", False))
    return module


@pytest.fixture
def applied():
    """``applied(AdapterClass, module)`` applies an adapter; every one is reverted afterwards."""
    done = []

    def apply(cls, module):
        adapter = cls()
        adapter.apply(module)
        done.append(adapter)
        return adapter

    yield apply
    for adapter in reversed(done):
        adapter.revert()


# -- the table ------------------------------------------------------------------------------------------------


def test_every_family_has_every_fact_once() -> None:
    facts = {fact for probes in PROBES.values() for fact in probes}
    assert {f.name for f in FAMILIES} == set(PROBES)
    for family, probes in PROBES.items():
        assert set(probes) == facts
        assert {p.family for p in probes.values()} == {family}
    llama = PROBES["llama"]  # the ids the Llama probes had before the table
    assert llama["embedding_method"].id == "model.embedding_method"
    assert PROBES["qwen3"]["embedding_method"].id == "model.qwen3.embedding_method"


def test_architectures_map_to_families(tmp_path: Path) -> None:
    assert families_for(["Qwen3ForCausalLM"]) == ("qwen3",)
    assert families_for(["DeepseekV3ForCausalLM"]) == ("deepseek_v3",)  # Kimi-K2 ships as DeepseekV3ForCausalLM
    assert families_for(["KimiK25ForConditionalGeneration"]) == ("kimi_k25",)
    assert families_for(["MistralForCausalLM"]) == ()
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GptOssForCausalLM"]}))
    assert architectures_of(tmp_path) == ["GptOssForCausalLM"]
    assert model_families(tmp_path) == ("gpt_oss",)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"]}))
    assert model_families(tmp_path) is None  # not a family vllm-compat probes: the default applies
    assert model_families(tmp_path / "nowhere") is None


# -- plan scoping ---------------------------------------------------------------------------------------------


class EmptyView:
    kind = "static"

    def version(self):
        return "9.9.9"

    def has_module(self, module):
        return False

    def locate(self, dotted):
        return None

    def parameters(self, dotted):
        return None

    def source(self, dotted):
        return None

    def members(self, dotted):
        return None


def test_plan_judges_the_default_family_unless_asked() -> None:
    view = EmptyView()
    family_of = {p.id: p.family for probes in PROBES.values() for p in probes.values()}

    def families_in(plan):
        return {family_of[f.probe] for f in plan.findings if f.probe in family_of}

    assert DEFAULT_FAMILIES == ("llama",)
    assert families_in(make_plan(view, ["0.4.0.1"])) == {"llama"}
    assert families_in(make_plan(view, ["0.4.0.1"], families=["qwen3"])) == {"qwen3"}
    assert families_in(make_plan(view, ["0.4.0.1"], families="all")) == {f.name for f in FAMILIES}
    qwen3 = PROBES["qwen3"]["layer_path"].id
    assert [f.probe for f in make_plan(view, ["0.4.0.1"], probe_ids=[qwen3]).findings] == [qwen3]
    with pytest.raises(ValueError, match="unknown model families"):
        make_plan(view, ["0.4.0.1"], families=["nonesuch"])
    # with no vLLM to read, a family's facts are unknown, not drift
    states = {f.state.value for f in make_plan(view, ["0.4.0.1"], families="all").findings if f.probe in family_of}
    assert states == {"unknown"}


# -- the generator guard judges the model's family ------------------------------------------------------------


@pytest.fixture
def guarded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An engine whose registries hold a Llama fact (baseline) and a Kimi-K2.5 fact (drift no adapter covers)."""
    monkeypatch.setattr(adapter_module, "_REGISTRY", {})
    monkeypatch.setattr(findings_module, "_REGISTRY", {})
    for module in (adapter_module, engine_module):
        monkeypatch.setattr(module, "load_adapters", lambda: adapter_module._REGISTRY)
    monkeypatch.setattr("vllm_compat.plan.load_adapters", lambda: adapter_module._REGISTRY)
    monkeypatch.setattr("vllm_compat.plan.load_probes", lambda: findings_module._REGISTRY)
    monkeypatch.setattr(engine_module, "load_probes", lambda: findings_module._REGISTRY)
    fresh = engine_module._Engine()
    monkeypatch.setattr(engine_module, "engine", fresh)
    monkeypatch.setattr(
        engine_module, "installed_version", lambda name: Version("0.4.0.1") if name == "speculators" else None
    )
    monkeypatch.setattr(engine_module, "judge_line", lambda: LineVerdict("0.4.0.1", "metadata", "0.4.0.1"))
    monkeypatch.setenv("VLLM_COMPAT_ACTIVE", "")
    monkeypatch.delenv(ENV_FAMILIES, raising=False)

    @probe("model.t_llama", symbol="x.Llama", summary="a Llama fact", expected={"0.4.0.1": "it"}, family="llama")
    def llama_fact(view) -> Observation:
        return Observation("baseline", "fine")

    @probe("model.t_kimi", symbol="x.Kimi", summary="a Kimi fact", expected={"0.4.0.1": "it"}, family="kimi_k25")
    def kimi_fact(view) -> Observation:
        return Observation("missing", "KimiK25ForConditionalGeneration is not in this vLLM")

    built: list[str] = []

    class VllmHiddenStatesGenerator:
        families_seen: list[str | None] = []  # what the workers it would start inherit

        def __init__(self, model_path: str, layer_ids=None) -> None:
            built.append(model_path)
            self.families_seen.append(os.environ.get(ENV_FAMILIES))

    fake = types.ModuleType(engine_module.GUARD_MODULE)
    fake.VllmHiddenStatesGenerator = VllmHiddenStatesGenerator
    monkeypatch.setitem(sys.modules, engine_module.GUARD_MODULE, fake)

    def model(architecture: str) -> str:
        folder = tmp_path / architecture
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"architectures": [architecture]}))
        return str(folder)

    fresh.install()
    yield fresh, fake.VllmHiddenStatesGenerator, model, built
    fresh.uninstall()


def test_guard_stops_a_model_whose_family_drifted(guarded) -> None:
    _, generator, model, built = guarded
    kimi = model("KimiK25ForConditionalGeneration")
    with pytest.raises(UnhandledDrift, match=r"model\.t_kimi") as caught:
        generator(kimi)
    assert "model.t_llama" not in str(caught.value)
    assert built == []
    assert ENV_FAMILIES not in os.environ  # set only while the constructor runs


def test_guard_lets_other_families_through(guarded) -> None:
    _, generator, model, built = guarded
    llama = model("LlamaForCausalLM")
    generator(llama)
    generator(model_path=model("MistralForCausalLM"))  # no family of its own: judged as the default (Llama)
    assert built == [llama, built[1]]
    assert generator.families_seen == ["llama", None]  # what the workers judge; unset again afterwards
    assert ENV_FAMILIES not in os.environ


def test_workers_judge_only_the_loaded_family(guarded, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, *_ = guarded
    monkeypatch.setenv(ENV_FAMILIES, "llama")
    assert engine._finding("model.t_kimi", "0.4.0.1") is None
    assert engine._finding("model.t_llama", "0.4.0.1") is not None
    monkeypatch.delenv(ENV_FAMILIES)
    assert engine._finding("model.t_kimi", "0.4.0.1").variant == "missing"


# -- adapters -------------------------------------------------------------------------------------------------


def test_base_model_of_finds_the_stack() -> None:
    stack = DecoderStack()
    assert base_model_of(CausalLM(stack)) is stack
    assert base_model_of(wrapper_model("Qwen3VLForConditionalGeneration", CausalLM(stack))) is stack
    assert base_model_of(wrapper_model("KimiK25ForConditionalGeneration", stack)) is stack  # vLLM 0.15.0


def test_base_model_lookup_for_030_on_a_wrapper(applied) -> None:
    module = worker_module("0.3.0")
    stack = DecoderStack()
    model = wrapper_model("Qwen3VLForConditionalGeneration", CausalLM(stack))
    model.supports_eagle3 = True
    with pytest.raises(AttributeError):
        module.HiddenStatesWorkerExtension(model)._setup_hidden_states_capture([0])
    applied(BaseModelLookup, module)
    ext = module.HiddenStatesWorkerExtension(model)
    ext._setup_hidden_states_capture([0])
    assert stack._extension is ext
    assert stack.forward(1, 2) == ("speculators", 1)
    assert "model" not in vars(model)  # the stand-in attribute is gone again


def test_base_model_lookup_when_the_language_model_is_the_stack(applied) -> None:
    module = worker_module("0.4.0.1")
    stack = DecoderStack()
    model = wrapper_model("KimiK25ForConditionalGeneration", stack)
    with pytest.raises(AttributeError):
        module.HiddenStatesWorkerExtension(model)._setup_hidden_states_capture([0])
    applied(BaseModelLookup, module)
    module.HiddenStatesWorkerExtension(model)._setup_hidden_states_capture([0])
    assert stack.forward(1, 2) == ("speculators", 1)
    assert "model" not in vars(stack)


def test_base_model_lookup_leaves_text_models_alone(applied) -> None:
    module = worker_module("0.3.0")
    stack = DecoderStack()
    model = named("LlamaForCausalLM", CausalLM, supports_eagle3=True)(stack)
    applied(BaseModelLookup, module)
    module.HiddenStatesWorkerExtension(model)._setup_hidden_states_capture([0])
    assert stack.forward(1, 2) == ("speculators", 1)


def test_eagle3_check_accepts_known_families_with_a_stack(applied) -> None:
    module = worker_module("0.3.0")
    applied(Eagle3InterfaceCheck, module)
    assert module.supports_eagle3(named("DeepseekV3ForCausalLM", CausalLM)(DecoderStack()))
    assert not module.supports_eagle3(named("SomeOtherForCausalLM", CausalLM)(DecoderStack()))
    assert module.supports_eagle3(named("SomeOtherForCausalLM", CausalLM, supports_eagle3=True)(DecoderStack()))
    broken = named("DeepseekV3ForCausalLM", CausalLM)(types.SimpleNamespace(layers=[]))
    with pytest.raises(AdapterError, match="start_layer"):
        module.supports_eagle3(broken)


def test_deepstack_embeddings_are_taken_and_checked(applied) -> None:
    module = worker_module("0.3.0")
    stack = DecoderStack()
    model = wrapper_model("Qwen3VLForConditionalGeneration", CausalLM(stack))
    model.supports_eagle3 = True
    applied(BaseModelLookup, module)
    applied(BaseForwardExtraKwargs, module)
    module.HiddenStatesWorkerExtension(model)._setup_hidden_states_capture([0])
    assert stack.forward(1, 2, deepstack_input_embeds=None) == ("speculators", 1)
    zeros = types.SimpleNamespace(tensors={"deepstack_input_embeds_0": Tensor(False)})
    assert stack.forward(1, 2, None, None, deepstack_input_embeds=zeros) == ("speculators", 1)
    with pytest.raises(AdapterError, match="visual features"):
        stack.forward(1, 2, deepstack_input_embeds={"deepstack_input_embeds_0": Tensor(True)})
    with pytest.raises(AdapterError, match="something_else"):
        stack.forward(1, 2, something_else=None)


def test_llama_4_scaling_is_passed_when_the_config_sets_it(applied, monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_module = types.ModuleType("fake_deepseek_v2")
    vllm_module._get_llama_4_scaling = lambda original_max_position_embeddings, scaling_beta, positions: (
        "scale",
        original_max_position_embeddings,
        scaling_beta,
        positions,
    )
    monkeypatch.setitem(sys.modules, "fake_deepseek_v2", vllm_module)
    stack_cls = named("DeepseekV2Model", DecoderStack)
    stack_cls.__module__ = "fake_deepseek_v2"
    config = types.SimpleNamespace(llama_4_scaling={"original_max_position_embeddings": 8192, "beta": 0.1})
    stack = stack_cls(config)
    module = worker_module("0.4.0.1")
    applied(LayerExtraInputs, module)
    module.HiddenStatesWorkerExtension(named("DeepseekV3ForCausalLM", CausalLM)(stack))._setup_hidden_states_capture(
        [0]
    )
    stack.layers[0].forward(hidden_states="h", positions="p", residual=None)
    assert stack.layers[0].calls[-1]["llama_4_scaling"] == ("scale", 8192, 0.1, "p")

    plain = DecoderStack()  # DeepSeek-V3 and Kimi configs set no llama_4_scaling: the layers stay as they are
    module.HiddenStatesWorkerExtension(named("DeepseekV3ForCausalLM", CausalLM)(plain))._setup_hidden_states_capture(
        [0]
    )
    assert "forward" not in vars(plain.layers[0])

    parallel = DecoderStack()
    parallel.layers[1].use_sequence_parallel_moe = True
    with pytest.raises(AdapterError, match="sequence-parallel"):
        module.HiddenStatesWorkerExtension(CausalLM(parallel))._setup_hidden_states_capture([0])
