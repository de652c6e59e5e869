"""The runner choice (vllm_compat/runners.py) and how a plan uses it, on observations made up for each case.

The real observations, per vLLM release, are in tests/drift/test_model_runners.py; here each case of the choice is
spelt out: what vLLM has, which facts hold, what the environment asks for.
"""

from __future__ import annotations

import pytest

from vllm_compat import runners
from vllm_compat.findings import Observation

LINE = "0.4.0.1"


def observations(default: str, v1: str = "baseline", v2: str = "baseline") -> dict[str, Observation]:
    obs = {runners.RUNNER_PROBE: Observation(default, f"runner default {default}")}
    obs.update({fact: Observation(v1, "v1 fact") for fact in runners.V1_FACTS})
    obs.update({fact: Observation(v2, "v2 fact") for fact in runners.V2_FACTS})
    if v1 == "baseline":
        obs["scheduler.batch_order"] = Observation("reorders", "V1 moves rows")  # as every real release
    return obs


@pytest.mark.parametrize(
    ("default", "env", "runner", "adapter"),
    [
        ("baseline", {}, "v1", None),  # 0.11: only V1
        ("v2_opt_in", {}, "v1", None),  # 0.12-0.21: vLLM's default is V1, V2 never taken on its own
        ("v2_default", {}, runners.PREFERRED, runners.ADAPTERS[runners.PREFERRED]),
        ("v2_only", {}, "v2", "model-runner-v2"),  # V1 deleted
        ("v2_opt_in", {"VLLM_COMPAT_MODEL_RUNNER": "v2"}, "v2", "model-runner-v2"),
        ("v2_default", {"VLLM_COMPAT_MODEL_RUNNER": "v2"}, "v2", "model-runner-v2"),
        ("v2_default", {"VLLM_COMPAT_MODEL_RUNNER": "v1"}, "v1", "model-runner-v1"),
        ("v2_default", {"VLLM_USE_V2_MODEL_RUNNER": "1"}, "v2", "model-runner-v2"),  # the user's choice for vLLM
        ("v2_default", {"VLLM_USE_V2_MODEL_RUNNER": "0"}, "v1", "model-runner-v1"),
        # VLLM_COMPAT_MODEL_RUNNER wins over vLLM's variable
        ("v2_default", {"VLLM_COMPAT_MODEL_RUNNER": "v1", "VLLM_USE_V2_MODEL_RUNNER": "1"}, "v1", "model-runner-v1"),
        ("v2_default", {"VLLM_COMPAT_MODEL_RUNNER": "auto"}, runners.PREFERRED, runners.ADAPTERS[runners.PREFERRED]),
    ],
)
def test_choice(default: str, env: dict[str, str], runner: str, adapter: str | None) -> None:
    choice = runners.choose(observations(default), LINE, env)
    assert (choice.runner, choice.adapter) == (runner, adapter), choice.why
    assert f"Model Runner {runner.upper()}" in choice.why
    assert choice.excluded == frozenset(runners.ADAPTERS.values()) - {runners.ADAPTERS[runner]}


def test_the_other_runner_where_the_preferred_ones_facts_do_not_hold() -> None:
    other = "v2" if runners.PREFERRED == "v1" else "v1"
    obs = observations("v2_default", **{runners.PREFERRED: "changed"})
    choice = runners.choose(obs, LINE, {})
    assert choice.runner == other and choice.adapter == runners.ADAPTERS[other]
    assert "is changed" in choice.why  # says why the preferred one was not taken


@pytest.mark.parametrize(
    ("default", "env", "facts", "named"),
    [
        ("v2_only", {"VLLM_COMPAT_MODEL_RUNNER": "v1"}, {}, "this vLLM has no Model Runner V1"),
        ("baseline", {"VLLM_COMPAT_MODEL_RUNNER": "v2"}, {}, "this vLLM has no Model Runner V2"),
        ("v2_only", {}, {"v2": "unknown"}, "model_runner.v2_step_batch is unknown"),
        ("v2_default", {}, {"v1": "unknown", "v2": "changed"}, "model_runner.v1_attributes is unknown"),
        ("v2_opt_in", {}, {"v1": "changed"}, "model_runner.v1_attributes is changed"),  # V2 not taken on its own
        ("unknown", {}, {}, "could not tell which model runner"),
        ("unpinned", {}, {}, "cannot pin the runner"),
        ("v2_default", {"VLLM_COMPAT_MODEL_RUNNER": "v3"}, {}, "not v1, v2 or auto"),
    ],
)
def test_no_capture_path_names_why(default: str, env: dict[str, str], facts: dict[str, str], named: str) -> None:
    choice = runners.choose(observations(default, **facts), LINE, env)
    assert choice.runner is None and choice.adapter is None
    assert named in choice.why, choice.why
    assert choice.blockers, "a failed choice names the facts that kept each runner out"
    assert choice.excluded == frozenset(runners.ADAPTERS.values())


def test_a_fact_not_observed_does_not_hold() -> None:
    obs = observations("v2_only")
    del obs["model_runner.v2_row_layout"]
    choice = runners.choose(obs, LINE, {})
    assert choice.runner is None and "model_runner.v2_row_layout is unknown (not observed)" in choice.why


def test_per_line_variants_are_read_for_the_line() -> None:
    obs = observations("v2_only")
    obs["model_runner.v2_eager_forward"] = Observation("baseline", "x", per_line={"0.3.0": "changed"})
    assert runners.choose(obs, "0.4.0.1", {}).runner == "v2"
    assert runners.choose(obs, "0.3.0", {}).runner is None
