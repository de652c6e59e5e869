"""``vllm-compat probe --strict`` claims no more than was proven, on real wheels.

vLLM 0.32.0 passed end to end for both speculators lines (docs/e2e-matrix.json): strict accepts it. vLLM 0.34.0 has no
end-to-end record of its own on the CPU (no CPU build): strict refuses it, saying so and how to prove it, unless the
user accepts its code-only judgement (``--allow-code-only``); the KV-cache commitment fact is reported covered either
way. vLLM 0.33.0's only record is an import check: strict refuses it too. What is proven: tests/unit/test_proof.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from vllm_compat.proof import proof_for

pytestmark = pytest.mark.wheels


def probe(*args: str) -> subprocess.CompletedProcess:
    script = shutil.which("vllm-compat")
    cmd = [script] if script else [sys.executable, "-m", "vllm_compat.cli"]
    return subprocess.run([*cmd, "probe", *args], capture_output=True, text=True, timeout=600, check=False)


def test_a_proven_release_passes_strict() -> None:
    done = probe("--source", "vllm==0.32.0", "--strict", "--json")
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["ok"] and not report["refused_unproven"], done.stdout[-2000:]
    assert {p["level"] for p in report["proof"]} == {"end_to_end"}


@pytest.mark.parametrize("release", ["0.34.0", "0.33.0"])
def test_strict_refuses_what_only_its_code_proves(release: str) -> None:
    proofs = [proof_for(release, line) for line in ("0.3.0", "0.4.0.1")]
    if any(p.proven for p in proofs):
        pytest.skip(f"vLLM {release} now has an end-to-end record: {[p.detail for p in proofs]}")
    table = probe("--source", f"vllm=={release}", "--strict")
    assert table.returncode == 1, table.stdout[-3000:]
    lines = table.stdout.splitlines()
    assert lines[1].startswith("verdict: FAIL") and "end to end" in lines[1]
    flat = " ".join(table.stdout.split())
    assert "--allow-code-only" in flat
    assert f"proof, speculators 0.4.0.1: {proofs[1].detail}" in flat
    assert "UNHANDLED" not in table.stdout  # the facts themselves are covered: only the proof is missing

    report = json.loads(probe("--source", f"vllm=={release}", "--strict", "--json").stdout)
    assert report["ok"] is False and report["refused_unproven"] is True and report["unhandled"] == []

    accepted = probe("--source", f"vllm=={release}", "--strict", "--allow-code-only", "--json")
    report = json.loads(accepted.stdout)
    assert accepted.returncode == 0 and report["ok"] and not report["refused_unproven"]
    assert [p["proven"] for p in report["proof"]] == [False, False]
    plain = probe("--source", f"vllm=={release}")
    failed = any(p.level == "failed" for p in proofs)
    assert plain.returncode == (1 if failed else 0), "without --strict, only a failed run is refused"
    if failed:
        assert "failed end to end" in plain.stdout.splitlines()[1] and "an end-to-end run" in plain.stdout


def test_the_kv_cache_fact_is_reported_covered_on_0_34() -> None:
    report = json.loads(probe("--source", "vllm==0.34.0", "--strict", "--allow-code-only", "--json").stdout)
    facts = [f for f in report["findings"] if f["probe"] == "kv_cache.commitment"]
    assert {f["speculators"] for f in facts} == {"0.3.0", "0.4.0.1"}
    assert all(f["state"] == "drifted" and f["handled"] and f["adapter"] == "extensible-kv-cache-off" for f in facts)
    assert "extensible-kv-cache-off" in report["adapters"]


def test_asking_for_model_runner_v1_on_0_34_fails_closed_and_says_what_to_do() -> None:
    """vLLM 0.34.0 deleted Model Runner V1: VLLM_COMPAT_MODEL_RUNNER=v1 is refused, naming the fact and the fix."""
    script = shutil.which("vllm-compat")
    cmd = [script] if script else [sys.executable, "-m", "vllm_compat.cli"]
    env = {**os.environ, "VLLM_COMPAT_MODEL_RUNNER": "v1"}
    done = subprocess.run([*cmd, "probe", "--source", "vllm==0.34.0", "--speculators", "0.4.0.1"], env=env,
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    flat = " ".join(done.stdout.split())
    assert done.returncode == 1 and done.stdout.splitlines()[1].startswith("verdict: FAIL")
    assert "this vLLM has no Model Runner V1" in flat
    assert "what to do: unset VLLM_COMPAT_MODEL_RUNNER (or set it to v2)" in flat
