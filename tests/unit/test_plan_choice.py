"""How a plan picks an adapter: facts an adapter relies on, runner adapters as alternatives, needed unknown facts.

Registries hold only the probes and adapters made here; the view answers nothing (the probes make up observations).
"""

from __future__ import annotations

import types

import pytest

from vllm_compat import adapter as adapter_module
from vllm_compat import findings as findings_module
from vllm_compat import runners
from vllm_compat.adapter import Adapter
from vllm_compat.findings import Observation, State, probe
from vllm_compat.plan import make_plan

LINE = "0.4.0.1"


class View:
    kind = "static"

    def version(self) -> str:
        return "9.9.9"


@pytest.fixture()
def registries(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    adapter_module.load_adapters()
    from vllm_compat.plan import load_probes

    load_probes()
    monkeypatch.setattr(adapter_module, "_REGISTRY", {})
    monkeypatch.setattr(findings_module, "_REGISTRY", {})
    monkeypatch.setattr("vllm_compat.plan.load_adapters", lambda: adapter_module._REGISTRY)
    monkeypatch.setattr("vllm_compat.plan.load_probes", lambda: findings_module._REGISTRY)
    monkeypatch.delenv(runners.ENV, raising=False)
    monkeypatch.delenv(runners.VLLM_ENV, raising=False)
    seen: dict[str, str] = {}

    def fact(probe_id: str) -> None:
        probe(probe_id, symbol=probe_id, summary="x", expected={LINE: "x"})(
            lambda view: Observation(seen[probe_id], f"{probe_id} is {seen[probe_id]}")
        )

    for probe_id in ("test.drift", "test.support", *runners.RELATED):
        fact(probe_id)
    seen.update(dict.fromkeys(runners.RELATED, "baseline"))
    seen[runners.RUNNER_PROBE] = "v2_default"
    seen.update({"test.drift": "renamed", "test.support": "baseline"})
    return seen


def adapter(adapter_id: str, covers: dict, relies_on: dict | None = None, **extra) -> type[Adapter]:
    namespace = {"id": adapter_id, "covers": covers, "relies_on": relies_on or {}, "target": "x", **extra}
    namespace["apply"] = lambda self, module: None
    return types.new_class(adapter_id.replace("-", "_"), (Adapter,), exec_body=lambda ns: ns.update(namespace))


def finding(plan, probe_id: str):
    return next(f for f in plan.findings if f.probe == probe_id)


def test_an_adapter_whose_fact_does_not_hold_is_passed_over(registries) -> None:
    adapter("first", {"test.drift": {"renamed"}}, {"test.support": {"baseline"}})
    adapter("second", {"test.drift": {"renamed"}})
    assert finding(make_plan(View(), [LINE]), "test.drift").adapter == "first"
    registries["test.support"] = "unknown"
    f = finding(make_plan(View(), [LINE]), "test.drift")
    assert f.adapter == "second" and f.handled


def test_no_adapter_left_names_the_fact(registries) -> None:
    adapter("only", {"test.drift": {"renamed"}}, {"test.support": {"baseline"}})
    registries["test.support"] = "changed"
    plan = make_plan(View(), [LINE])
    f = finding(plan, "test.drift")
    assert not f.handled and "only relies on facts that do not hold: test.support is changed" in f.observed
    assert not plan.passes(strict=False)


def test_runner_adapters_are_alternatives(registries) -> None:
    """Both cover V2 being vLLM's default; only the one the choice takes is named, and V1's adapter covers the drift
    of V2's facts only while V1 is the runner."""
    adapter("model-runner-v1", {runners.RUNNER_PROBE: {"v2_default"}, "model_runner.v2_row_layout": {"changed"}})
    adapter("model-runner-v2", {runners.RUNNER_PROBE: {"v2_default"}, "model_runner.v1_attributes": {"changed"}})
    plan = make_plan(View(), [LINE])
    assert finding(plan, runners.RUNNER_PROBE).adapter == runners.ADAPTERS[runners.PREFERRED]
    registries["model_runner.v1_attributes"] = "changed"  # V1's path does not hold: V2, which covers V1's drift
    plan = make_plan(View(), [LINE])
    assert finding(plan, runners.RUNNER_PROBE).adapter == "model-runner-v2"
    assert finding(plan, "model_runner.v1_attributes").adapter == "model-runner-v2"
    registries["model_runner.v2_row_layout"] = "changed"  # neither path holds
    plan = make_plan(View(), [LINE])
    runner = finding(plan, runners.RUNNER_PROBE)
    assert runner.state is State.DRIFTED and not runner.handled
    assert finding(plan, "model_runner.v2_row_layout").adapter is None  # V1 does not run: nothing covers it
    assert not plan.passes(strict=False)


def test_an_unknown_runner_fact_fails_without_strict(registries) -> None:
    registries[runners.RUNNER_PROBE] = "unknown"
    plan = make_plan(View(), [LINE])
    assert [f.probe for f in plan.needed_unknown] == [runners.RUNNER_PROBE]
    assert not plan.passes(strict=False)
    assert plan.to_json()["needed_unknown"] == [runners.RUNNER_PROBE]


def test_an_unknown_fact_nobody_needs_fails_only_strict(registries) -> None:
    registries["model_runner.v2_row_layout"] = "unknown"  # V1 is chosen: V2's facts are not needed
    registries["test.drift"] = "baseline"
    adapter("model-runner-v1", {runners.RUNNER_PROBE: {"v2_default"}})
    plan = make_plan(View(), [LINE])
    assert plan.passes(strict=False) and not plan.passes(strict=True)
    assert plan.needed_unknown == []


def test_single_probe_plans_make_the_same_choice(registries) -> None:
    """The engine asks for one probe at a time: the runner facts are observed all the same."""
    adapter("model-runner-v1", {runners.RUNNER_PROBE: {"v2_default"}})
    adapter("model-runner-v2", {runners.RUNNER_PROBE: {"v2_default"}, "model_runner.v1_attributes": {"changed"}})
    registries["model_runner.v1_attributes"] = "changed"
    plan = make_plan(View(), [LINE], [runners.RUNNER_PROBE])
    assert [f.probe for f in plan.findings] == [runners.RUNNER_PROBE]
    assert plan.findings[0].adapter == "model-runner-v2"
