"""The model-family probes (probes/model.py) against real vLLM wheels, for every family.

For each release below, ``make_plan(StaticView(wheel), ["0.3.0", "0.4.0.1"], families="all")`` must report exactly
the (probe, speculators line, variant) triples of ``EXPECTED_FAMILY_DRIFT`` as not baseline among the family
probes, and no ``unknown``. Comments cite the release's source (paths inside the wheel; check with
``unzip -p WHEEL vllm/model_executor/models/x.py | sed -n 'A,Bp'``). ``EXPECTED_UNHANDLED`` then says, per family,
what a plan judging that family alone leaves uncovered: what ``UnhandledDrift`` names at the generator's
constructor for a model of that family. Wheels come from ``fetch_release`` (cached in ``$VLLM_COMPAT_CACHE``).
"""

from __future__ import annotations

import pytest
from vllm_compat.probes.model import FAMILIES, PROBES

from tests.drift import by_version, plan_getter
from vllm_compat.apiview.static import StaticView
from vllm_compat.errors import SourceError
from vllm_compat.findings import State
from vllm_compat.plan import Plan, make_plan
from vllm_compat.sources import fetch_release

pytestmark = pytest.mark.wheels

V030, V040 = "0.3.0", "0.4.0.1"
LINES = (V030, V040)
Drift = tuple[str, str, str]  # (probe id, speculators line, variant)
PREFIX = {f.name: f.prefix for f in FAMILIES}


def both(probe: str, variant: str) -> tuple[Drift, Drift]:
    return (probe, V030, variant), (probe, V040, variant)


def renamed_embedding(line: str, *families: str) -> set[Drift]:
    """``get_input_embeddings`` -> ``embed_input_ids`` (vLLM 0.11.1): drift for 0.3.0 after, for 0.4.0.1 before."""
    variant = "get_input_embeddings" if line == V040 else "embed_input_ids"
    return {(f"{PREFIX[f]}.embedding_method", line, variant) for f in families}


def absent(family: str) -> set[Drift]:
    """Every fact of a family this vLLM does not have, for each line it applies to."""
    return {(p.id, line, "missing") for p in PROBES[family].values() for line in LINES if p.applies_to(line)}


_TEXT = ("llama", "qwen3", "deepseek_v3", "gpt_oss")
_DS_SCALING = "extra=llama_4_scaling"
_DS_SCALING_SP = "extra=llama_4_scaling;sequence_parallel_gather"

