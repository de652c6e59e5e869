"""What counts as proven end to end, and the shipped record kept in step with docs/e2e-matrix.json.

`vllm-compat probe --strict` on real wheels (0.32.0 proven, 0.34.0 refused unless --allow-code-only) is in
tests/drift/test_proof.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from vllm_compat.proof import RECORD_FILE, load_record, proof_for

ROOT = Path(__file__).resolve().parents[2]

RECORD = {
    "0.4.0.1": {
        "0.12.0": {"kinds": ["e2e"], "passed": True, "date": "2026-12-01"},
        "0.13.0": {"kinds": ["e2e"], "passed": False, "date": "2026-12-01"},
        "0.20.0": {"kinds": ["e2e"], "passed": True, "date": "2026-12-02"},
        "0.33.0": {"kinds": ["import"], "passed": True, "date": "2026-12-03"},
        "0.34.0": {"kinds": ["gpu"], "passed": True, "date": "2026-12-04"},
    }
}


@pytest.mark.parametrize(
    ("vllm", "level", "said"),
    [
        ("0.12.0", "end_to_end", "passed end to end on vLLM's CPU build (2026-12-01)"),
        ("0.12.0+cpu", "end_to_end", "passed end to end"),
        ("0.34.0", "end_to_end", "passed end to end on a GPU (2026-12-04)"),
        ("0.15.1", "inside_range", "releases before and after it passed end to end (0.12.0 to 0.34.0)"),
        ("0.13.0", "failed", "its end-to-end run on vLLM's CPU build failed"),
        ("0.33.0", "import_only", "only its imports were checked"),
        ("0.34.1", "code_only", "no end-to-end run on record"),
        ("0.35.0", "code_only", "judged by its code only (the newest release that passed end to end: 0.34.0)"),
        ("0.11.0", "code_only", "no end-to-end run on record"),
        (None, "code_only", "could not be told"),
    ],
)
def test_levels(vllm: str | None, level: str, said: str) -> None:
    proof = proof_for(vllm, "0.4.0.1", RECORD)
    assert proof.level == level and said in proof.detail
    assert proof.proven is (level in {"end_to_end", "inside_range"})
    assert proof.to_json()["proven"] is proof.proven


def test_a_line_with_no_runs_is_code_only() -> None:
    assert proof_for("0.12.0", "0.3.0", RECORD).level == "code_only"


def test_the_shipped_record_is_made_from_the_matrix() -> None:
    spec = importlib.util.spec_from_file_location("gen_docs_for_proof", ROOT / "scripts" / "gen_docs.py")
    gen_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_docs)
    assert RECORD_FILE.read_text() == gen_docs.proof_record(gen_docs.DEFAULT_E2E_REPORT), (
        "vllm_compat/e2e_record.json is out of date: run python scripts/gen_docs.py"
    )
    cells = json.loads((ROOT / "docs" / "e2e-matrix.json").read_text())["cells"]
    record = load_record()
    for cell in cells.values():
        entry = record[cell["speculators"]][cell["vllm"]]
        assert entry["passed"] is all(c["passed"] for c in cells.values() if (c["speculators"], c["vllm"]) == (
            cell["speculators"], cell["vllm"]))  # a release passes only where every run of it did
        if cell["passed"] == entry["passed"]:
            assert cell["kind"] in entry["kinds"]


def test_a_failed_run_is_refused_without_strict_and_accepted_with_allow_code_only(monkeypatch, capsys) -> None:
    """The CLI's refusal: code-only only under --strict; a failed run always; --allow-code-only accepts both."""
    from vllm_compat import cli, proof
    from vllm_compat.plan import Plan

    # a plan with every fact as speculators expects: only the proof decides
    monkeypatch.setattr(cli, "probe_plan", lambda *a, **k: Plan("0.34.0", "static", ("0.4.0.1",)))
    cases = {
        "code_only": {"": 0, "--strict": 1, "--strict --allow-code-only": 0},
        "failed": {"": 1, "--strict": 1, "--allow-code-only": 0, "--strict --allow-code-only": 0},
        "end_to_end": {"": 0, "--strict": 0},
    }
    for level, runs in cases.items():
        monkeypatch.setattr(cli, "proof_for", lambda v, line, level=level: proof.Proof(line, v, level, level))
        for flags, want in runs.items():
            rc = cli.main(["probe", "--source", "x", "--speculators", "0.4.0.1", "--json", *flags.split()])
            report = json.loads(capsys.readouterr().out)
            assert (rc, report["ok"], report["refused_unproven"]) == (want, want == 0, want == 1), (level, flags)


def test_a_gpu_failure_outweighs_a_cpu_pass_of_the_same_release(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_docs_for_proof2", ROOT / "scripts" / "gen_docs.py")
    gen_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_docs)
    cell = {"speculators": "0.4.0.1", "vllm": "0.30.0", "date": "2026-12-04T00:00:00Z"}
    report = tmp_path / "matrix.json"
    gen_docs.matrix_module().save_report(report, {
        "0.4.0.1@0.30.0": {**cell, "kind": "e2e", "passed": True},
        "gpu:0.4.0.1@0.30.0": {**cell, "kind": "gpu", "passed": False},
        "0.4.0.1@0.31.0": {**cell, "vllm": "0.31.0", "kind": "e2e", "passed": True},
    })  # fmt: skip
    record = json.loads(gen_docs.proof_record(report))["lines"]
    assert record["0.4.0.1"]["0.30.0"] == {"kinds": ["gpu"], "passed": False, "date": "2026-12-04"}
    proof = proof_for("0.30.0", "0.4.0.1", record)
    assert proof.level == "failed" and "on a GPU failed" in proof.detail
    assert proof_for("0.31.0", "0.4.0.1", record).level == "end_to_end"
