"""vllm_compat.batch_order: the rows of a step, under each runner's shape, and the V2 layout recorder's wiring.

Unit tests on stand-ins that have exactly the attributes the code reads (the facts those attributes stand for are
probed on every release in tests/drift/test_model_runners.py). That the real runners give the states of the right
request is proven end to end: tests/e2e (V1, vLLM's CPU builds) and tests/gpu/test_runners.py (V1 and V2, on a GPU).
"""

from __future__ import annotations

import types
from types import SimpleNamespace

import pytest

from vllm_compat import batch_order
from vllm_compat.errors import AdapterError


def step(scheduled: dict[str, int], new: dict[str, int] | None = None) -> SimpleNamespace:
    news = [SimpleNamespace(req_id=r, prompt_token_ids=list(range(n))) for r, n in (new or {}).items()]
    return SimpleNamespace(num_scheduled_tokens=scheduled, scheduled_new_reqs=news)


class V2Runner:
    """What vllm_compat reads of Model Runner V2: ``req_states.req_id_to_index``, ``prepare_inputs`` (sorting the
    step's requests by scheduled tokens, as V2 does), and an ``execute_model`` that prepares, then runs the model."""

    def __init__(self) -> None:
        self.req_states = SimpleNamespace(req_id_to_index={})
        self.pcp_manager = None
        self.ubatch_runner = None
        self.seen: list[batch_order.StepRows | None] = []

    def prepare_inputs(self, scheduler_output, batch_desc=None):
        counts = scheduler_output.num_scheduled_tokens
        ids = sorted(counts, key=counts.get)
        starts = [0]
        for rid in ids:
            starts.append(starts[-1] + counts[rid])
        return SimpleNamespace(
            req_ids=ids,
            num_reqs=len(ids),
            num_scheduled_tokens=[counts[r] for r in ids],
            query_start_loc_np=starts + [starts[-1]] * 3,
        )  # padded, as V2's buffer is

    def execute_model(self, scheduler_output, dummy_run: bool = False):
        if not dummy_run:
            for rid in scheduler_output.num_scheduled_tokens:
                self.req_states.req_id_to_index.setdefault(rid, len(self.req_states.req_id_to_index))
            self.prepare_inputs(scheduler_output, "desc")
        # the forward: speculators' patched forward asks for the layout here
        self.seen.append(batch_order.rows_of_step(self, scheduler_output))


def recording(runner: V2Runner) -> V2Runner:
    import wrapt

    runner.prepare_inputs = wrapt.FunctionWrapper(runner.prepare_inputs, batch_order.record_v2_steps())
    return runner


def test_v1_rows_follow_the_persistent_batch() -> None:
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["b", "a", "old", None], num_reqs=3))
    assert batch_order.rows_of_step(runner, step({"a": 3, "b": 5})) == [("b", 5), ("a", 3)]
    with pytest.raises(AdapterError, match="cannot attribute"):
        batch_order.rows_of_step(runner, step({"a": 3, "c": 1}))


def test_the_runner_is_told_by_what_it_has() -> None:
    assert batch_order.is_v2_runner(V2Runner())
    assert not batch_order.is_v2_runner(SimpleNamespace(input_batch=None, req_states=None, prepare_inputs=len))
    with pytest.raises(AdapterError, match="no capture path for this model runner"):
        batch_order.rows_of_step(SimpleNamespace(), step({"a": 1}))


def test_v2_rows_follow_the_batch_v2_prepared_for_that_step() -> None:
    runner = recording(V2Runner())
    first, second = step({"long": 7, "short": 2, "mid": 4}), step({"x": 1, "long": 3})
    runner.execute_model(first)
    runner.execute_model(second)
    assert runner.seen == [[("short", 2), ("mid", 4), ("long", 7)], [("x", 1), ("long", 3)]]


def test_v2_dummy_runs_capture_nothing() -> None:
    """V2's warm-up and profiling forwards go through execute_model(dummy_run=True) with requests it never holds."""
    runner = recording(V2Runner())
    runner.execute_model(step({"real": 3}))
    runner.execute_model(step({"_dummy_req_0": 8, "_dummy_req_1": 8}), dummy_run=True)
    assert runner.seen == [[("real", 3)], None]


