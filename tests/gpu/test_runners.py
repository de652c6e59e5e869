"""Unchanged speculators extraction under each model runner (V1 and V2), against transformers and against each other.

``VLLM_COMPAT_MODEL_RUNNER=v1|v2`` picks the runner; each test asserts, from inside the workers, which runner class
ran. Per runner: several sequences of different lengths (2 to 2047 tokens), a step budget of ``SPLIT_BUDGET`` tokens
(smaller than the longer prompts, so the scheduler prefills them over several steps), five calls in a row (the first
one again at the end), the first and the last layer (conftest.LAYERS), bf16 states compared with transformers' bf16
forward within the bound of conftest.py. Then the two runners' states for the same calls on the same engine settings
and weights: the same kernels run the same steps (the scheduler is the parent's, the same for both), so bit-identical
states are expected; what is asserted is the bf16 bound, and whether they were bit-identical is recorded.

The speculators line is the one on ``sys.path`` (run once per line). With ``VLLM_COMPAT_GPU_TESTS_ON_CPU=1`` the V1 half
runs on vLLM's CPU build (to prove the harness); V2 is skipped there: it needs Triton on a GPU.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.gpu.conftest import ABS_TOL, ON_CPU, REL_TOL, compare, record, run_extract
from tests.gpu.test_extraction import _check

pytestmark = pytest.mark.gpu

RUNNER_CLASSES = {
    "v1": "vllm.v1.worker.gpu_model_runner.GPUModelRunner",
    "v2": "vllm.v1.worker.gpu.model_runner.GPUModelRunner",
}
SPLIT_BUDGET = 512  # tokens per step: below the 700-, 1000- and 2047-token prompts, above max_num_seqs (32)
_RUNS: dict[str, Any] = {}


def runner_calls(calls: list[list[list[int]]]) -> list[list[list[int]]]:
    """conftest's first three calls (5, 3 and 12 sequences of 2 to 1000 tokens), two long prompts, the first again."""
    longest, long = calls[3][-1], calls[3][0]  # 2047 and 700 tokens
    return [calls[0], calls[1], calls[2], [longest, long], calls[0]]


def extraction(runner: str, model_dir, calls, tmp_path_factory) -> Any:
    """One extraction per runner and session (the comparison between runners reuses both)."""
    if runner == "v2" and ON_CPU:
        pytest.skip("Model Runner V2 needs Triton on a GPU; vLLM's CPU builds run Model Runner V1 only")
    if runner not in _RUNS:
        tmp = tmp_path_factory.mktemp(f"runner-{runner}")
        run = run_extract(
            model_dir,
            runner_calls(calls),
            tmp,
            env={"VLLM_COMPAT_MODEL_RUNNER": runner},
            extra_args=["--max-num-batched-tokens", str(SPLIT_BUDGET)],
        )
        _RUNS[runner] = run
    return _RUNS[runner]


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_states_match_transformers_under_each_runner(runner, model_dir, calls, reference, tmp_path_factory) -> None:
    run = extraction(runner, model_dir, calls, tmp_path_factory)
    assert run.returncode == 0, run.stderr
    other = RUNNER_CLASSES["v2" if runner == "v1" else "v1"]
    for worker in run.data["workers"]:  # the runner class or a subclass (vLLM's CPU platform: CPUModelRunner)
        ran = worker["runner"]
        assert RUNNER_CLASSES[runner] in ran and other not in ran, f"asked for {runner}, a worker ran {ran}"
    parent, worker = set(run.data["status"]["applied"]), set(run.data["workers"][0]["applied"])
    if runner == "v2":
        assert "model-runner-v2" in parent and "model-runner-v1" not in parent, parent
        assert "v2-batch-layout" in worker, worker
    else:
        assert "model-runner-v2" not in parent and "v2-batch-layout" not in worker, (parent, worker)
    asked = runner_calls(calls)
    assert run.data["max_num_batched_tokens"] == SPLIT_BUDGET
    assert max(len(ids) for call in asked for ids in call) > SPLIT_BUDGET  # so some prompt spans several steps
    cmp = compare(run.data["outputs"], asked, reference)
    first, again = run.data["outputs"][0], run.data["outputs"][-1]
    repeat = max(
        (x.float() - y.float()).abs().max().item()
        for a, b in zip(first, again, strict=True)
        for x, y in zip(a["hidden_states"], b["hidden_states"], strict=True)
    )
    record(f"runner {runner}: workers ran", run.data["workers"][0]["runner"][0])
    record(f"runner {runner}: comparison", cmp.as_dict())
    record(f"runner {runner}: repeated call max abs diff to its first run", repeat)
    record(f"runner {runner}: init_seconds", round(run.data["init_seconds"], 1))
    record(f"runner {runner}: call_seconds", [round(s, 3) for s in run.data["call_seconds"]])
    record(f"runner {runner}: applied", sorted(parent))
    record(f"runner {runner}: worker_applied", sorted(worker))
    _check(cmp)


def test_both_runners_return_the_same_states(model_dir, calls, tmp_path_factory) -> None:
    """Same calls, same weights, same engine settings, V1 against V2: within the bf16 bound of each state (conftest),
    and recorded whether bit-identical."""
    v1 = extraction("v1", model_dir, calls, tmp_path_factory)
    v2 = extraction("v2", model_dir, calls, tmp_path_factory)
    assert v1.returncode == 0 and v2.returncode == 0, (v1.stderr, v2.stderr)
    tensors = identical = 0
    worst_ratio = max_abs = 0.0
    for call_v1, call_v2 in zip(v1.data["outputs"], v2.data["outputs"], strict=True):
        for a, b in zip(call_v1, call_v2, strict=True):
            assert a["input_ids"].tolist() == b["input_ids"].tolist()
            for x, y in zip(a["hidden_states"], b["hidden_states"], strict=True):
                assert x.shape == y.shape and x.dtype == y.dtype
                tensors += 1
                identical += bool((x == y).all())
                diff = (x.float() - y.float()).abs().max().item()
                max_abs = max(max_abs, diff)
                worst_ratio = max(worst_ratio, diff / (REL_TOL * x.float().abs().max().item() + ABS_TOL))
    record(
        "runners v1 vs v2",
        {
            "tensors": tensors,
            "bit_identical": identical,
            "max_abs_diff": max_abs,
            "worst_ratio_to_bf16_bound": round(worst_ratio, 6),
        },
    )
    assert worst_ratio <= 1.0, f"V1 and V2 states differ beyond the bf16 bound (worst ratio {worst_ratio:.2f})"
