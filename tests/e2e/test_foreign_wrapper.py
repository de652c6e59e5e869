"""uninstall() and install() under a tracer's wrapper, on the real generator: exact round trip, correct states.

A tracer (ddtrace, OpenTelemetry) that wraps speculators' ``generate`` and ``__init__`` after vllm-compat must keep
its wrapper through ``uninstall()``; ``install()`` must not stack a second copy of our wrappers under it (twice
``results-in-input-order`` put 10 of 12 results of a call at the wrong positions).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.e2e.conftest import HERE, LAYERS, TOLERANCE, child_env, max_diff

pytestmark = pytest.mark.e2e


def test_round_trip_under_a_foreign_wrapper(tiny_model, calls, reference, tmp_path) -> None:
    used = calls[:3]  # the third call holds 12 sequences: past the 10th, speculators 0.4.0.1 sorts them as strings
    (tmp_path / "calls.json").write_text(json.dumps(used))
    out = tmp_path / "out.pt"
    cmd = [sys.executable, str(HERE / "foreign_wrapper.py"), "--model", str(tiny_model), "--calls"]
    cmd += [str(tmp_path / "calls.json"), "--layers", ",".join(map(str, LAYERS)), "--out", str(out)]
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-6000:]
    data = torch.load(out, weights_only=False)
    # the tracer's wrapper is kept, ours are not stacked twice, and the states are right and in input order
    assert data["after"] == {name: n + 1 for name, n in data["ours"].items()}, (data["ours"], data["after"])
    assert data["traced"].count("__init__") == 1 and data["traced"].count("generate") == len(used)
    assert max_diff(data["outputs"], used, reference) < TOLERANCE
    # status(): after uninstall() nothing is applied, and our wrappers are listed as pass-throughs under the tracer's
    assert data["after_uninstall"]["applied"] == {}
    assert data["after_uninstall"]["pass_through"], "uninstall() forgot the wrappers it could not take out"
    assert data["after_install"]["pass_through"] == {}
