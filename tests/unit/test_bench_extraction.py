"""The extraction benchmark's own arithmetic (bench/extraction/): batching prediction, ratios, goals, time budget.

The benchmark itself runs real engines (``python bench/extraction_throughput.py --small`` on a CPU); these check the
parts that turn its measurements into verdicts, on hand-made results, without torch or vLLM.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        yield {name: importlib.import_module(f"extraction.{name}") for name in ("check", "config", "common", "summary")}
    finally:
        sys.path.remove(str(BENCH))


def test_predict_steps_chunked_and_whole(bench):
    predict = bench["check"].predict_steps
    assert predict([1024] * 32, 8192, 32, chunked=True) == [[8, 8192]] * 4
    assert predict([1024] * 32, 8192, 32, chunked=False) == [[8, 8192]] * 4
    # lengths that do not divide the budget: chunking splits a prompt across steps, whole prompts leave room
    assert predict([3000] * 3, 8192, 32, chunked=True) == [[3, 8192], [1, 808]]
    assert predict([3000] * 3, 8192, 32, chunked=False) == [[2, 6000], [1, 3000]]
    assert predict([100] * 5, 8192, 2, chunked=True) == [[2, 200], [2, 200], [1, 100]]


def test_check_positions_first_and_last(bench):
    config = bench["config"]
    args = config.parse(["--small", "--check-seqs", "3", "--out", "/nonexistent-out"])
    assert config.check_positions(args) == [0, 4, 7]
    assert config.check_call(args) == args.warmup_calls + args.calls - 1
    with pytest.raises(SystemExit):
        config.parse(["--small", "--model-runner", "v3"])


def _side(seconds: list[list[float]], **extra) -> dict:
    return {"rounds": [{"calls": [{"seconds": s} for s in r]} for r in seconds], **extra}


def _report(sides: dict) -> dict:
    return {
        "args": {
            "preset": "small",
            "device": "cpu",
            "calls": 3,
            "warmup_calls": 1,
            "seqs_per_call": 2,
            "seq_len": 4,
            "vocab": 64,
            "repeat": 2,
        },
        "shape": {},
        "order": list(sides),
        "sides": sides,
    }


def test_ratios_paired_by_round_and_call(bench):
    summary = bench["summary"]
    report = _report(
        {
            "extract": _side([[1.0, 1.0, 2.0], [1.0, 1.0, 1.0]], memory={"cuda_peak_allocated_bytes": 106}),
            "prefill": _side([[1.0, 0.9, 1.0], [1.0, 1.0, 1.0]], memory={"cuda_peak_allocated_bytes": 100}),
        }
    )
    numbers = summary.derive(report)
    pair = numbers["ratios"]["extract / prefill"]
    assert pair["rounds"][0]["per_call"] == pytest.approx([1.0, 0.9, 0.5])
    assert pair["rounds"][0]["all_calls"] == pytest.approx(2.9 / 4.0)
    assert pair["rounds"][1]["all_calls"] == pytest.approx(1.0)
    assert pair["all_calls"] == pytest.approx(5.9 / 7.0)
    goal = numbers["goals"][""]
    assert goal["every_call"] == {
        "met": False,
        "worst": pytest.approx(0.5),
        "worst_at": "round 1 call 2",
        "below": 2,
        "calls": 6,
    }
    assert goal["peak_memory"]["met"] is False  # 1.06 > 1.05
    assert "| extract / prefill | 0.843 |" in summary.render(report)


def test_the_resolution_of_a_per_call_ratio(bench):
    """Prefill against itself, round by round, shows how much of a per-call ratio is the measurement's own spread."""
    summary = bench["summary"]
    report = _report(
        {
            "extract": _side([[1.0, 1.0, 1.0], [1.0, 2.0, 1.0]]),
            "prefill": _side([[1.0, 0.9, 1.0], [1.0, 1.0, 1.1]]),
        }
    )
    res = summary.derive(report)["goals"][""]["resolution"]
    assert res["prefill_against_itself"] == {"worst": pytest.approx(0.9), "below": 2, "calls": 3}
    assert res["vs_median"]["extract"] == {"worst": pytest.approx(0.5), "below": 1, "calls": 6}
    assert res["vs_median"]["prefill"] == {"worst": pytest.approx(1 / 1.1), "below": 1, "calls": 6}
    assert "prefill against itself, round r+1 vs round r, call by call | - | worst 0.900; 2 of 3 below" in (
        summary.render(report)
    )


