"""Fail closed on drift no adapter knows, against the real installed vLLM, before any model loads.

Each case changes one real vLLM symbol in a fresh interpreter (tests/e2e/drift_live.py) before speculators is
imported, the way a future release would: a new required parameter, a removed function, a renamed parameter, a
changed return convention. With ``import vllm_compat`` the user gets ``UnhandledDrift`` at the first affected call
(speculators' import for a removed name, the generator's constructor otherwise); with
``vllm_compat.install(strict=True)`` at the install. The message names the probe and the vLLM symbol and says what
to do; vLLM's MultiprocExecutor was never constructed and no worker process exists.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import procs

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent
UNHANDLED = "vllm_compat.errors.UnhandledDrift"

# (kind, mode, where it stops, probe that must be named, vLLM symbol that must be named, a detail of the change)
CASES = [
    (
        "request-new-required-parameter",
        "auto",
        "constructor",
        "request.request_kwargs",
        "vllm.v1.request.Request",
        "found vllm.v1.request.Request(args=…, scheduling_tier, kwargs=…)",
    ),
    (
        "request-new-required-parameter",
        "strict",
        "install",
        "request.request_kwargs",
        "vllm.v1.request.Request",
        "found vllm.v1.request.Request(args=…, scheduling_tier, kwargs=…)",
    ),
    (
        "planning-helper-removed",
        "auto",
        "import",
        "import.v1.core.kv_cache_utils.get_kv_cache_config_from_groups",
        "vllm.v1.core.kv_cache_utils.get_kv_cache_config_from_groups",
        "not at any known new place",
    ),
    (
        "planning-helper-removed",
        "strict",
        "install",
        "import.v1.core.kv_cache_utils.get_kv_cache_config_from_groups",
        "vllm.v1.core.kv_cache_utils.get_kv_cache_config_from_groups",
        "not at any known new place",
    ),
    (
        "planning-parameter-renamed",
        "auto",
        "constructor",
        "kv_cache.config_from_groups_kwargs",
        "vllm.v1.core.kv_cache_utils.get_kv_cache_config_from_groups",
        "found vllm.v1.core.kv_cache_utils.get_kv_cache_config_from_groups(vllm_config, groups, available_memory)",
    ),
    (
        "reply-convention-changed",
        "auto",
        "constructor",
        "executor.unique_reply_shape",
        "vllm.v1.executor.multiproc_executor.MultiprocExecutor.collective_rpc",
        "no return statement of a known shape",
    ),
    (
        "reply-convention-changed",
        "strict",
        "install",
        "executor.unique_reply_shape",
        "vllm.v1.executor.multiproc_executor.MultiprocExecutor.collective_rpc",
        "no return statement of a known shape",
    ),
]


def drift(kind: str, mode: str, model: Path, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{kind}-{mode}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_COMPAT_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, str(HERE / "drift_live.py"), kind, "--mode", mode, "--model", str(model), "--out", str(out)]
    done = procs.run_in_session(cmd, env, timeout=600)
    assert done.returncode == 0 and out.exists(), f"exit {done.returncode}:\n{done.stderr[-4000:]}"
    assert done.left == [], f"processes left running by the case: {done.left}"
    return json.loads(out.read_text())


@pytest.mark.parametrize(("kind", "mode", "stage", "probe", "symbol", "detail"), CASES)
def test_unknown_drift_stops_before_any_model_loads(tiny_model, tmp_path, kind, mode, stage, probe, symbol, detail):
    record = drift(kind, mode, tiny_model, tmp_path)
    assert record.get("error_type") == UNHANDLED, record.get("trace", record)
    assert record["stage"] == stage
    message = record["message"]
    assert probe in message and symbol in message and detail in message, message
    assert "What to do:" in message and "vllm-compat probe" in message and "Nothing was loaded" in message
    assert any(f["probe"] == probe for f in record["findings"])
    assert record["executors_built"] == 0, "vLLM's executor was started"
    assert record["children"] == [], f"worker processes exist: {record['children']}"


def test_a_refusing_adapter_says_why_at_import(tiny_model, tmp_path) -> None:
    """VLLM_USE_V2_MODEL_RUNNER=1 on vLLM's CPU platform: the runner choice takes Model Runner V2 (the user asked for
    it), and model-runner-v2 refuses at speculators' import, with an AdapterError that says what to change (not
    "could not patch"). Where vLLM has no V2 at all (0.11), the guard stops the run: no capture path."""
    record = drift("model-runner-v2-forced", "auto", tiny_model, tmp_path)
    message = record["message"]
    assert record["executors_built"] == 0 and record["children"] == []
    if record["error_type"] == UNHANDLED:
        assert record["stage"] == "constructor" and "config.model_runner_default" in message, message
        assert "this vLLM has no Model Runner V2" in message, message
        return
    assert record["error_type"] == "vllm_compat.errors.AdapterError", record.get("trace")
    assert record["stage"] == "import"
    assert message.startswith("vllm-compat adapter model-runner-v2 refused to patch speculators."), message
    assert "CPU platform runs Model Runner V1 only" in message and "VLLM_COMPAT_MODEL_RUNNER=v1" in message
    assert "could not patch" not in message