def test_v2_without_a_recorded_layout_fails_closed() -> None:
    runner = V2Runner()  # nobody records: a real step's rows cannot be attributed
    with pytest.raises(AdapterError, match="not recorded"):
        runner.execute_model(step({"a": 2}))
    stale = recording(V2Runner())
    stale.execute_model(step({"a": 2}))
    with pytest.raises(AdapterError, match="not recorded"):  # the layout of another step is never used
        batch_order.rows_of_step(stale, step({"a": 2}))


def test_v2_layout_disagreeing_with_the_schedule_fails_closed() -> None:
    runner = recording(V2Runner())
    scheduled = step({"a": 2, "b": 3})
    runner.prepare_inputs(scheduled)
    scheduled.num_scheduled_tokens = {"a": 2, "b": 4}  # the scheduler's counts and the batch's rows differ
    with pytest.raises(AdapterError, match="cannot attribute"):
        batch_order.rows_of_step(runner, scheduled)


def test_v2_batch_whose_rows_are_not_contiguous_fails_closed() -> None:
    class Overlapping(V2Runner):
        def prepare_inputs(self, scheduler_output, batch_desc=None):
            return SimpleNamespace(req_ids=["a", "b"], num_reqs=2, query_start_loc_np=[0, 5, 3])

    runner = recording(Overlapping())
    with pytest.raises(AdapterError, match="one after another"):
        runner.execute_model(step({"a": 5, "b": 1}))


@pytest.mark.parametrize(("attribute", "what"), [("pcp_manager", "prefill context"), ("ubatch_runner", "micro")])
def test_v2_modes_that_split_a_step_are_refused(attribute: str, what: str) -> None:
    runner = recording(V2Runner())
    setattr(runner, attribute, object())
    with pytest.raises(AdapterError, match=what):
        runner.execute_model(step({"a": 1}))


def test_prompt_lengths_come_from_the_schedule() -> None:
    assert batch_order.prompt_lengths(step({"a": 2, "b": 1}, new={"a": 9})) == {"a": 9}
    assert batch_order.prompt_lengths(SimpleNamespace()) == {}


def test_the_worker_adapter_records_on_a_v2_runner_only_and_reverts(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_compat.adapters.model_runner import V2BatchLayout

    class HiddenStatesWorkerExtension:  # mixed into vLLM's worker: it has the worker's methods
        def _setup_hidden_states_capture(self, layer_ids):
            return layer_ids

        def compile_or_warm_up_model(self):
            """As V2's warm-up: steps of made-up requests through execute_model (they join req_states)."""
            self.model_runner.execute_model(step({"_warmup_0_": 2, "_warmup_1_": 2}))
            return "warm"

    module = types.ModuleType("fake_custom_worker")
    module.HiddenStatesWorkerExtension = HiddenStatesWorkerExtension
    adapter = V2BatchLayout()
    adapter.apply(module)
    v2, v1 = HiddenStatesWorkerExtension(), HiddenStatesWorkerExtension()
    v2.model_runner = V2Runner()
    v1.model_runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a"], num_reqs=1))
    v2._setup_hidden_states_capture([0])
    v2._setup_hidden_states_capture([0])  # twice on one runner: wrapped once
    v1._setup_hidden_states_capture([0])
    assert "prepare_inputs" in vars(v2.model_runner) and not hasattr(v1.model_runner, "prepare_inputs")
    assert v2.compile_or_warm_up_model() == "warm"
    v2.model_runner.execute_model(step({"a": 1, "b": 2}))
    assert v2.model_runner.seen == [None, [("a", 1), ("b", 2)]]  # the warm-up's step is no call's
    adapter.revert()
    assert "prepare_inputs" not in vars(v2.model_runner) and "compile_or_warm_up_model" not in vars(v2)
    assert HiddenStatesWorkerExtension._setup_hidden_states_capture(v1, [1]) == [1]
