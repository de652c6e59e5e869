"""Model Runner V2's request slots, in vLLM 0.34.0's own code, against the steps speculators 0.3.0's loop sends.

V2 gives each request one slot of a fixed pool (``RequestState.free_indices``, ``max_num_seqs`` of them) and takes it
back only when a step it runs lists the request in ``finished_req_ids`` or ``preempted_req_ids``
(``model_runner.v2_request_slots``). speculators 0.3.0 aborts each request after its step, and its loop ends on the
scheduler output with nothing to run, which it never sends: the ids of the requests of a call's last step never reach
the workers, and on an H200 (vLLM 0.34.0) the generator died with ``No free indices``.

``RECORDED`` is what vLLM's real scheduler handed speculators 0.3.0's generator, step by step, on vLLM's CPU build
0.32.0 with every other vllm-compat adapter applied, for the calls of tests/gpu (5, 3, 12 and 25 sequences, then
the first again; ``max_num_seqs`` 32, 8192 tokens a step). The slot bookkeeping here is the 0.34.0 wheel's own
``RequestState.add_request`` and ``remove_request``, compiled from its source and run as they are (the tensors they
also write are sinks: the slots are plain Python), in the order V2's ``execute_model`` runs them (finished requests
freed before new ones are added). The loop is 0.3.0's: ``while (out := scheduler.schedule())
.total_num_scheduled_tokens > 0``, each such output sent.
"""

from __future__ import annotations

import json
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_compat.adapters.scheduler import FinishedIdsToNextStep

from tests.drift import plan_getter
from vllm_compat import runners
from vllm_compat.apiview.static import StaticView
from vllm_compat.cli import main
from vllm_compat.errors import SourceError
from vllm_compat.findings import State
from vllm_compat.sources import fetch_release

pytestmark = pytest.mark.wheels

RELEASE = "0.34.0"
STATES = "vllm.v1.worker.gpu.states.RequestState"
MAX_NUM_SEQS = 32  # speculators 0.3.0's MAX_NUM_SEQS: the runner's max_num_reqs

# (call, tokens scheduled, new requests req_{call}_{i} for i in range(*new), finished ones for i in range(*finished))
RECORDED: list[tuple[int, int, tuple[int, int], tuple[int, int]]] = [
    (0, 355, (0, 5), (0, 0)),
    (0, 0, (0, 0), (0, 5)),  # nothing to run: the loop ends, and the 5 finished ids are never sent
    (1, 1067, (0, 3), (0, 0)),
    (1, 0, (0, 0), (0, 3)),
    (2, 1966, (0, 12), (0, 0)),
    (2, 0, (0, 0), (0, 12)),
    (3, 8192, (0, 12), (0, 0)),  # prompts split across steps: req_3_11 continues in the next step
    (3, 8192, (12, 24), (0, 11)),
    (3, 2463, (24, 25), (11, 23)),
    (3, 0, (0, 0), (23, 25)),
    (4, 355, (0, 5), (0, 0)),
    (4, 0, (0, 0), (0, 5)),
]


class _Sink:
    """Takes whatever the tensor buffers of RequestState are given (the slot bookkeeping does not read them)."""

    def __getattr__(self, name: str) -> _Sink:
        return self

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def __getitem__(self, key: Any) -> _Sink:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


def wheel_request_state(release: str) -> type:
    """A class whose ``add_request``/``remove_request`` are the release's own, compiled from its wheel's source."""
    try:
        view = StaticView(fetch_release(release))
    except SourceError as exc:
        pytest.skip(f"vllm=={release} is not cached and cannot be fetched: {exc}")
    methods: dict[str, Any] = {}
    for name in ("add_request", "remove_request"):
        source = view.source(f"{STATES}.{name}")
        assert source is not None, name
        exec(compile(source.text, f"{source.file}:{source.line}", "exec", dont_inherit=True), methods)

    class RequestState:
        def __init__(self, max_num_reqs: int) -> None:  # the pool as RequestState.__init__ makes it (probed below)
            self.req_id_to_index: dict[str, int] = {}
            self.index_to_req_id: dict[int, str] = {}
            self.free_indices = list(range(max_num_reqs))
            self.num_speculative_steps = 0

        def __getattr__(self, name: str) -> _Sink:
            return _Sink()

        add_request = methods["add_request"]
        remove_request = methods["remove_request"]

    return RequestState


def ids(call: int, span: tuple[int, int]) -> list[str]:
    return [f"req_{call}_{i}" for i in range(*span)]


def recorded_outputs() -> Iterator[types.SimpleNamespace]:
    for call, tokens, new, finished in RECORDED:
        yield types.SimpleNamespace(
            total_num_scheduled_tokens=tokens,
            scheduled_new_reqs=[types.SimpleNamespace(req_id=r, prompt_len=1) for r in ids(call, new)],
            finished_req_ids=set(ids(call, finished)),
            preempted_req_ids=set(),
        )


def generator_module() -> types.ModuleType:
    """A stand-in for speculators' generator module whose ``Scheduler`` returns the recorded outputs in order."""
    module = types.ModuleType("stand_in_generator")

    class Scheduler:
        def __init__(self) -> None:
            self.outputs = recorded_outputs()

        def schedule(self) -> types.SimpleNamespace:
            return next(self.outputs)

    module.Scheduler = Scheduler
    return module