EXPECTED_FAMILY_DRIFT: dict[str, set[Drift]] = {
    "0.11.0": {
        # vllm/model_executor/models/llama.py:378, qwen2.py (Qwen3Model's base), deepseek_v2.py:1149, qwen3_vl.py
        # (Qwen3LLMModel via Qwen3Model), gpt_oss.py:257: get_input_embeddings, no embed_input_ids yet
        *renamed_embedding(V040, *_TEXT, "qwen3_vl"),
        # vllm/model_executor/models/deepseek_v2.py:1183 DeepseekV2ForCausalLM(nn.Module, SupportsPP,
        # MixtureOfExperts, SupportsLoRA); :1429 DeepseekV3ForCausalLM(DeepseekV2ForCausalLM): no SupportsEagle3
        ("model.deepseek_v3.eagle3_interface", V030, "undeclared"),
        # vllm/model_executor/models/qwen3_vl.py:1087 Qwen3VLForConditionalGeneration(nn.Module, SupportsMultiModal,
        # SupportsLoRA, SupportsPP): no SupportsEagle3; :1141 self.language_model = Qwen3LLMForCausalLM(...),
        # :1358 get_language_model(); no .model on the wrapper
        ("model.qwen3_vl.eagle3_interface", V030, "undeclared"),
        ("model.qwen3_vl.layer_path", V030, "language_model"),
        # vllm/model_executor/models/qwen3_vl.py:1010-1017 Qwen3LLMModel.forward(..., deepstack_input_embeds=None),
        # passed by the wrapper at :1582
        ("model.qwen3_vl.forward_params", V030, "extra=deepstack_input_embeds"),
        # no vllm/model_executor/models/kimi_k25.py before 0.15.0
        *absent("kimi_k25"),
    },
    "0.15.0": {
        *renamed_embedding(V030, *_TEXT, "qwen3_vl", "kimi_k25"),  # e.g. vllm/model_executor/models/llama.py:398
        # vllm/model_executor/models/deepseek_v2.py:1119-1121 layer(positions, hidden_states, residual,
        # llama_4_scaling), computed at :1105-1116 from config.llama_4_scaling
        *both("model.deepseek_v3.layer_inputs", _DS_SCALING),
        *both("model.kimi_k25.layer_inputs", _DS_SCALING),
        # vllm/model_executor/models/deepseek_v2.py:1173-1175 (..., SupportsLoRA, SupportsEagle), :1498
        ("model.deepseek_v3.eagle3_interface", V030, "undeclared"),
        ("model.qwen3_vl.layer_path", V030, "language_model"),
        ("model.qwen3_vl.forward_params", V030, "extra=deepstack_input_embeds"),  # qwen3_vl.py:1120-1128
        # vllm/model_executor/models/kimi_k25.py:286 KimiK25ForConditionalGeneration(nn.Module, SupportsMultiModal,
        # SupportsPP); :347 self.language_model = DeepseekV2Model(...), :423-424 get_language_model() returns it:
        # the decoder stack itself, no .model (0.4.0.1's model.get_language_model().model fails too)
        *both("model.kimi_k25.layer_path", "language_model_is_base"),
        ("model.kimi_k25.eagle3_interface", V030, "undeclared"),
    },
    "0.16.0": {
        *renamed_embedding(V030, *_TEXT, "qwen3_vl", "kimi_k25"),  # vllm/model_executor/models/llama.py:398
        *both("model.deepseek_v3.layer_inputs", _DS_SCALING),  # vllm/model_executor/models/deepseek_v2.py:1119-1121
        *both("model.kimi_k25.layer_inputs", _DS_SCALING),
        # vllm/model_executor/models/deepseek_v2.py:1173-1175 (nn.Module, SupportsPP, DeepseekV2MixtureOfExperts,
        # SupportsLoRA, SupportsEagle): SupportsEagle, not SupportsEagle3
        ("model.deepseek_v3.eagle3_interface", V030, "undeclared"),
        ("model.qwen3_vl.layer_path", V030, "language_model"),  # vllm/model_executor/models/qwen3_vl.py:1300
        ("model.qwen3_vl.forward_params", V030, "extra=deepstack_input_embeds"),  # qwen3_vl.py:1126-1133
        # vllm/model_executor/models/kimi_k25.py:384-390 self.language_model = init_vllm_registered_model(...,
        # architectures=["DeepseekV2ForCausalLM"]); :309-311 no SupportsEagle3
        ("model.kimi_k25.layer_path", V030, "language_model"),
        ("model.kimi_k25.eagle3_interface", V030, "undeclared"),
    },
    "0.18.0": {
        # DeepSeek and Kimi-K2.5 declare SupportsEagle3 from here on
        *renamed_embedding(V030, *_TEXT, "qwen3_vl", "kimi_k25"),
        *both("model.deepseek_v3.layer_inputs", _DS_SCALING),  # vllm/model_executor/models/deepseek_v2.py:1241
        *both("model.kimi_k25.layer_inputs", _DS_SCALING),
        ("model.qwen3_vl.layer_path", V030, "language_model"),
        ("model.qwen3_vl.forward_params", V030, "extra=deepstack_input_embeds"),  # qwen3_vl.py:1258
        ("model.kimi_k25.layer_path", V030, "language_model"),
    },
    "0.22.0": {
        *renamed_embedding(V030, *_TEXT, "qwen3_vl", "kimi_k25"),  # vllm/model_executor/models/llama.py:392
        # vllm/model_executor/models/deepseek_v2.py:1315-1317 layer(positions, hidden_states, residual,
        # llama_4_scaling); :1590-1597 DeepseekV2ForCausalLM(..., SupportsEagle, SupportsEagle3)
        *both("model.deepseek_v3.layer_inputs", _DS_SCALING),
        *both("model.kimi_k25.layer_inputs", _DS_SCALING),
        # vllm/model_executor/models/qwen3_vl.py:1693 self.language_model = Qwen3LLMForCausalLM(...)
        ("model.qwen3_vl.layer_path", V030, "language_model"),
        ("model.qwen3_vl.forward_params", V030, "extra=deepstack_input_embeds"),  # qwen3_vl.py:1512
        # vllm/model_executor/models/kimi_k25.py:279-286 (..., SupportsEagle, SupportsEagle3); :361
        ("model.kimi_k25.layer_path", V030, "language_model"),
    },
    "0.25.0": {
        *renamed_embedding(V030, *_TEXT, "qwen3_vl", "kimi_k25"),
        # vllm/model_executor/models/deepseek_v2.py:1450-1461 all-gathers hidden_states/residual (sequence-parallel
        # MoE) before each layer, :1470-1472 layer(positions, hidden_states, residual, llama_4_scaling)
        *both("model.deepseek_v3.layer_inputs", _DS_SCALING_SP),
        *both("model.kimi_k25.layer_inputs", _DS_SCALING_SP),
        ("model.qwen3_vl.layer_path", V030, "language_model"),
        ("model.qwen3_vl.forward_params", V030, "extra=deepstack_input_embeds"),
        ("model.kimi_k25.layer_path", V030, "language_model"),
    },
    "0.32.0": {
        *renamed_embedding(V030, *_TEXT, "qwen3_vl", "kimi_k25"),  # vllm/model_executor/models/llama.py:403
        # vllm/model_executor/models/deepseek_v2.py:1552-1561 the sequence-parallel all-gather,
        # :1569-1571 layer(positions, hidden_states, residual, llama_4_scaling)
        *both("model.deepseek_v3.layer_inputs", _DS_SCALING_SP),
        *both("model.kimi_k25.layer_inputs", _DS_SCALING_SP),
        ("model.qwen3_vl.layer_path", V030, "language_model"),  # vllm/model_executor/models/qwen3_vl.py:2043
        # vllm/model_executor/models/qwen3_vl.py:1849 Qwen3LLMModel.forward(..., deepstack_input_embeds=None),
        # passed at :3213
        ("model.qwen3_vl.forward_params", V030, "extra=deepstack_input_embeds"),
        ("model.kimi_k25.layer_path", V030, "language_model"),  # vllm/model_executor/models/kimi_k25.py:376-381
    },
    "0.33.0": {
        *renamed_embedding(V030, *_TEXT, "qwen3_vl", "kimi_k25"),
        *both("model.deepseek_v3.layer_inputs", _DS_SCALING_SP),  # vllm/model_executor/models/deepseek_v2.py:1569
        *both("model.kimi_k25.layer_inputs", _DS_SCALING_SP),
        ("model.qwen3_vl.layer_path", V030, "language_model"),
        ("model.qwen3_vl.forward_params", V030, "extra=deepstack_input_embeds"),  # qwen3_vl.py:1849
        ("model.kimi_k25.layer_path", V030, "language_model"),
    },
}

