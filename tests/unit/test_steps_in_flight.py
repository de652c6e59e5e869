"""steps-in-flight on a stand-in executor whose replies come back in order, as vLLM's MultiprocExecutor's do.

On a real engine, states against transformers: tests/e2e/test_extraction.py::test_states_match_transformers (two steps
in flight) and ::test_one_step_at_a_time_where_asked.
"""

from __future__ import annotations

import types
from concurrent.futures import Future

import pytest
from vllm_compat.adapters.executor import ENV_STEPS_IN_FLIGHT, SampleAfterExecute, StepsInFlight


class Worker:
    """Runs RPCs in the order they were sent, when the executor reads their replies; records what happened."""

    def __init__(self, fail: str | None = None) -> None:
        self.log: list[str] = []
        self.fail = fail

    def run(self, method: str, arg: object) -> object:
        self.log.append(f"ran {method} {arg}")
        if f"{method} {arg}" == self.fail:
            raise RuntimeError(f"Worker failed with error '{method} {arg} broke'")
        if method == "execute_model":
            return None  # the two-phase protocol: the step's output comes from sample_tokens()
        return {"method": method, "arg": arg}


def executor_module(worker: Worker, max_concurrent_batches: int = 2, non_block: bool = True) -> types.ModuleType:
    """A MultiprocExecutor shaped like vLLM's where it matters: non_block returns a future, and reading any reply
    first reads every earlier one (FutureWrapper's drain)."""
    module = types.ModuleType("stand_in_generator")

    class MultiprocExecutor:
        def __init__(self) -> None:
            self.queue: list[tuple[Future, str, object]] = []  # sent, replies not read yet: oldest first
            self.max_concurrent_batches = max_concurrent_batches

        def _read_until(self, future: Future) -> None:
            while not future.done():
                oldest, method, arg = self.queue.pop(0)
                worker.log.append(f"read {method} {arg}")
                try:
                    oldest.set_result(worker.run(method, arg))
                except RuntimeError as exc:
                    oldest.set_exception(exc)

        def collective_rpc(self, method: str, args: tuple = (), non_block: bool = False, **_kw: object) -> object:
            future: Future = Future()
            worker.log.append(f"sent {method} {args[0] if args else None}")
            self.queue.append((future, method, args[0] if args else None))
            if non_block:
                future.result = lambda timeout=None, f=future: (self._read_until(f), Future.result(f))[1]
                return future
            self._read_until(future)
            return future.result()

        if non_block:

            def execute_model(self, scheduler_output: object, non_block: bool = False) -> object:
                return self.collective_rpc("execute_model", args=(scheduler_output,), non_block=non_block)

            def sample_tokens(self, grammar_output: object, non_block: bool = False) -> object:
                return self.collective_rpc("sample_tokens", args=(grammar_output,), non_block=non_block)

        else:

            def execute_model(self, scheduler_output: object) -> object:
                return self.collective_rpc("execute_model", args=(scheduler_output,))

            def sample_tokens(self, grammar_output: object) -> object:
                return self.collective_rpc("sample_tokens", args=(grammar_output,))

    class VllmHiddenStatesGenerator:
        """speculators 0.4.0.1's loop where it matters: execute_model then sample_tokens(output), outputs unread."""

        def __init__(self) -> None:
            self.executor = module.MultiprocExecutor()

        def generate(self, steps: int) -> object:
            self.executor.collective_rpc("_reset_capture")
            for step in range(steps):
                output = self.executor.execute_model(step)
                self.executor.sample_tokens(output)
            return self.executor.collective_rpc("_get_captured_states")

    module.MultiprocExecutor = MultiprocExecutor
    module.VllmHiddenStatesGenerator = VllmHiddenStatesGenerator
    return module


@pytest.fixture()
def applied():
    adapters: list = []

    def apply(module: types.ModuleType, *more) -> types.ModuleType:
        for adapter in (StepsInFlight(), *more):  # the engine's order: steps-in-flight first (innermost)
            adapter.apply(module)
            adapters.append(adapter)
        return module

    yield apply
    for adapter in reversed(adapters):
        adapter.revert()


