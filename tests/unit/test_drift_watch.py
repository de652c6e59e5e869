"""scripts/drift_watch.py, the scheduled drift watch (.github/workflows/drift-watch.yml): its verdict from report JSON
(docs/json-report.md), the probes it runs, and the workflow that runs it. No probe or network runs here: the
probe command is answered by a stand-in that replies with report JSON."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dw():
    spec = importlib.util.spec_from_file_location("drift_watch_under_test", ROOT / "scripts" / "drift_watch.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def finding(probe: str, state: str, handled: bool, adapter: str | None = None, line: str = "0.4.0.1") -> dict:
    return {
        "probe": probe, "symbol": f"vllm.{probe}", "speculators": line, "state": state,
        "variant": "baseline" if state == "baseline" else ("unknown" if state == "unknown" else "moved"),
        "expected": "x", "observed": f"observed {probe}", "evidence": f"vllm/{probe}.py:1", "adapter": adapter,
        "handled": handled,
    }  # fmt: skip


def report(version="0.34.0", line="0.4.0.1", unhandled=(), unknown=(), needed=(), ok=None, rng="newer", **extra):
    findings = [finding("request.request_kwargs", "drifted", True, "request-eos-token-id", line)]
    findings += [finding(p, "drifted", False, None, line) for p in unhandled]
    findings += [finding(p, "unknown", False, None, line) for p in unknown]
    data = {
        "schema_version": 1, "vllm_version": version, "speculators_version": line, "speculators_lines": [line],
        "source": "static", "findings": findings, "adapters": ["request-eos-token-id"],
        "unhandled": sorted(unhandled), "unknown": sorted(unknown), "needed_unknown": sorted(needed), "strict": True,
        "ok": (not unhandled and not unknown and not needed) if ok is None else ok,
        "speculators_judged": f"line {line}, as given (--speculators)", "vllm_range": rng,
    }  # fmt: skip
    data.update(extra)
    return data


def test_covered_drift_passes_and_names_its_adapters(dw) -> None:
    failures, notes = dw.judge(report())
    assert failures == []
    assert any("request-eos-token-id" in n for n in notes)


def test_unhandled_drift_fails_naming_the_probe_and_what_was_seen(dw) -> None:
    failures, _ = dw.judge(report(unhandled=["scheduler.scheduler_kwargs"]))
    assert failures == [
        "UNHANDLED drift scheduler.scheduler_kwargs: observed scheduler.scheduler_kwargs "
        "(vllm/scheduler.scheduler_kwargs.py:1)"
    ]


def test_unknown_facts_fail_as_strict_does(dw) -> None:
    failures, _ = dw.judge(report(unknown=["model_runner.v2"], needed=["model_runner.v2"]))
    assert failures == ["UNKNOWN model_runner.v2 (needed by the capture path)"]
    failures, _ = dw.judge(report(unknown=["model.qwen3_vl"]))
    assert failures == ["UNKNOWN model.qwen3_vl (counted as unhandled (--strict))"]


def test_a_missing_end_to_end_record_is_reported_not_failed(dw) -> None:
    """probe --strict may fail a release with no end-to-end record (ok false, exit 1): the watch judges the code."""
    failures, notes = dw.judge(report(ok=False, rng="newer"))
    assert failures == []
    assert any("no end-to-end record" in n for n in notes)
    proof = {"speculators": "0.4.0.1", "vllm": "0.34.0", "level": "code_only", "proven": False,
             "detail": "no end-to-end run on record: judged by its code only"}  # fmt: skip
    failures, notes = dw.judge(report(ok=False, proof=[proof], refused_unproven=True))
    assert failures == []
    assert "NOT proven end to end (code_only): no end-to-end run on record: judged by its code only" in notes
    assert any("refused" in n for n in notes)
    _, notes = dw.judge(report(proof=[{**proof, "level": "end_to_end", "proven": True, "detail": "passed"}]))
    assert "proven end to end: passed" in notes and not any("no end-to-end record" in n for n in notes)
    _, notes = dw.judge(report(rng="inside"))
    assert not any("end-to-end" in n for n in notes)


class FakeProbe:
    """Answers ``vllm-compat probe`` commands with prepared reports, per speculators line; records the commands."""

    def __init__(self, replies: dict[str, tuple[int, dict | None, str]], help_text: str = "usage: probe --strict"):
        self.replies, self.help_text, self.calls = replies, help_text, []

    def __call__(self, cmd, **kwargs):
        self.calls.append(list(cmd))
        if "--help" in cmd:
            return subprocess.CompletedProcess(cmd, 0, self.help_text, "")
        rc, data, err = self.replies[cmd[cmd.index("--speculators") + 1]]
        return subprocess.CompletedProcess(cmd, rc, json.dumps(data) if data is not None else "", err)


def test_watch_probes_every_line_on_one_release_and_keeps_the_reports(dw, tmp_path: Path) -> None:
    probe = FakeProbe({"0.4.0.1": (0, report(line="0.4.0.1"), ""), "0.3.0": (0, report(line="0.3.0"), "")})
    results = dw.watch("vllm", ["0.4.0.1", "0.3.0"], tmp_path, ["vllm-compat"], run=probe)
    runs = [c for c in probe.calls if "--help" not in c]
    assert runs[0] == [
        "vllm-compat", "probe", "--source", "vllm", "--speculators", "0.4.0.1", "--strict", "--json",
    ]  # fmt: skip
    assert runs[1][runs[1].index("--source") + 1] == "vllm==0.34.0", (
        "the second line judges the release the first chose"
    )
    assert dw.exit_code(results) == dw.EXIT_OK
    saved = sorted(p.name for p in tmp_path.glob("*.json"))
    assert saved == ["drift-vllm-0.34.0-speculators-0.3.0.json", "drift-vllm-0.34.0-speculators-0.4.0.1.json"]
    assert json.loads((tmp_path / saved[1]).read_text())["speculators_lines"] == ["0.4.0.1"]


def test_watch_fails_on_one_line_s_unhandled_drift(dw, tmp_path: Path) -> None:
    probe = FakeProbe(
        {
            "0.4.0.1": (0, report(line="0.4.0.1"), ""),
            "0.3.0": (1, report(line="0.3.0", unhandled=["scheduler.scheduler_kwargs"]), ""),
        }
    )
    results = dw.watch("vllm==0.34.0", ["0.4.0.1", "0.3.0"], tmp_path, ["vllm-compat"], run=probe)
    assert dw.exit_code(results) == dw.EXIT_DRIFT
    text = dw.summary(results)
    assert text.startswith("# vllm-compat drift watch: vLLM 0.34.0: FAIL")
    assert "- speculators 0.3.0: FAIL (probe exit 1)" in text and "UNHANDLED drift scheduler.scheduler_kwargs" in text
    assert "- speculators 0.4.0.1: OK" in text


def test_watch_passes_a_release_that_probe_strict_fails_only_for_lack_of_proof(dw, tmp_path: Path) -> None:
    probe = FakeProbe(
        {line: (1, report(line=line, ok=False), "") for line in ("0.4.0.1", "0.3.0")},
        help_text="  --strict ...\n  --allow-code-only  judge a release with no end-to-end record by its code\n",
    )
    results = dw.watch("vllm", ["0.4.0.1", "0.3.0"], tmp_path, ["vllm-compat"], run=probe)
    assert dw.exit_code(results) == dw.EXIT_OK
    runs = [c for c in probe.calls if "--help" not in c]
    assert all(c[-1] == "--allow-code-only" for c in runs), "the opt-in is passed where probe offers it"
    assert "no end-to-end record" in dw.summary(results)


def test_watch_without_a_report_is_an_error(dw, tmp_path: Path) -> None:
    offline = "vllm-compat: could not find the newest vLLM release on the package index (pip: ERROR: ...)"
    probe = FakeProbe({line: (2, None, offline + "\n") for line in ("0.4.0.1", "0.3.0")})
    results = dw.watch("vllm", ["0.4.0.1", "0.3.0"], tmp_path, ["vllm-compat"], run=probe)
    assert dw.exit_code(results) == dw.EXIT_ERROR
    assert f"- speculators 0.4.0.1: probe failed (exit 2): {offline}" in dw.summary(results)
    assert list(tmp_path.glob("*.json")) == []


def test_main_writes_the_summary_and_the_step_summary(dw, tmp_path: Path, monkeypatch, capsys) -> None:
    probe = FakeProbe({"0.4.0.1": (1, report(unhandled=["a.b"]), "")})
    monkeypatch.setattr(dw.subprocess, "run", probe)
    step = tmp_path / "step.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step))
    out = tmp_path / "reports"
    rc = dw.main(["--speculators", "0.4.0.1", "--out", str(out), "--probe", "vllm-compat"])
    assert rc == dw.EXIT_DRIFT
    text = (out / "summary.md").read_text()
    assert step.read_text() == text == capsys.readouterr().out
    assert "UNHANDLED drift a.b" in text


def test_the_workflow_runs_the_watch_weekly_and_on_demand_and_keeps_the_reports() -> None:
    text = (ROOT / ".github" / "workflows" / "drift-watch.yml").read_text()
    assert "schedule:" in text and "cron:" in text and "workflow_dispatch:" in text
    assert "pip install ." in text
    assert "python scripts/drift_watch.py" in text and "--out drift-reports" in text
    assert "actions/upload-artifact@" in text and "path: drift-reports" in text and "if: always()" in text