# release -> family -> (line, probe) left unhandled when that family is judged (what UnhandledDrift names). Every
# family and release not listed here is fully covered.
EXPECTED_UNHANDLED: dict[str, dict[str, set[tuple[str, str]]]] = {
    "0.11.0": {"kimi_k25": {(line, probe) for probe, line, _ in absent("kimi_k25")}},
}

# (release, probe, line) -> text the evidence must contain.
EXPECTED_EVIDENCE: dict[tuple[str, str, str], str] = {
    ("0.11.0", "model.deepseek_v3.eagle3_interface", V030): "vllm/model_executor/models/deepseek_v2.py:1429",
    ("0.15.0", "model.kimi_k25.layer_path", V040): "vllm/model_executor/models/kimi_k25.py:",
    ("0.16.0", "model.deepseek_v3.layer_inputs", V040): "vllm/model_executor/models/deepseek_v2.py:1119",
    ("0.32.0", "model.deepseek_v3.layer_inputs", V030): "vllm/model_executor/models/deepseek_v2.py:1569",
    ("0.32.0", "model.gpt_oss.final_norm", V040): "vllm/model_executor/models/gpt_oss.py:536",
    ("0.32.0", "model.gpt_oss.layer_inputs", V040): "vllm/model_executor/models/gpt_oss.py:532",
    ("0.32.0", "model.qwen3_vl.forward_params", V030): "vllm/model_executor/models/qwen3_vl.py:1849",
}

