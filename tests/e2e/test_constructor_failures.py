"""Bad arguments to the adapted generator's constructor on a real vLLM: a clear error, and no worker left running.

All cases run in one interpreter and session (tests/e2e/robustness.py ``constructor``), one at a time. Most fail
before anything loads; ``kv_cache_too_small`` fails after vLLM's executor started its workers (KV-cache planning
gets a budget of 0 bytes), and the workers must be gone at once even though the caller still holds the exception
and, through its traceback, the half-built generator.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import procs

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent

# case -> (exception type, exact message); repeated layer ids are served, not refused (tests/e2e/test_layer_ids.py)
ERRORS = {
    "layer_out_of_range": ("builtins.ValueError", "Layer index 7 out of bounds [0, 3]"),  # speculators' own check
    "layer_negative": ("builtins.ValueError", "Layer index -1 out of bounds [0, 3]"),  # speculators' own check
    "layer_ids_empty": (
        "builtins.ValueError",
        "VllmHiddenStatesGenerator(layer_ids=[]): no layer requested; pass at least one layer index, or None for the "
        "default layers",
    ),
    "layer_id_not_an_int": (
        "builtins.ValueError",
        "VllmHiddenStatesGenerator(layer_ids=[1.5]): item 0 is 1.5 (float), not a layer index; layer ids must be ints",
    ),
    "model_path_missing": (
        "builtins.FileNotFoundError",
        "VllmHiddenStatesGenerator(model_path='/nonexistent/vllm-compat-test/model'): no such file or folder. Pass "
        "a local model folder or a Hugging Face model id (org/name).",
    ),
}


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("constructor") / "constructor.json"
    record = procs.run_robustness("constructor", tiny_model, out)
    return record


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_rejected_before_anything_loads(run, name: str) -> None:
    found = procs.case(run, name)
    error_type, message = ERRORS[name]
    assert (found["outcome"], found.get("error_type"), found.get("message")) == ("error", error_type, message)
    assert found["workers_after"] == []
    assert "MultiprocExecutor" not in found["trace"], "the executor was started"


def test_a_failure_after_the_workers_started_shuts_them_down(run) -> None:
    found = procs.case(run, "kv_cache_too_small")
    assert found["outcome"] == "error", "a 0-byte KV-cache budget must fail"
    # vLLM's own checks: `assert num_gpu_blocks is not None and num_gpu_blocks > 0` in its Scheduler (no message),
    # or, in releases that check it while planning, a ValueError about the available memory
    assert found["error_type"] in {"builtins.AssertionError", "builtins.ValueError"}, found["trace"]
    if sys.version_info >= (3, 11):  # the note says the workers were running, and were shut down
        assert found["notes"] == [
            "vllm-compat: the generator's constructor failed after vLLM's workers had started; they were shut down."
        ]
    assert found["workers_after"] == [], "workers outlived the failed constructor"


def test_no_process_is_left_behind(run) -> None:
    assert run["workers_at_exit"] == [] and run["left"] == [] and run["exit"] == 0
