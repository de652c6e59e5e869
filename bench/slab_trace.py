"""Read a ``--trace-slabs`` run of ``extraction_throughput.py``: per extract call, the worker's slab work and the
stalls of both processes inside the call and in the gap before it, beside the call's time.

    python bench/slab_trace.py OUT/results.json

A row per call (warm-up first): the call's seconds and its time before the first step; then, for the call and for the
gap before it, each kind of slab work as count x seconds (``fill`` chunks, ``register``/``unregister`` pieces,
``munmap``, whole ``make``/``close``), and the stalls (a 1 ms sleep woken more than 3 ms late) of the worker and of
the generator's process as count / longest / total seconds. Work that began in a gap and ended inside the call is
counted in the call (``spill``).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

PIECES = ("fill", "register", "unregister", "munmap")  # one chunk or piece each: what spills into a call
KINDS = (*PIECES, "make", "close")


def _calls(result: dict) -> list[tuple[str, dict]]:
    side = result["sides"]["extract"]
    out = [(f"w{i}", c) for i, c in enumerate(side.get("warmup", []))]
    for r, rnd in enumerate(side.get("rounds", [])):
        out += [(f"{r + 1}.{j}", c) for j, c in enumerate(rnd["calls"])]
    return out


def _work(events: list, lo: float, hi: float) -> dict:
    """Slab work overlapping [lo, hi): kind -> [count, seconds inside the window]; 'spill': seconds of work begun
    before lo."""
    out: dict = defaultdict(lambda: [0, 0.0])
    for kind, began, ended, _thread, _info in events:
        if kind not in KINDS or ended <= lo or began >= hi:
            continue
        out[kind][0] += 1
        out[kind][1] += min(ended, hi) - max(began, lo)
        if began < lo and kind in PIECES:
            out["spill"][0] += 1
            out["spill"][1] = max(out["spill"][1], min(ended, hi) - lo)
    return out


def _stalls(stalls: list, lo: float, hi: float) -> str:
    inside = [late for when, late in stalls if lo <= when < hi]
    return f"{len(inside)}/{max(inside, default=0):.3f}/{sum(inside):.3f}" if inside else "-"


def _brief(work: dict) -> str:
    return " ".join(f"{k}:{n}x{s:.3f}" for k, (n, s) in sorted(work.items())) or "-"


def main(path: str) -> int:
    with open(path) as f:
        result = json.load(f)
    calls = _calls(result)
    events = [e for _name, c in calls for e in (c.get("slab_trace") or {}).get("events", [])]
    worker = [s for _name, c in calls for s in (c.get("slab_trace") or {}).get("stalls", [])]
    caller = [s for _name, c in calls for s in c.get("caller_stalls", [])]
    if not any("clock" in c for _n, c in calls):
        print("no trace in this run: run the bench with --trace-slabs")
        return 2
    columns = ("call", "s", "before s", "work in the call", "worker stalls n/max/sum", "caller stalls", "gap before")
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")
    previous_end = None
    for name, call in calls:
        clock = call["clock"]
        lo, hi = clock["start"], clock["end"]
        gap = _work(events, previous_end, lo) if previous_end is not None else {}
        print(
            f"| {name} | {call['seconds']:.4f} | {call['before_seconds']:.4f} | {_brief(_work(events, lo, hi))} | "
            f"{_stalls(worker, lo, hi)} | {_stalls(caller, lo, hi)} | {_brief(gap)} |"
        )
        previous_end = hi
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
