"""Bad input to the adapted generator on a real engine: a clear error, and the engine still usable afterwards.

One generator for the whole module (tests/e2e/robustness.py ``inputs``, in its own interpreter and session): every
bad input below, each followed by a valid call that must return correct shapes; then a worker process is killed
while ``generate()`` runs, which must fail within a bounded time with a clear error and leave no worker running.
The messages the user sees are asserted exactly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import procs

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent
MAX_MODEL_LEN = 2048
VOCAB = 512  # tests/e2e/tiny_model.py
G = "VllmHiddenStatesGenerator.generate(token_ids)"
GONE = (
    "vLLM's executor is shut down (a worker process died, or executor.shutdown() was called), so this generator "
    "cannot run again. Create a new VllmHiddenStatesGenerator; the log above names the worker that died."
)
# case -> (exception type, exact message)
ERRORS = {
    "empty_batch": ("builtins.ValueError", f"{G}: the batch is empty; pass at least one sequence of token ids"),
    "empty_batch_tensor": ("builtins.ValueError", f"{G}: the batch is empty (shape (0, 4)); pass a sequence"),
    "empty_sequence": (
        "builtins.ValueError",
        f"{G}: sequence 0 is empty; every sequence needs at least one token (vLLM's scheduler cannot run an empty "
        "prompt)",
    ),
    "empty_sequence_in_batch": (
        "builtins.ValueError",
        f"{G}: sequence 1 is empty; every sequence needs at least one token (vLLM's scheduler cannot run an empty "
        "prompt)",
    ),
    "token_id_too_large": (
        "builtins.ValueError",
        f"{G}: sequence 0 holds token id {VOCAB + 10} at position 2, outside the model's vocabulary [0, {VOCAB})",
    ),
    "token_id_negative": (
        "builtins.ValueError",
        f"{G}: sequence 0 holds token id -1 at position 1, outside the model's vocabulary [0, {VOCAB})",
    ),
    "token_id_not_an_int": (
        "builtins.TypeError",
        f"{G}: sequence 0 holds '6' (str) at position 1; token ids must be ints",
    ),
    "float_tensor": (
        "builtins.TypeError",
        f"{G}: a tensor of token ids must have an integer dtype; got torch.float32",
    ),
    "rank1_tensor": (
        "builtins.ValueError",
        f"{G}: a tensor of token ids must have shape [batch, seq_len]; got shape (3,)",
    ),
    "rank3_tensor": (
        "builtins.ValueError",
        f"{G}: a tensor of token ids must have shape [batch, seq_len]; got shape (1, 2, 3)",
    ),
    "flat_list": (
        "builtins.TypeError",
        f"{G}: item 0 is 5 (int), not a sequence (a single sequence must be wrapped in a list: generate([ids]))",
    ),
}


def states_files() -> set[str]:
    """Files of vllm-compat in /dev/shm: none should ever exist (the hand-over's memory has no name)."""
    shm = "/dev/shm"
    return {n for n in os.listdir(shm) if "vllm_compat" in n or "vllm-compat" in n} if os.path.isdir(shm) else set()


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bad-input") / "inputs.json"
    before = states_files()
    record = procs.run_robustness("inputs", tiny_model, out, ["--max-model-len", str(MAX_MODEL_LEN)])
    record["states_files_left"] = sorted(states_files() - before)
    assert record["cases"]["start"]["outcome"] == "ok", record["cases"]["start"]
    return record


def assert_still_usable(found: dict[str, Any]) -> None:
    after = found["after"]
    assert after["outcome"] == "ok" and after["valid_results"], after
    assert len(after["workers"]) >= 1  # the same engine, still running


def test_a_valid_call(run) -> None:
    found = procs.case(run, "valid")
    assert found["outcome"] == "ok"
    assert [r["input_len"] for r in found["result"]] == [4, 3]
    assert_still_usable(found)


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_bad_input_gives_a_clear_error_and_the_engine_stays_usable(run, name: str) -> None:
    found = procs.case(run, name)
    error_type, message = ERRORS[name]
    assert (found["outcome"], found.get("error_type"), found.get("message")) == ("error", error_type, message)
    assert found["seconds"] < 5, "checked before any request reached vLLM"
    assert_still_usable(found)


def test_tuples_are_taken_as_lists(run) -> None:
    """A tuple of tuples passed the check, then failed inside vLLM's Request with AttributeError."""
    found = procs.case(run, "tuples")
    assert found["outcome"] == "ok", found.get("message")
    assert [r["input_len"] for r in found["result"]] == [3, 2]
    assert_still_usable(found)


def test_a_sequence_longer_than_max_model_len_is_truncated(run) -> None:
    """speculators' own behaviour, kept: each sequence is cut to max_model_len - 1 tokens (one is left for the
    sampled token vLLM insists on), and the states cover exactly the kept tokens."""
    found = procs.case(run, "longer_than_max_model_len")
    assert found["outcome"] == "ok", found.get("message")
    (result,) = found["result"]
    assert result["input_len"] == MAX_MODEL_LEN - 1
    assert all(shape[0] == MAX_MODEL_LEN - 1 for shape in result["shapes"])
    assert_still_usable(found)


def test_more_sequences_than_max_num_seqs(run) -> None:
    """40 sequences in one call, more than the 32 speculators lets vLLM's scheduler run at once. speculators 0.3.0
    aborts each request after its step, so all 40 are served; 0.4.0.1 kept the first 32 running until the end and
    raised "Request req_N_32 not found in captured states" until vllm-compat ran such calls in waves
    (``batches-in-waves``). Both lines return every sequence, and the generator stays usable."""
    found = procs.case(run, "more_sequences_than_max_num_seqs")
    assert found["outcome"] == "ok", found.get("message")
    assert len(found["result"]) == 40
    assert all(r["input_len"] == 3 for r in found["result"])
    assert_still_usable(found)


def test_a_worker_killed_during_generate(run) -> None:
    found = procs.case(run, "worker_killed")
    assert found["killed_while_running"], "the worker died after generate() had returned: nothing was tested"
    assert (found["outcome"], found.get("error_type")) == ("error", "builtins.RuntimeError")
    assert found["message"] == f"{G} failed: {GONE}"
    assert found["seconds"] < 120, "generate() took too long to notice the dead worker"
    assert found["workers_after"] == [], "vLLM workers still running after the failure"
    nxt = found["next_call"]
    assert (nxt["outcome"], nxt.get("message")) == ("error", f"{G}: {GONE}") and nxt["seconds"] < 5
    assert found["shutdown"]["outcome"] == "ok" and found["workers_after_shutdown"] == []


def test_no_process_is_left_behind(run) -> None:
    assert run["workers_at_exit"] == []
    assert run["left"] == [], "processes of the test's session outlived it"
    assert run["exit"] == 0


def test_no_states_file_is_left_behind(run) -> None:
    """The killed worker's spare file is removed by the generator's process (its owner is provably dead)."""
    assert run["states_files_left"] == []
