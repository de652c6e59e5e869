"""finished-ids-to-next-step on a stand-in scheduler: what it hands on, to which output, and its lifecycle.

Its effect on V2's real slot bookkeeping (vLLM 0.34.0's own code, steps recorded from vLLM's real scheduler):
tests/drift/test_v2_request_slots.py; on a real engine: tests/e2e/test_extraction.py (what the workers still hold).
"""

from __future__ import annotations

import types
from typing import Any

import pytest
from vllm_compat.adapters.scheduler import FinishedIdsToNextStep

from vllm_compat.adapter import Adapter
from vllm_compat.errors import AdapterError


def output(tokens: int, finished: Any = (), preempted: Any = ()) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        total_num_scheduled_tokens=tokens,
        scheduled_new_reqs=[],
        finished_req_ids=set(finished) if isinstance(finished, tuple | list) else finished,
        preempted_req_ids=set(preempted) if isinstance(preempted, tuple | list) else preempted,
    )


def generator_module(outputs: list[types.SimpleNamespace]) -> types.ModuleType:
    module = types.ModuleType("stand_in_generator")

    class Scheduler:
        def __init__(self) -> None:
            self.outputs = iter(outputs)

        def schedule(self) -> types.SimpleNamespace:
            return next(self.outputs)

    module.Scheduler = Scheduler
    return module


@pytest.fixture
def adapter() -> Any:
    applied = FinishedIdsToNextStep()
    yield applied
    applied.revert()


def test_ids_of_an_output_with_nothing_to_run_go_with_the_next_one(adapter: Adapter) -> None:
    module = generator_module(
        [output(10, finished={"a"}), output(0, finished={"b", "c"}, preempted={"p"}), output(7, finished={"d"})]
    )
    adapter.apply(module)
    scheduler = module.Scheduler()
    first, empty, nxt = scheduler.schedule(), scheduler.schedule(), scheduler.schedule()
    assert first.finished_req_ids == {"a"}, "an output with tokens is left as it is"
    assert empty.finished_req_ids == {"b", "c"}
    assert nxt.finished_req_ids == {"b", "c", "d"} and nxt.preempted_req_ids == {"p"}


def test_ids_kept_across_several_empty_outputs_and_none_for_preempted(adapter: Adapter) -> None:
    module = generator_module([output(0, finished={"a"}, preempted=None), output(0, finished={"b"}), output(3)])
    adapter.apply(module)
    scheduler = module.Scheduler()
    scheduler.schedule(), scheduler.schedule()
    last = scheduler.schedule()
    assert last.finished_req_ids == {"a", "b"} and not last.preempted_req_ids


def test_reverted_the_scheduler_hands_out_its_outputs_unchanged(adapter: Adapter) -> None:
    module = generator_module([output(0, finished={"a"}), output(3)])
    adapter.apply(module)
    scheduler = module.Scheduler()  # built while applied: its schedule() is wrapped
    adapter.revert()
    scheduler.schedule()
    assert scheduler.schedule().finished_req_ids == set()
    assert module.Scheduler().schedule.__func__ is module.Scheduler.schedule, "new schedulers are not wrapped"


def test_an_output_of_another_shape_is_refused(adapter: Adapter) -> None:
    module = generator_module([types.SimpleNamespace(total_num_scheduled_tokens=0, finished_req_ids=["a"])])
    adapter.apply(module)
    scheduler = module.Scheduler()
    with pytest.raises(AdapterError, match="finished_req_ids is list"):
        scheduler.schedule()


def test_serves_speculators_0_3_only() -> None:
    assert FinishedIdsToNextStep.serves("0.3.0") and not FinishedIdsToNextStep.serves("0.4.0.1")
    assert FinishedIdsToNextStep.always and FinishedIdsToNextStep.side == "parent"