def test_runners_are_compared_within_their_own_runner(bench):
    summary = bench["summary"]
    report = _report(
        {
            "extract@v1": _side([[1.0]]),
            "prefill@v1": _side([[0.5]]),
            "extract@v2": _side([[1.0]]),
            "prefill@v2": _side([[2.0]]),
        }
    )
    ratios = summary.derive(report)["ratios"]
    assert ratios["extract@v1 / prefill@v1"]["all_calls"] == pytest.approx(0.5)
    assert ratios["extract@v2 / prefill@v2"]["all_calls"] == pytest.approx(2.0)
    assert not any("v1 / prefill@v2" in key or "v2 / prefill@v1" in key for key in ratios)


def test_a_side_cut_short_still_counts_for_what_it_ran(bench):
    summary = bench["summary"]
    report = _report({"extract": _side([[1.0, 1.0]], error="killed"), "prefill": _side([[1.0, 1.0, 1.0]])})
    pair = summary.derive(report)["ratios"]["extract / prefill"]
    assert pair["rounds"][0]["per_call"] == [1.0, 1.0]
    assert summary.ok(report["sides"]["extract"]) and not summary.ok({"error": "x", "rounds": []})


def test_rounds_stop_before_the_deadline(bench):
    rounds = bench["common"].Rounds(5, deadline=time.time() + 0.25)
    done = []
    for r in rounds:
        done.append(r)
        time.sleep(0.1)
    assert 1 < len(done) < 5
    assert rounds.stopped == f"time budget: {len(done)} of 5 rounds run"
    assert list(bench["common"].Rounds(2, deadline=time.time() - 1)) == [0]  # the first round always runs


def test_slab_work_is_per_call_from_the_cumulative_history(bench):
    """The worker reports how many slabs it made and let go of so far; the table shows each call's share, the first
    timed call's counted from the warm-up's."""
    summary = bench["summary"]

    def handover(made: int, closed: int) -> dict:
        return {"slabs_made": made, "slabs_closed": closed, "bytes_made": made << 30, "bytes_closed": closed << 30}

    side = {
        "warmup": [{"handover": handover(3, 0)}],
        "rounds": [{"calls": [{"handover": handover(5, 1)}, {"handover": handover(5, 1)}]}, {"calls": [{}]}],
    }
    assert summary.slab_work(side) == {(0, 0): "2 / 1 (2.00 / 1.00)", (0, 1): "0 / 0 (0.00 / 0.00)"}
    assert summary.slab_work({"rounds": [{"calls": [{"handover": handover(1, 0)}]}]}) == {}, "no warm-up: unknown"


def test_the_slab_trace_counts_work_by_the_window_it_ran_in():
    """``bench/slab_trace.py`` puts each piece of the worker's slab work in the call or gap whose window it overlaps
    (only the part inside), and counts work begun in the gap that ran on into the call as spill."""
    sys.path.insert(0, str(BENCH))
    try:
        trace = importlib.import_module("slab_trace")
    finally:
        sys.path.remove(str(BENCH))
    events = [
        ("fill", 0.5, 1.0, "t", {}),  # the gap before the call, wholly
        ("fill", 1.9, 2.1, "t", {}),  # begun in the gap, ended 0.1 s into the call
        ("register", 2.5, 2.6, "t", {}),
        ("take", 2.0, 2.0, "t", {}),  # not slab work: not counted
        ("unregister", 3.5, 4.0, "t", {}),  # after the call
    ]
    work = trace._work(events, 2.0, 3.0)
    assert {kind: (n, round(s, 6)) for kind, (n, s) in work.items()} == {
        "fill": (1, 0.1),
        "register": (1, 0.1),
        "spill": (1, 0.1),
    }
    assert {kind: (n, round(s, 6)) for kind, (n, s) in trace._work(events, 0.0, 2.0).items()} == {"fill": (2, 0.6)}
    assert trace._stalls([(2.2, 0.004), (2.4, 0.010), (3.1, 0.5)], 2.0, 3.0) == "2/0.010/0.014"
    assert trace._stalls([], 2.0, 3.0) == "-"