# release -> baseline facts close to a drift (variant included).
EXPECTED_BASELINE: dict[str, set[Drift]] = {
    "0.11.0": {
        # gpt-oss's TransformerBlock.forward(hidden_states, positions, residual) -> (output, residual)
        # (vllm/model_executor/models/gpt_oss.py:205-223): another order, same keywords, same tuple
        *both("model.gpt_oss.decoder_layer_call", "baseline"),
        ("model.gpt_oss.eagle3_interface", V030, "baseline"),  # vllm/model_executor/models/gpt_oss.py:635
        ("model.qwen3_vl.layer_path", V040, "language_model"),  # 0.4.0.1 looks through get_language_model()
        ("model.qwen3_vl.forward_params", V040, "extra=deepstack_input_embeds"),  # 0.4.0.1 takes **_kwargs
        *both("model.deepseek_v3.layer_inputs", "baseline"),  # deepseek_v2.py:1171 layer(positions, hidden, residual)
    },
    "0.16.0": {
        # DeepseekV2DecoderLayer.forward(positions, hidden_states, residual, llama_4_scaling=None)
        # (vllm/model_executor/models/deepseek_v2.py:983-989): speculators' keyword call still fits
        *both("model.deepseek_v3.decoder_layer_call", "baseline"),
        ("model.kimi_k25.layer_path", V040, "language_model"),
    },
    "0.32.0": {
        *both(
            "model.gpt_oss.final_norm", "baseline"
        ),  # vllm/model_executor/models/gpt_oss.py:536 x, _ = self.norm(x, residual)
        *both("model.qwen3.forward_params", "baseline"),  # vllm/model_executor/models/qwen2.py:402-408 (Qwen2Model)
        ("model.deepseek_v3.eagle3_interface", V030, "baseline"),  # vllm/model_executor/models/deepseek_v2.py:1872
    },
}

RELEASES = by_version(EXPECTED_FAMILY_DRIFT)


@pytest.fixture(scope="module")
def plan_for():
    """release -> its Plan, computed once per module run."""
    return plan_getter(LINES, families="all")


def _family_findings(plan: Plan):
    ids = {p.id for probes in PROBES.values() for p in probes.values()}
    return [f for f in plan.findings if f.probe in ids]


@pytest.mark.parametrize("release", RELEASES)
def test_family_drift_is_exactly_the_table(plan_for, release: str) -> None:
    plan = plan_for(release)
    assert plan.vllm_version == release
    assert set(plan.families) == {f.name for f in FAMILIES}
    found = {(f.probe, f.speculators, f.variant) for f in _family_findings(plan) if f.state is not State.BASELINE}
    expected = EXPECTED_FAMILY_DRIFT[release]
    assert found == expected, (
        f"vLLM {release}: reported but not in the table: {sorted(found - expected)}; "
        f"in the table but not reported: {sorted(expected - found)}"
    )


@pytest.mark.parametrize("release", RELEASES)
def test_every_family_fact_is_decided(plan_for, release: str) -> None:
    plan = plan_for(release)
    undecided = [(f.probe, f.speculators, f.observed) for f in _family_findings(plan) if f.state is State.UNKNOWN]
    assert not undecided
    # every family has every fact, judged for each line it applies to
    assert len(_family_findings(plan)) == sum(
        len([line for line in LINES if p.applies_to(line)]) for probes in PROBES.values() for p in probes.values()
    )


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_what_the_guard_leaves_unhandled(release: str, family: str) -> None:
    """A plan for one family (as the generator's guard makes it for that model): what no adapter covers."""
    try:
        wheel = fetch_release(release)
    except SourceError as exc:
        pytest.skip(f"vllm=={release} is not cached and cannot be fetched: {exc}")
    plan = make_plan(StaticView(wheel), LINES, families=[family], probe_ids=[p.id for p in PROBES[family].values()])
    unhandled = {(f.speculators, f.probe) for f in plan.unhandled}
    assert unhandled == EXPECTED_UNHANDLED.get(release, {}).get(family, set())


@pytest.mark.parametrize("release", sorted(EXPECTED_BASELINE))
def test_key_baseline_family_facts(plan_for, release: str) -> None:
    plan = plan_for(release)
    baseline = {(f.probe, f.speculators, f.variant) for f in plan.findings if f.state is State.BASELINE}
    missing = EXPECTED_BASELINE[release] - baseline
    assert not missing, f"vLLM {release}: expected baseline, not found as such: {sorted(missing)}"


@pytest.mark.parametrize(("release", "probe", "line"), sorted(EXPECTED_EVIDENCE))
def test_family_evidence_points_to_the_source(plan_for, release: str, probe: str, line: str) -> None:
    plan = plan_for(release)
    (finding,) = [f for f in plan.findings if f.probe == probe and f.speculators == line]
    assert EXPECTED_EVIDENCE[(release, probe, line)] in finding.evidence
