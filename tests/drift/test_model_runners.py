"""The model-runner facts and the runner choice, on real vLLM wheels, and on vLLM 0.33.0 with Model Runner V1 deleted.

Model Runner V2 appeared in vLLM 0.12.0. Its facts that vllm-compat's V2 capture path relies on
(``vllm_compat.runners.V2_FACTS``; probes/model_runner.py) are ``absent`` before that and ``baseline`` in every release
from 0.12.0 to 0.33.0; each names the code it read (``vllm/v1/worker/gpu/model_runner.py:LINE``). The runner the plan
chooses follows from them and from ``VLLM_COMPAT_MODEL_RUNNER``.

The release that deletes V1 is simulated from the 0.33.0 wheel: ``vllm/v1/worker/gpu_model_runner.py`` and
``gpu_input_batch.py`` removed, ``VllmConfig.use_v2_model_runner`` answering True. There ``vllm-compat probe`` must
pass only because the V2 path covers it (no runner or batch-order fact unknown, the runner finding taken by
``model-runner-v2``), and fail, naming the facts, with the V2 path switched off (``VLLM_COMPAT_MODEL_RUNNER=v1``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.drift import by_version, plan_getter
from vllm_compat import runners
from vllm_compat.cli import main
from vllm_compat.findings import State

pytestmark = pytest.mark.wheels

V030, V040 = "0.3.0", "0.4.0.1"
LINES = (V030, V040)
BEFORE_V2 = ("0.11.0", "0.11.1")
V2_OPT_IN = ("0.12.0", "0.13.0", "0.14.0", "0.15.0", "0.16.0", "0.17.0", "0.18.0", "0.19.0", "0.20.0", "0.21.0")
V2_DEFAULT = ("0.22.0", "0.23.0", "0.24.0", "0.25.0", "0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0")
V2_DEFAULT += ("0.32.0", "0.33.0")
RELEASES = by_version(BEFORE_V2 + V2_OPT_IN + V2_DEFAULT)
plan_of = plan_getter(LINES)


@pytest.fixture(autouse=True)
def no_runner_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """The choice reads the environment: every test starts with nothing asked for."""
    monkeypatch.delenv(runners.ENV, raising=False)
    monkeypatch.delenv(runners.VLLM_ENV, raising=False)


def findings_of(plan, probe: str):
    return [f for f in plan.findings if f.probe == probe]


@pytest.mark.parametrize("release", RELEASES)
def test_v2_facts_per_release(release: str) -> None:
    plan = plan_of(release)
    for probe in runners.V2_FACTS:
        for f in findings_of(plan, probe):
            assert f.state is State.BASELINE, (release, f)
            if release in BEFORE_V2:
                assert f.variant == "absent", (release, f)
            else:
                assert f.variant == "baseline", (release, f)
                assert re.search(r"vllm/v1/worker/gpu/(model_runner|states|input_batch)\.py:\d+", f.evidence), f


@pytest.mark.parametrize("release", RELEASES)
def test_auto_choice_per_release(release: str) -> None:
    """Auto: vLLM's V1 where V2 is opt-in or absent (nothing pinned), V1 pinned where V2 is vLLM's default."""
    plan = plan_of(release)
    assert plan.passes(strict=True), [(f.probe, f.observed) for f in plan.failing(strict=True)]
    for f in findings_of(plan, runners.RUNNER_PROBE):
        if release in V2_DEFAULT:
            assert (f.state, f.variant, f.adapter) == (State.DRIFTED, "v2_default", "model-runner-v1"), f
        else:
            assert (f.state, f.adapter) == (State.BASELINE, None), f
        assert "vllm-compat runs Model Runner V1" in f.observed, f.observed


@pytest.mark.parametrize("release", ["0.11.0", "0.12.0", "0.21.0", "0.26.0", "0.33.0"])
def test_asked_for_v2(release: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_COMPAT_MODEL_RUNNER=v2: V2 pinned wherever it exists; where it does not, the run is refused, named."""
    monkeypatch.setenv(runners.ENV, "v2")
    plan = plan_getter(LINES)(release)
    for f in findings_of(plan, runners.RUNNER_PROBE):
        if release in BEFORE_V2:
            assert not f.handled and "this vLLM has no Model Runner V2" in f.observed, f
        else:
            assert (f.state, f.adapter, f.handled) == (State.DRIFTED, "model-runner-v2", True), f
    assert plan.passes(strict=False) is (release not in BEFORE_V2)


