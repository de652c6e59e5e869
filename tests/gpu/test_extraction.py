"""Unchanged speculators extraction on a real GPU engine, compared with transformers (bf16) on the same weights.

The checks of tests/e2e on vLLM's CUDA build: several sequences of different lengths, prompts split across steps,
repeated calls, the first and the last layer, results in input order; see conftest.py for the tolerance and why.
``VLLM_COMPAT_GPU_REPORT=FILE`` collects the measured numbers as JSON.
"""

from __future__ import annotations

import pytest

from tests.e2e.test_extraction import assert_workers_hold_only_the_last_call
from tests.gpu.conftest import ABS_TOL, REL_TOL, compare, record, run_extract, speculators_version

pytestmark = pytest.mark.gpu


def _check(cmp) -> None:
    assert cmp.worst_ratio <= 1.0, (
        f"max|diff| exceeds {REL_TOL} * max|ref| + {ABS_TOL} (worst ratio {cmp.worst_ratio:.2f}, {cmp.as_dict()})"
    )
    assert cmp.shifted_min_ratio > 1.0, f"the tolerance would not catch a one-row shift ({cmp.as_dict()})"
    # vLLM's bf16 is as close to the float32 forward as transformers' bf16 (within 2x, on the mean)
    assert cmp.vllm_vs_fp32_mean_rel <= 2 * cmp.hf_bf16_vs_fp32_mean_rel + 1e-3, cmp.as_dict()


def test_states_match_transformers(model_dir, calls, reference, tmp_path) -> None:
    """Plugin route: mixed lengths, repeated calls, >10 sequences, prompts split across steps, first/last layer.

    The first call comes again at the end, after the long one: same states, within the tolerance, and the
    repetition's largest difference to its first run is recorded.
    """
    calls = [*calls, calls[0]]
    run = run_extract(model_dir, calls, tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.data["vllm_dtype"] == "torch.bfloat16"
    cmp = compare(run.data["outputs"], calls, reference)
    first, again = run.data["outputs"][0], run.data["outputs"][-1]
    repeat = max(
        (x.float() - y.float()).abs().max().item()
        for a, b in zip(first, again, strict=True)
        for x, y in zip(a["hidden_states"], b["hidden_states"], strict=True)
    )
    assert run.data["status"]["speculators_version"] == speculators_version()
    record("comparison", cmp.as_dict())
    record("repeated call max abs diff to its first run", repeat)
    record("init_seconds", round(run.data["init_seconds"], 1))
    record("call_seconds", [round(s, 3) for s in run.data["call_seconds"]])
    record("tokens per call", [sum(map(len, call)) for call in calls])
    record("applied", sorted(run.data["status"]["applied"]))
    record("worker_applied", sorted(run.data["workers"][0]["applied"]))
    _check(cmp)
    assert run.data["workers"], "no worker answered"
    for worker in run.data["workers"]:
        assert worker["pid"] != run.data["status"]["pid"]
        assert worker["plugin_loaded"] and worker["installed"]
        assert worker["extensions"] == ["speculators.data_generation.custom_worker.HiddenStatesWorkerExtension"]
    record("requests held by the workers after the calls", [len(w["requests_held"] or ()) for w in run.data["workers"]])
    assert_workers_hold_only_the_last_call(run.data)  # Model Runner V2's request slots: see adapters/scheduler.py


def test_fallback_extension_without_plugin(model_dir, calls, reference, tmp_path) -> None:
    """VLLM_PLUGINS filters vllm-compat's plugin out: the worker-extension fallback carries the adapters."""
    run = run_extract(model_dir, calls[:2], tmp_path, env={"VLLM_PLUGINS": "none"})
    assert run.returncode == 0, run.stderr
    assert run.data["worker_extension_cls"] == "vllm_compat.worker.HiddenStatesWorkerExtension"
    for worker in run.data["workers"]:
        assert not worker["plugin_loaded"] and worker["installed"]
        assert "vllm_compat.worker.HiddenStatesWorkerExtension" in worker["extensions"]
    cmp = compare(run.data["outputs"], calls[:2], reference)
    record("fallback comparison", cmp.as_dict())
    _check(cmp)


def test_without_vllm_compat_it_breaks(model_dir, calls, reference, tmp_path) -> None:
    """The same script without vllm-compat fails or returns wrong states: the adapters do the work."""
    run = run_extract(model_dir, calls, tmp_path, compat=False)
    if run.returncode != 0:
        last = [line for line in run.stderr.strip().splitlines() if line.strip()][-1:]
        record("without_compat", f"fails: {last[0] if last else run.returncode}")
        return
    try:
        cmp = compare(run.data["outputs"], calls, reference)
    except AssertionError as exc:
        record("without_compat", f"wrong results: {exc}")
        return
    record("without_compat", f"worst ratio {cmp.worst_ratio:.2f} ({cmp.as_dict()})")
    assert cmp.worst_ratio > 1.0, "without vllm-compat the states were right: this release needs no adapter"