def test_the_next_step_is_sent_before_the_last_one_is_waited_for(applied) -> None:
    worker = Worker()
    generator = applied(executor_module(worker)).VllmHiddenStatesGenerator()
    assert generator.generate(3) == {"method": "_get_captured_states", "arg": None}
    log = worker.log
    # step 1 is sent before step 0's reply is read; step 2 before step 1's: two steps in flight, never three
    assert log.index("sent execute_model 1") < log.index("read sample_tokens None") < log.index("sent execute_model 2")
    in_flight = most = 0
    for event in log:
        if event.startswith("sent sample_tokens"):
            in_flight += 1
            most = max(most, in_flight)
        elif event.startswith("read sample_tokens"):
            in_flight -= 1
    assert most == 2
    # every step ran, in order, before the collect
    ran = [e for e in log if e.startswith("ran ")]
    assert ran[-1] == "ran _get_captured_states None"
    assert [e for e in ran if "execute_model" in e] == [
        "ran execute_model 0",
        "ran execute_model 1",
        "ran execute_model 2",
    ]
    assert not generator.executor._vllm_compat_steps.in_flight, "the collect waited for every step"


def test_without_the_adapter_each_step_is_waited_for() -> None:
    worker = Worker()
    executor_module(worker).VllmHiddenStatesGenerator().generate(2)
    assert worker.log.index("read sample_tokens None") < worker.log.index("sent execute_model 1")


def test_a_failed_step_raises_its_own_error_at_the_collect(applied) -> None:
    worker = Worker(fail="execute_model 2")
    generator = applied(executor_module(worker)).VllmHiddenStatesGenerator()
    with pytest.raises(RuntimeError, match="execute_model 2 broke"):
        generator.generate(3)
    assert "sent _get_captured_states None" not in worker.log, "the collect is not sent after a failed step"
    assert not generator.executor._vllm_compat_steps.in_flight
    worker.fail = None
    assert generator.generate(1)["method"] == "_get_captured_states", "the next call starts clean"


def test_a_failure_in_the_loop_leaves_no_step_in_flight(applied) -> None:
    worker = Worker()
    module = executor_module(worker)

    def generate(self, steps: int) -> object:
        self.executor.execute_model(0)
        self.executor.sample_tokens(None)
        raise KeyError("speculators' own bookkeeping")

    module.VllmHiddenStatesGenerator.generate = generate
    generator = applied(module).VllmHiddenStatesGenerator()
    with pytest.raises(KeyError):
        generator.generate(1)
    assert not generator.executor._vllm_compat_steps.in_flight
    assert "ran sample_tokens None" in worker.log, "the step in flight was waited for"


def test_speculators_030_through_sample_after_execute(applied) -> None:
    """0.3.0 calls execute_model() alone; sample-after-execute, outside, sends sample_tokens() on a None reply."""
    worker = Worker()
    module = applied(executor_module(worker), SampleAfterExecute())
    executor = module.MultiprocExecutor()
    for step in range(3):
        assert executor.execute_model(step) is None
    executor.collective_rpc("_get_captured_states")
    sent = [e for e in worker.log if e.startswith("sent ")]
    assert sent == [
        "sent execute_model 0",
        "sent sample_tokens None",
        "sent execute_model 1",
        "sent sample_tokens None",
        "sent execute_model 2",
        "sent sample_tokens None",
        "sent _get_captured_states None",
    ]
    assert worker.log.index("sent execute_model 1") < worker.log.index("read sample_tokens None")


@pytest.mark.parametrize(
    ("how", "expect_pipelined"),
    [("one batch at a time", True), ("no non_block", False), ("env 1", False), ("env 3", True)],
)
def test_where_it_changes_nothing(applied, monkeypatch: pytest.MonkeyPatch, how: str, expect_pipelined: bool) -> None:
    worker = Worker()
    if how == "env 1":
        monkeypatch.setenv(ENV_STEPS_IN_FLIGHT, "1")
    if how == "env 3":
        monkeypatch.setenv(ENV_STEPS_IN_FLIGHT, "3")
    module = executor_module(
        worker, max_concurrent_batches=1 if how == "one batch at a time" else 2, non_block=how != "no non_block"
    )
    generator = applied(module).VllmHiddenStatesGenerator()
    generator.generate(4)
    pipelined = worker.log.index("sent execute_model 1") < worker.log.index("read sample_tokens None")
    assert pipelined is expect_pipelined
    assert hasattr(generator.executor, "_vllm_compat_steps") is expect_pipelined


def test_reverted_executors_wait_for_each_step_again() -> None:
    worker = Worker()
    module = executor_module(worker)
    adapter = StepsInFlight()
    adapter.apply(module)
    generator = module.VllmHiddenStatesGenerator()
    adapter.revert()
    generator.generate(2)
    assert worker.log.index("read sample_tokens None") < worker.log.index("sent execute_model 1")