def run_calls(scheduler: Any, send: Callable[[Any], None]) -> None:
    """speculators 0.3.0's generate() loop over the recorded calls: every output with tokens to run is sent."""
    for _call in range(1 + RECORDED[-1][0]):
        while (output := scheduler.schedule()).total_num_scheduled_tokens > 0:
            send(output)


def v2_worker(release: str) -> tuple[Any, Callable[[Any], None]]:
    """The slots of a V2 worker, and what its execute_model does with them for a step (model_runner.py:1842-1843)."""
    states = wheel_request_state(release)(MAX_NUM_SEQS)

    def step(output: Any) -> None:
        for req_id in sorted(output.finished_req_ids | output.preempted_req_ids):  # finish_requests
            states.remove_request(req_id)
        for new in output.scheduled_new_reqs:  # add_requests
            states.remove_request(new.req_id)
            states.add_request(new.req_id, new.prompt_len, [1], 0, 1)

    return states, step


def test_the_recorded_steps_run_out_of_v2_slots_without_the_adapter() -> None:
    """The failure of the H200, from the wheel's own code: the fourth call's second step finds no free slot."""
    module = generator_module()
    states, step = v2_worker(RELEASE)
    with pytest.raises(AssertionError, match="No free indices"):
        run_calls(module.Scheduler(), step)
    held = sorted(states.req_id_to_index)
    assert len(held) == MAX_NUM_SEQS
    assert sum(r.startswith(("req_0_", "req_1_", "req_2_")) for r in held) == 5 + 3 + 12, held


def test_the_adapter_hands_the_dropped_ids_to_the_next_step() -> None:
    module = generator_module()
    adapter = FinishedIdsToNextStep()
    adapter.apply(module)
    try:
        states, step = v2_worker(RELEASE)
        sent: list[Any] = []
        run_calls(module.Scheduler(), lambda output: (sent.append(output), step(output)))
    finally:
        adapter.revert()
    assert sorted(states.req_id_to_index) == ids(4, (0, 5)), "only the last call's requests, until the next step"
    assert sent[1].finished_req_ids == set(ids(0, (0, 5))), "call 1's first step frees call 0's slots"
    assert sent[-1].finished_req_ids == set(ids(3, (23, 25))), "call 4's first step frees call 3's last two"
    assert max(len(o.scheduled_new_reqs) for o in sent) <= MAX_NUM_SEQS


def test_probe_reads_the_slot_bookkeeping_of_0_34_0() -> None:
    plan = plan_getter(("0.3.0", "0.4.0.1"))(RELEASE)
    found = [f for f in plan.findings if f.probe == "model_runner.v2_request_slots"]
    assert found and all(f.state is State.BASELINE and f.variant == "baseline" for f in found), found
    evidence = found[0].evidence
    assert "vllm/v1/worker/gpu/states.py:91" in evidence and "No free indices" in evidence, evidence
    assert "GPUModelRunner.finish_requests (vllm/v1/worker/gpu/model_runner.py:1255)" in evidence, evidence
    assert "list(range(max_num_reqs))" in evidence, evidence


def _plant(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


PLANTED = {
    "a free outside the finished ids": (
        "model_runner.py",
        "    def free_states(self, scheduler_output: SchedulerOutput) -> None:\n",
        "    def free_states(self, scheduler_output: SchedulerOutput) -> None:\n"
        "        for req_id in list(self.req_states.req_id_to_index):\n"
        "            self._remove_request(req_id)\n",
    ),
    "new requests added before the finished are freed": (
        "model_runner.py",
        "            self.finish_requests(scheduler_output)\n            self.free_states(scheduler_output)\n"
        "            self.add_requests(scheduler_output)\n",
        "            self.free_states(scheduler_output)\n            self.add_requests(scheduler_output)\n"
        "            self.finish_requests(scheduler_output)\n",
    ),
    "no fixed pool": ("states.py", "self.free_indices = list(range(max_num_reqs))", "self.free_indices = []"),
}


@pytest.mark.parametrize("change", sorted(PLANTED))
def test_other_slot_bookkeeping_keeps_the_v2_path_out(vllm_tree, change: str, capsys, monkeypatch) -> None:
    """Planted in 0.34.0's real source (V2 its only runner): the fact is ``changed``, so no runner's facts hold and
    the probe fails, naming it (fail closed: the adapter was written for this bookkeeping)."""
    monkeypatch.delenv(runners.ENV, raising=False)
    monkeypatch.delenv(runners.VLLM_ENV, raising=False)
    root = vllm_tree(RELEASE)
    name, old, new = PLANTED[change]
    _plant(root / "vllm" / "v1" / "worker" / "gpu" / name, old, new)
    for line in ("0.3.0", "0.4.0.1"):
        code = main(["probe", "--source", str(root), "--speculators", line, "--json", "--allow-code-only"])
        report = json.loads(capsys.readouterr().out)
        slots = next(f for f in report["findings"] if f["probe"] == "model_runner.v2_request_slots")
        assert (slots["variant"], code) == ("changed", 1), (slots, report["unhandled"])
        assert runners.RUNNER_PROBE in report["unhandled"], report["unhandled"]
