"""Unchanged speculators extraction on a real vLLM engine, compared with transformers on the same weights."""

from __future__ import annotations

import os
import random

import pytest
from packaging.version import Version

from tests.e2e.conftest import TOLERANCE, max_diff, run_extract, transformers_states
from tests.e2e.report import record
from vllm_compat.versions import installed_version

pytestmark = pytest.mark.e2e


def test_states_match_transformers(tiny_model, calls, reference, tmp_path) -> None:
    """Plugin route: several sequences, a second call, >10 sequences, prompts split across steps."""
    run = run_extract(tiny_model, calls, tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.data["vllm_dtype"] == "torch.float32"
    diff = max_diff(run.data["outputs"], calls, reference)
    record("max_abs_diff", diff)
    record("init_seconds", run.data["init_seconds"])
    record("call_seconds", run.data["call_seconds"])
    record("applied", sorted(run.data["status"]["applied"]))
    record("worker_applied", sorted(run.data["workers"][0]["applied"]))
    assert diff < TOLERANCE
    assert not run.data["prefix_caching"] and not run.data["block_hasher"], "no block hashes for a cache that is off"
    # the generator sent each step before the last one's reply: two in flight (a call's prompts span several steps),
    # from vLLM 0.11.1 on (0.11.0 runs a step in one execute_model() call: one at a time, as speculators does)
    two_phase = installed_version("vllm") >= Version("0.11.1")
    assert run.data["steps_in_flight"] == ({"depth": 2, "peak": 2} if two_phase else None), run.data["steps_in_flight"]
    # the plugin route: every worker is another process in which the entry point installed vllm-compat
    assert run.data["workers"], "no worker answered"
    for worker in run.data["workers"]:
        assert worker["pid"] != run.data["status"]["pid"]
        assert worker["plugin_loaded"] and worker["installed"]
        assert worker["extensions"] == ["speculators.data_generation.custom_worker.HiddenStatesWorkerExtension"], worker
    assert_route(run.data, "plugin", "the vllm_compat entry point")
    assert_variables_reach_the_workers_only(run.data)
    assert_workers_hold_only_the_last_call(run.data)


def assert_workers_hold_only_the_last_call(data: dict) -> None:
    """After the calls, the workers keep state only for requests of the last call (whose finished ids go with the next
    step): every request the generator finished reached them as finished by the next call's first step. Model Runner
    V2 frees a request's slot only then, and speculators 0.3.0 alone never tells them of a call's last step's requests
    (finished-ids-to-next-step); V1 keeps those requests' cached states for good."""
    last = f"req_{data['request_counter'] - 1}_"
    for worker in data["workers"]:
        held = worker["requests_held"]
        assert held is not None, worker["runner"]
        stale = [r for r in held if not r.startswith(last)]
        assert not stale, f"the worker still holds {len(stale)} requests of earlier calls: {stale[:8]}"


def assert_route(data: dict, route: str, said: str) -> None:
    """status() names the route taken, in the generator's process and in each worker, and the summary says it."""
    assert data["status"]["worker_route"] == route, data["status"]
    assert [w["worker_route"] for w in data["workers"]] == [route] * len(data["workers"])
    summary = [m for m in data["compat_log"] if m.startswith("INFO vllm-compat: vLLM ")]
    assert len(summary) == 1 and f"workers reached through {said}" in summary[0], data["compat_log"]
    assert "worker-extension-fallback" not in summary[0].split("; workers reached through")[0]


def assert_variables_reach_the_workers_only(data: dict) -> None:
    """VLLM_COMPAT_ACTIVE and the runner adapter's VLLM_USE_V2_MODEL_RUNNER (0 or 1) are set while the generator starts
    its workers: the workers have them, and the script's environment is as it was after the import and the shutdown
    (an unrelated child it starts, such as `vllm serve`, inherits neither)."""
    env = data["env"]
    assert env["after_import"] == env["start"] and env["after_shutdown"] == env["start"], env
    applied = data["status"]["applied"]
    pinned = "0" if "model-runner-v1" in applied else "1" if "model-runner-v2" in applied else None
    for worker in data["workers"]:
        assert worker["env"]["VLLM_COMPAT_ACTIVE"] == "1", worker["env"]
        assert worker["env"]["VLLM_USE_V2_MODEL_RUNNER"] == (pinned or env["start"]["VLLM_USE_V2_MODEL_RUNNER"])


def test_one_step_at_a_time_where_asked(tiny_model, calls, reference, tmp_path) -> None:
    """``VLLM_COMPAT_STEPS_IN_FLIGHT=1``: the generator waits for each step's reply, as speculators alone does; the
    states are the same as with two steps in flight (test_states_match_transformers)."""
    run = run_extract(tiny_model, calls, tmp_path, env={"VLLM_COMPAT_STEPS_IN_FLIGHT": "1"})
    assert run.returncode == 0, run.stderr
    assert run.data["steps_in_flight"] is None
    diff = max_diff(run.data["outputs"], calls, reference)
    record("one_step_at_a_time_max_abs_diff", diff)
    assert diff < TOLERANCE


def test_fallback_extension_without_plugin(tiny_model, calls, reference, tmp_path) -> None:
    """VLLM_PLUGINS filters vllm-compat's plugin out: the worker-extension fallback carries the adapters."""
    run = run_extract(tiny_model, calls[:2], tmp_path, env={"VLLM_PLUGINS": "none"})
    assert run.returncode == 0, run.stderr
    assert run.data["worker_extension_cls"] == "vllm_compat.worker.HiddenStatesWorkerExtension"
    for worker in run.data["workers"]:
        assert not worker["plugin_loaded"] and worker["installed"]
        assert "vllm_compat.worker.HiddenStatesWorkerExtension" in worker["extensions"], worker
    assert_route(run.data, "worker-extension-fallback", "vllm_compat.worker.HiddenStatesWorkerExtension")
    diff = max_diff(run.data["outputs"], calls[:2], reference)
    record("fallback_max_abs_diff", diff)
    assert diff < TOLERANCE
    assert_variables_reach_the_workers_only(run.data)


def test_without_vllm_compat_it_breaks(tiny_model, calls, reference, tmp_path) -> None:
    """The same script without vllm-compat fails or returns wrong states: the adapters do the work."""
    run = run_extract(tiny_model, calls, tmp_path, compat=False)
    if run.returncode != 0:
        last = [line for line in run.stderr.strip().splitlines() if line.strip()][-1:]
        record("without_compat", f"fails: {last[0] if last else run.returncode}")
        return
    try:
        diff = max_diff(run.data["outputs"], calls, reference)
    except AssertionError as exc:
        record("without_compat", f"wrong results: {exc}")
        return
    record("without_compat", f"max abs diff {diff:.2e}")
    assert diff >= TOLERANCE, "without vllm-compat the states were right: this release needs no adapter"


def test_tensor_parallel_2(tiny_model, calls, reference, tmp_path) -> None:
    """tensor_parallel_size=2: both workers get the adapters, rank 0 captures, states still match transformers."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two CPU cores for two CPU workers")
    # vLLM's CPU workers bind their threads to NUMA nodes; with one node, name one core per rank instead
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}|{cores[1]}"}
    run = run_extract(tiny_model, calls[:2], tmp_path, env=env, extra_args=["--tp", "2"])
    assert run.returncode == 0, run.stderr
    assert len(run.data["workers"]) == 2
    assert all(w["plugin_loaded"] and w["installed"] for w in run.data["workers"])
    assert len({w["pid"] for w in run.data["workers"]}) == 2
    diff = max_diff(run.data["outputs"], calls[:2], reference)
    record("tp2_max_abs_diff", diff)
    assert diff < TOLERANCE


MAX_NUM_SEQS = 32  # the scheduler limit both speculators lines build their generator with


def test_any_batch_size(tiny_model, tmp_path) -> None:
    """Calls of 1, 32, 33 and 2*32+3 sequences: every sequence's states, in input order, equal to transformers'.

    speculators 0.4.0.1 alone fails from 33 sequences on (its first 32 requests keep every scheduler slot); 0.3.0
    frees a slot per finished request.
    """
    rng = random.Random(4321)
    sizes = (1, MAX_NUM_SEQS, MAX_NUM_SEQS + 1, 2 * MAX_NUM_SEQS + 3)
    calls = [[[rng.randrange(4, 512) for _ in range(rng.randrange(2, 40))] for _ in range(n)] for n in sizes]
    run = run_extract(tiny_model, calls, tmp_path)
    assert run.returncode == 0, run.stderr
    assert [len(results) for results in run.data["outputs"]] == list(sizes)
    diff = max_diff(run.data["outputs"], calls, transformers_states(tiny_model, calls))
    record("batch_sizes_max_abs_diff", diff)
    record("batch_sizes_call_seconds", run.data["call_seconds"])
    assert diff < TOLERANCE


def test_the_line_is_judged_from_the_code(tiny_model, calls, reference, tmp_path) -> None:
    """The other line's metadata first on PYTHONPATH (as when a source tree of one release shadows another that is
    installed): the code that runs decides which adapters apply, in the script and in every worker, and says so."""
    from vllm_compat.lines import judge_line

    code = judge_line()
    assert code.how == "code", code.describe()
    other = {"0.3.0": "0.4.0.1", "0.4.0.1": "0.3.0"}[code.line]
    metadata = tmp_path / "metadata"
    info = metadata / f"speculators-{other}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: speculators\nVersion: {other}\n")
    path = os.pathsep.join(p for p in (str(metadata), os.environ.get("PYTHONPATH", "")) if p)
    run = run_extract(tiny_model, calls[:2], tmp_path, env={"PYTHONPATH": path}, extra_args=["--log-level", "INFO"])
    assert run.returncode == 0, run.stderr
    status = run.data["status"]
    assert status["speculators_version"] == other, "the fake metadata was not the one installed"
    assert (status["speculators_line"], status["speculators_line_judged"]) == (code.line, "code")
    for worker in run.data["workers"]:
        assert worker["pid"] != status["pid"]
        assert (worker["speculators_line"], worker["speculators_line_judged"]) == (code.line, "code"), worker
    log = run.data["compat_log"]
    assert any(m.startswith("WARNING") and "the code wins" in m and f"says speculators {other}" in m for m in log)
    summary = [m for m in log if m.startswith("INFO vllm-compat: vLLM ")]
    assert len(summary) == 1, log
    assert f"speculators {other} (line {code.line}, judged from its code" in summary[0]
    assert "drift(s) covered by" in summary[0] and "0 unhandled" in summary[0]
    diff = max_diff(run.data["outputs"], calls[:2], reference)
    record("line_from_code_max_abs_diff", diff)
    assert diff < TOLERANCE
