"""LiveView (the installed vLLM, imported) and StaticView (the same files, read with ast) agree."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

# Run in a fresh interpreter outside the checkout, so the installed vllm_compat is the one imported.
SCRIPT = """
import json
from pathlib import Path
import vllm
from vllm_compat.apiview.live import LiveView
from vllm_compat.apiview.static import StaticView
from vllm_compat.plan import make_plan

lines = ("0.3.0", "0.4.0.1")
site = Path(vllm.__file__).resolve().parent.parent
out = {}
for name, view in (("live", LiveView()), ("static", StaticView(site))):
    plan = make_plan(view, lines)
    findings = {f"{f.probe}@{f.speculators}": [str(f.state), f.variant, f.evidence] for f in plan.findings}
    out[name] = {"version": plan.vllm_version, "findings": findings}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cwd = tmp_path_factory.mktemp("live-view")
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=cwd, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_same_findings(plans: dict) -> None:
    live, static = plans["live"], plans["static"]
    assert live["version"] == static["version"]
    got = {k: v[:2] for k, v in live["findings"].items()}
    want = {k: v[:2] for k, v in static["findings"].items()}
    assert got == want


def test_same_evidence(plans: dict) -> None:
    """Each finding points at the same file:line whichever way the source was read."""
    live, static = plans["live"]["findings"], plans["static"]["findings"]
    for key, (_, _, evidence) in live.items():
        assert evidence == static[key][2], key