def v1_deleted_tree(vllm_tree) -> Path:
    """vLLM 0.33.0 as the release that deletes Model Runner V1 would look to the probes."""
    root = vllm_tree("0.33.0")
    worker = root / "vllm" / "v1" / "worker"
    (worker / "gpu_model_runner.py").unlink()
    (worker / "gpu_input_batch.py").unlink()
    config = root / "vllm" / "config" / "vllm.py"
    text = config.read_text()
    head = "    @property\n    def use_v2_model_runner(self) -> bool:\n"
    assert text.count(head) == 1
    start = text.index(head) + len(head)
    end = text.index("\n    def ", start)
    config.write_text(text[:start] + "        return True\n" + text[end:])
    return root


def probe_json(tree: Path, line: str, capsys) -> tuple[int, dict]:
    code = main(["probe", "--source", str(tree), "--speculators", line, "--json"])
    return code, json.loads(capsys.readouterr().out)


RUNNER_FACTS = (runners.RUNNER_PROBE, "model_runner.v1_attributes", "scheduler.batch_order")


@pytest.mark.parametrize("line", LINES)
def test_v1_deleted_tree_passes_through_the_v2_path(vllm_tree, line: str, capsys) -> None:
    tree = v1_deleted_tree(vllm_tree)
    code, report = probe_json(tree, line, capsys)
    assert code == 0 and report["ok"] is True, report["unhandled"]
    by_probe = {f["probe"]: f for f in report["findings"]}
    assert not set(RUNNER_FACTS) & set(report["unknown"]), report["unknown"]
    assert by_probe[runners.RUNNER_PROBE]["variant"] == "v2_only"
    for probe in RUNNER_FACTS:  # the runner finding and V1's absence: taken by the V2 path
        assert (by_probe[probe]["state"], by_probe[probe]["adapter"]) == ("drifted", "model-runner-v2"), probe
    assert by_probe["model_runner.v1_attributes"]["variant"] == "absent"
    assert by_probe["scheduler.batch_order"]["variant"] == "absent"
    assert "model-runner-v1" not in report["adapters"] and "model-runner-v2" in report["adapters"]
    for probe in runners.V2_FACTS:
        assert by_probe[probe]["state"] == "baseline", by_probe[probe]


@pytest.mark.parametrize("line", LINES)
def test_v1_deleted_tree_fails_with_the_v2_path_off(vllm_tree, line: str, capsys, monkeypatch) -> None:
    tree = v1_deleted_tree(vllm_tree)
    monkeypatch.setenv(runners.ENV, "v1")
    code, report = probe_json(tree, line, capsys)
    assert code == 1 and report["ok"] is False
    assert set(RUNNER_FACTS) <= set(report["unhandled"]), report["unhandled"]
    runner = next(f for f in report["findings"] if f["probe"] == runners.RUNNER_PROBE)
    assert runner["adapter"] is None and not runner["handled"]
    assert "VLLM_COMPAT_MODEL_RUNNER=v1" in runner["observed"], runner["observed"]
    assert "this vLLM has no Model Runner V1" in runner["observed"], runner["observed"]
    main(["probe", "--source", str(tree), "--speculators", line])
    table = capsys.readouterr().out
    assert "not covered:" in table and runners.RUNNER_PROBE in table and "verdict: FAIL" in table


def test_an_unknown_fact_the_runner_needs_fails_without_strict(vllm_tree, capsys, monkeypatch) -> None:
    """A fact the chosen path relies on that cannot be established (V1's runner unreadable, V2 switched off) fails the
    probe without --strict, naming the fact; with V2 allowed, the V2 path is taken instead."""
    root = vllm_tree("0.26.0")
    (root / "vllm" / "v1" / "worker" / "gpu_model_runner.py").write_text("class GPUModelRunner(:\n")
    monkeypatch.setenv(runners.ENV, "v1")
    code, report = probe_json(root, V040, capsys)
    assert code == 1 and "model_runner.v1_attributes" in report["needed_unknown"], report
    runner = next(f for f in report["findings"] if f["probe"] == runners.RUNNER_PROBE)
    assert "model_runner.v1_attributes is unknown" in runner["observed"], runner["observed"]
    monkeypatch.delenv(runners.ENV)
    code, report = probe_json(root, V040, capsys)
    assert code == 0, report  # auto: V1's fact does not hold, V2's do: the V2 path
    runner = next(f for f in report["findings"] if f["probe"] == runners.RUNNER_PROBE)
    assert runner["adapter"] == "model-runner-v2", runner
