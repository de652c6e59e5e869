"""The numbers derived from the sides' results, and summary.md.

Ratios are tokens/s of one side over another's under the same model runner: over all timed calls of a round
(``sum`` of the other's times over the sum of this one's), on median calls, and per call, paired by round and call
index (the same prompts). Every side runs all its rounds in one engine; round r of one side is paired with round r
of another.
"""

from __future__ import annotations

import statistics
from typing import Any

from .common import flops, prompt_calls
from .config import GOAL_CALL_RATIO, GOAL_PEAK_MEMORY, RATIOS, side_name, split_name

GIB = 1 << 30
HANDOVER_KEYS = ("seconds", "overlapped_seconds", "waited_seconds", "bytes", "slab_reused", "pinned")


def ok(result: dict | None) -> bool:
    """A side with at least one timed call (a side cut by the time budget still counts for what it ran)."""
    return bool(result) and any(r["calls"] for r in result.get("rounds") or [])


def times(result: dict, r: int) -> list[float]:
    rounds = result.get("rounds") or []
    return [c["seconds"] for c in rounds[r]["calls"]] if r < len(rounds) else []


def all_times(result: dict) -> list[float]:
    return [c["seconds"] for r in result.get("rounds") or [] for c in r["calls"]]


def groups(report: dict) -> list[str | None]:
    """The model runners the sides ran under (None: the bench did not choose one)."""
    found: list[str | None] = []
    for name in report["order"]:
        runner = split_name(name)[1]
        if runner not in found:
            found.append(runner)
    return found


def derive(report: dict) -> dict:
    """Every number the summary shows, from the raw results."""
    args, shape, sides = report["args"], report["shape"], report["sides"]
    ns = _Args(args)
    timed = prompt_calls(ns)[ns.warmup_calls :]
    per_call_tokens = sum(len(s) for s in timed[0])
    call_flops = flops(shape, timed[:1]) if shape.get("params_per_token") else None
    numbers: dict[str, Any] = {"tokens_per_call": per_call_tokens, "sides": {}, "ratios": {}, "goals": {}}
    for name, result in sides.items():
        if not ok(result):
            continue
        every = all_times(result)
        side: dict[str, Any] = {
            "calls": len(every),
            "tokens_per_s": per_call_tokens * len(every) / sum(every),
            "median_tokens_per_s": per_call_tokens / statistics.median(every),
            "rounds": [
                {
                    "calls": len(t),
                    "tokens_per_s": per_call_tokens * len(t) / sum(t),
                    "median_tokens_per_s": per_call_tokens / statistics.median(t),
                }
                for t in (times(result, r) for r in range(len(result["rounds"])))
                if t
            ],
        }
        if call_flops:
            side["tflops"] = call_flops * len(every) / sum(every) / 1e12
            if args.get("peak_tflops"):
                side["peak_fraction"] = side["tflops"] / args["peak_tflops"]
        mem = result.get("memory") or {}
        peak = mem.get("cuda_peak_allocated_bytes", mem.get("rss_peak_bytes"))
        side["peak_bytes"] = peak
        side["peak_reserved_bytes"] = mem.get("cuda_peak_reserved_bytes")
        side["kv_cache_bytes"] = mem.get("kv_cache_bytes")
        if side["kv_cache_bytes"] is not None and peak is not None and "cuda_peak_allocated_bytes" in mem:
            side["peak_without_kv_bytes"] = peak - side["kv_cache_bytes"]
        kind = split_name(name)[0]
        if kind == "extract":
            collect = [c.get("collect_seconds", 0.0) for r in result["rounds"] for c in r["calls"]]
            side["collect_fraction"] = sum(collect) / sum(every)
            side["handover"] = handover_medians([c.get("handover") for r in result["rounds"] for c in r["calls"]])
        if kind.startswith("native"):
            calls = [c for r in result["rounds"] for c in r["calls"]]
            side["generate_fraction"] = sum(c["generate_seconds"] for c in calls) / sum(every)
            side["read_seconds_median"] = statistics.median(c["read_seconds"] for c in calls)
        numbers["sides"][name] = side
    for runner in groups(report):
        for a, b in RATIOS:
            na, nb = side_name(a, runner), "hf" if b == "hf" else side_name(b, runner)
            if na in numbers["sides"] and nb in numbers["sides"]:
                numbers["ratios"][f"{na} / {nb}"] = ratio(sides[na], sides[nb])
        numbers["goals"][runner or ""] = goals(report, numbers, runner)
    return numbers


def ratio(a: dict, b: dict) -> dict:
    """a's speed over b's: per round (all calls, median calls, per call) and over all rounds."""
    rounds = []
    for r in range(min(len(a["rounds"]), len(b["rounds"]))):
        ta, tb = times(a, r), times(b, r)
        n = min(len(ta), len(tb))
        if not n:
            continue
        rounds.append(
            {
                "all_calls": sum(tb[:n]) / sum(ta[:n]),
                "median_calls": statistics.median(tb) / statistics.median(ta),
                "per_call": [y / x for x, y in zip(ta[:n], tb[:n], strict=True)],
            }
        )
    ta, tb = all_times(a), all_times(b)
    return {
        "all_calls": sum(tb) / sum(ta) * len(ta) / len(tb),
        "median_calls": statistics.median(tb) / statistics.median(ta),
        "rounds": rounds,
    }


def goals(report: dict, numbers: dict, runner: str | None) -> dict:
    """Issue #19's goals under one runner: every call >= 0.97x prefill, extract ahead of native, peak memory."""
    out: dict[str, Any] = {}
    pair = numbers["ratios"].get(f"{side_name('extract', runner)} / {side_name('prefill', runner)}")
    if pair:
        per_call = [(r + 1, j, x) for r, rnd in enumerate(pair["rounds"]) for j, x in enumerate(rnd["per_call"])]
        worst = min(per_call, key=lambda t: t[2])
        below = [t for t in per_call if t[2] < GOAL_CALL_RATIO]
        out["every_call"] = {
            "met": not below,
            "worst": worst[2],
            "worst_at": f"round {worst[0]} call {worst[1]}",
            "below": len(below),
            "calls": len(per_call),
        }
    prefill = report["sides"].get(side_name("prefill", runner))
    if pair and ok(prefill):
        out["resolution"] = resolution(report["sides"][side_name("extract", runner)], prefill)
    native = numbers["ratios"].get(f"{side_name('extract', runner)} / {side_name('native', runner)}")
    if native:
        out["ahead_of_native"] = {
            "met": all(r["all_calls"] > 1 for r in native["rounds"]),
            "all_calls": [r["all_calls"] for r in native["rounds"]],
        }
    e = numbers["sides"].get(side_name("extract", runner)) or {}
    p = numbers["sides"].get(side_name("prefill", runner)) or {}
    if e.get("peak_bytes") and p.get("peak_bytes"):
        value = e["peak_bytes"] / p["peak_bytes"]
        out["peak_memory"] = {"met": value <= GOAL_PEAK_MEMORY, "ratio": value}
    return out


def resolution(extract: dict, prefill: dict) -> dict:
    """What a per-call ratio can resolve: prefill paired with itself (round r+1 against round r, call by call: the
    same prompts on the same engine, so any spread is the measurement's own), and every call of each side against
    prefill's median call."""
    pairs = []
    for r in range(1, len(prefill["rounds"])):
        a, b = times(prefill, r - 1), times(prefill, r)
        pairs += [x / y for x, y in zip(a, b, strict=False)]  # round r+1's speed in units of round r's
    median = statistics.median(all_times(prefill))
    sides = (("extract", extract), ("prefill", prefill))
    vs_median = {name: [median / t for t in all_times(side)] for name, side in sides}
    out: dict[str, Any] = {
        "vs_median": {
            name: {"worst": min(v), "below": sum(x < GOAL_CALL_RATIO for x in v), "calls": len(v)}
            for name, v in vs_median.items()
            if v
        }
    }
    if pairs:
        out["prefill_against_itself"] = {
            "worst": min(pairs),
            "below": sum(x < GOAL_CALL_RATIO for x in pairs),
            "calls": len(pairs),
        }
    return out


def handover_medians(stats: list[dict | None]) -> dict | None:
    """Median of each numeric hand-over statistic over the calls (None: the worker gave none)."""
    stats = [s for s in stats if s]
    if not stats:
        return None
    medians: dict[str, Any] = {"source": stats[0].get("source")}
    for key in HANDOVER_KEYS:
        values = [s[key] for s in stats if isinstance(s.get(key), (int, float)) and not isinstance(s[key], bool)]
        flags = [s[key] for s in stats if isinstance(s.get(key), bool)]
        if values:
            medians[key] = statistics.median(values)
        elif flags:
            medians[key] = f"{sum(flags)} of {len(stats)}"
    return medians


class _Args:
    """The few arguments ``prompt_calls`` reads, from results.json's copy of them."""

    def __init__(self, args: dict) -> None:
        self.__dict__.update(args)


# ------------------------------------------------------------------------------------------ rendering
def fmt(x: Any, spec: str = ".3f") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        return format(x, spec)
    return str(x)


def render(report: dict) -> str:
    numbers = report.get("numbers") or derive(report)
    args, shape, sides = report["args"], report["shape"], report["sides"]
    lines = header(report)
    for runner in groups(report):
        title = f" (model runner {runner})" if runner else ""
        lines += ["", f"## Goals{title}", "", "| goal | met | numbers |", "|---|---|---|"]
        lines += goal_rows(numbers["goals"].get(runner or "", {}), report, runner)
    lines += ["", "## Throughput", ""]
    lines += throughput_table(report, numbers)
    lines += ["", "## Ratios (tokens/s of one side over another's, same prompts)", ""]
    lines += ratio_table(numbers)
    for runner in groups(report):
        lines += ["", f"## Every timed call, seconds{f' (model runner {runner})' if runner else ''}", ""]
        lines += call_table(report, runner)
        lines += ["", f"## Where a call's time goes, median calls{f' (model runner {runner})' if runner else ''}", ""]
        lines += breakdown_table(report, runner)
    lines += ["", "## Memory (the model's process)", ""]
    lines += memory_table(numbers)
    lines += ["", "## States check", ""]
    lines += check_lines(report.get("check"))
    lines += ["", "## Sides", ""]
    for name in report["order"]:
        result = {**(sides.get(name) or {}), "repeat": args.get("repeat")}
        lines.append(side_line(name, result, numbers["sides"].get(name)))
    if args.get("time_budget"):
        took = fmt(report.get("wall_seconds"), ".0f")
        lines.append(f"- time budget {args['time_budget']} s; the command took {took} s")
    lines.append(f"- timeline: {report.get('timeline')}")
    del shape
    return "\n".join(lines) + "\n"


def header(report: dict) -> list[str]:
    args, shape = report["args"], report["shape"]
    v = report.get("versions") or {}
    timed = args["calls"] * args["seqs_per_call"] * args["seq_len"]
    return [
        f"# Extraction throughput: preset {args['preset']}, {report.get('date', '')}",
        "",
        f"- model: random Llama, hidden {shape.get('hidden')}, {shape.get('layers')} layers, {shape.get('heads')} "
        f"heads ({shape.get('kv_heads')} KV), intermediate {shape.get('intermediate')}, vocab {shape.get('vocab')}, "
        f"{shape.get('params', 0) / 1e6:.0f}M params, {shape.get('dtype')}, device {args['device']}",
        f"- prompts: {args['calls']} timed calls (+{args['warmup_calls']} warm-up) of {args['seqs_per_call']} x "
        f"{args['seq_len']} tokens = {timed} tokens a round; {args['repeat']} round(s) in each side's one engine",
        f"- versions: {', '.join(f'{k} {val}' for k, val in v.items())}; attention backend "
        f"{args.get('attention_backend') or 'default'}",
    ]


def goal_rows(goal: dict, report: dict, runner: str | None) -> list[str]:
    rows = []
    if "every_call" in goal:
        g = goal["every_call"]
        rows.append(
            f"| every timed call of extract >= {GOAL_CALL_RATIO}x prefill's speed (paired by round and call) | "
            f"{fmt(g['met'])} | worst {g['worst']:.3f} ({g['worst_at']}); {g['below']} of {g['calls']} below |"
        )
    res = goal.get("resolution") or {}
    if "prefill_against_itself" in res:
        g = res["prefill_against_itself"]
        rows.append(
            f"| (resolution) prefill against itself, round r+1 vs round r, call by call | - | worst {g['worst']:.3f}; "
            f"{g['below']} of {g['calls']} below {GOAL_CALL_RATIO} |"
        )
    for name, g in (res.get("vs_median") or {}).items():
        rows.append(
            f"| (resolution) every call of {name} against prefill's median call | - | worst {g['worst']:.3f}; "
            f"{g['below']} of {g['calls']} below {GOAL_CALL_RATIO} |"
        )
    if "ahead_of_native" in goal:
        g = goal["ahead_of_native"]
        rows.append(
            f"| extract ahead of native (all calls, each round) | {fmt(g['met'])} | "
            f"{', '.join(f'{x:.3f}' for x in g['all_calls'])} |"
        )
    if "peak_memory" in goal:
        g = goal["peak_memory"]
        rows.append(f"| peak memory extract <= {GOAL_PEAK_MEMORY}x prefill's | {fmt(g['met'])} | {g['ratio']:.3f} |")
    check = report.get("check") or {}
    if check.get("sides"):
        mine = {n: s for n, s in check["sides"].items() if split_name(n)[1] == runner and not n.startswith("transf")}
        for name, s in mine.items():
            rows.append(
                f"| states of {name} as accurate as transformers' bf16 (against float32) | {fmt(s.get('passed'))} | "
                f"{s.get('error') or worst_line(s)} |"
            )
        for key, e in (check.get("exact") or {}).items():
            if any(split_name(n)[1] == runner for n in key.split(" vs ")):
                worst = max(r["max_abs"] for r in e["per_layer"])
                rows.append(
                    f"| {key}: bit-identical | {fmt(e['identical'])} | max abs diff {worst:.3g}"
                    f"{'; ' + e['why'] if e['why'] else ''} |"
                )
    elif check.get("error"):
        rows.append(f"| states check | no | {check['error']} |")
    return rows or ["| (no pair of sides to compare) | | |"]


def worst_line(s: dict) -> str:
    rows = s.get("per_layer") or []
    if not rows:
        return ""
    mx = max(rows, key=lambda r: r["max_vs_hf"])
    mn = max(rows, key=lambda r: r["mean_vs_hf"])
    return (
        f"worst layer max_rel {mx['max_vs_hf']:.2f}x transformers' (layer {mx['layer']}), mean_rel "
        f"{mn['mean_vs_hf']:.2f}x (layer {mn['layer']})"
    )


def throughput_table(report: dict, numbers: dict) -> list[str]:
    lines = [
        "| side | rounds | tokens/s (all calls) | median call tok/s | per round (all calls) | TFLOP/s | of peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in report["order"]:
        n = numbers["sides"].get(name)
        r = report["sides"].get(name) or {}
        if not n:
            lines.append(f"| {name} | failed: {r.get('error', 'no result')} | | | | | |")
            continue
        per = ", ".join(f"{x['tokens_per_s']:.0f}" for x in n["rounds"])
        frac = n.get("peak_fraction")
        lines.append(
            f"| {name} | {len(n['rounds'])} | {n['tokens_per_s']:.0f} | {n['median_tokens_per_s']:.0f} | {per} | "
            f"{fmt(n.get('tflops'), '.3g')} | {f'{frac:.1%}' if frac is not None else '-'} |"
        )
    return lines


def ratio_table(numbers: dict) -> list[str]:
    lines = [
        "| ratio | all calls | median calls | per round: all calls | per round: median calls | worst call |",
        "|---|---|---|---|---|---|",
    ]
    for key, r in numbers["ratios"].items():
        worst = min((x for rnd in r["rounds"] for x in rnd["per_call"]), default=None)
        per_all = ", ".join(f"{x['all_calls']:.3f}" for x in r["rounds"])
        per_median = ", ".join(f"{x['median_calls']:.3f}" for x in r["rounds"])
        lines.append(
            f"| {key} | {r['all_calls']:.3f} | {r['median_calls']:.3f} | {per_all} | {per_median} | {fmt(worst)} |"
        )
    return lines if numbers["ratios"] else ["(no pair of sides with results)"]


def call_table(report: dict, runner: str | None) -> list[str]:
    sides = report["sides"]
    names = [n for n in report["order"] if split_name(n)[1] == runner and ok(sides.get(n))]
    if "hf" in sides and ok(sides["hf"]) and "hf" not in names:
        names.append("hf")
    if not names:
        return ["(no side with results)"]
    e, p, nat = (side_name(k, runner) for k in ("extract", "prefill", "native"))
    cols = [*names]
    extra = []
    if e in names and p in names:
        extra.append(("extract/prefill", lambda r, j: _pair(sides, p, e, r, j)))
    if e in names and nat in names:
        extra.append(("extract/native", lambda r, j: _pair(sides, nat, e, r, j)))
    handover = e in names
    head = ["round", "call", *cols, *(x[0] for x in extra)]
    if handover:
        head += [
            "collect RPC s (with steps in flight)",
            "hand-over exposed s",
            "overlapped s",
            "waited s",
            "MiB",
            "slab reused",
            "pinned",
            "slabs made / closed since the call before (GiB)",
        ]
        work = slab_work(sides[e])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rounds = max(len(sides[n]["rounds"]) for n in names)
    for r in range(rounds):
        count = max(len(times(sides[n], r)) for n in names)
        for j in range(count):
            row = [str(r + 1), str(j)]
            for n in names:
                t = times(sides[n], r)
                row.append(f"{t[j]:.4f}" if j < len(t) else "")
            row += [fmt(f(r, j)) for _, f in extra]
            if handover:
                calls = sides[e]["rounds"][r]["calls"] if r < len(sides[e]["rounds"]) else []
                c = calls[j] if j < len(calls) else {}
                h = c.get("handover") or {}
                row += [
                    fmt(c.get("collect_seconds"), ".4f"),
                    fmt(h.get("seconds"), ".4f"),
                    fmt(h.get("overlapped_seconds"), ".4f"),
                    fmt(h.get("waited_seconds"), ".4f"),
                    fmt(h["bytes"] / 2**20, ".0f") if isinstance(h.get("bytes"), (int, float)) else "n/a",
                    fmt(h.get("slab_reused")),
                    fmt(h.get("pinned")),
                    work.get((r, j), "n/a"),
                ]
            lines.append("| " + " | ".join(row) + " |")
    return lines


def slab_work(side: dict) -> dict[tuple[int, int], str]:
    """Per timed call (round, call): the slabs the worker made and let go of since the call before it (the warm-up's
    for the first), from the cumulative history each hand-over reports. Making populates and pins a slab, closing
    unpins it: background work beside the steps of the calls it overlaps."""
    previous = next((c.get("handover") for c in reversed(side.get("warmup") or []) if c.get("handover")), None)
    out: dict[tuple[int, int], str] = {}
    keys = ("slabs_made", "slabs_closed", "bytes_made", "bytes_closed")
    for r, rnd in enumerate(side.get("rounds") or []):
        for j, call in enumerate(rnd.get("calls") or []):
            h = call.get("handover") or {}
            known = previous is not None and all(isinstance(x.get(k), int) for x in (h, previous) for k in keys)
            if known:
                made, closed, bmade, bclosed = (h[k] - previous[k] for k in keys)
                out[(r, j)] = f"{made} / {closed} ({bmade / 2**30:.2f} / {bclosed / 2**30:.2f})"
            previous = h if h else previous
    return out


# (label, what it is) of the breakdown's rows; every value a median over the timed calls, seconds unless said
BREAKDOWN_ROWS = (
    ("call", "the call, as its caller timed it"),
    ("steps", "execute_model calls the worker ran in the call (count; empty steps included)"),
    ("device", "the device's work in those steps: forward (execute_model) and sampling (sample_tokens)"),
    ("host_in_steps", "the worker's time inside those calls (launches; the work itself on a CPU)"),
    ("outside_device", "the call less the device's work: scheduling, RPCs, Python on both sides"),
    ("before", "extract: from generate() to the first engine step (speculators builds and adds its requests)"),
    ("collect", "extract: the RPC that hands the states over (with steps in flight, it waits for the last steps)"),
    ("handover", "extract: the hand-over's time left exposed after the last step (in the worker)"),
    ("overlapped", "extract: the capture's copies during the steps (in the worker, overlapped with them)"),
    ("after", "extract: after the states arrived (speculators' .clone().cpu() and empty_cache)"),
)


def call_breakdown(call: dict) -> dict[str, float | None]:
    """One timed call's breakdown (see BREAKDOWN_ROWS); None where the side does not measure it."""
    steps = call.get("worker_steps") or {}
    handover = call.get("handover") or {}
    device = (steps.get("execute_seconds", 0.0) + steps.get("sample_seconds", 0.0)) if steps else None
    return {
        "call": call.get("seconds"),
        "steps": steps.get("steps") if steps else None,
        "device": device,
        "host_in_steps": steps.get("host_seconds") if steps else None,
        "outside_device": call["seconds"] - device if device is not None else None,
        "before": call.get("before_seconds"),
        "collect": call.get("collect_seconds"),
        "handover": handover.get("seconds") if isinstance(handover.get("seconds"), (int, float)) else None,
        "overlapped": handover.get("overlapped_seconds"),
        "after": call.get("after_seconds"),
    }


def breakdown_medians(result: dict) -> dict[str, float | None]:
    """Each breakdown row's median over a side's timed calls."""
    calls = [call_breakdown(c) for r in result["rounds"] for c in r["calls"]]
    out: dict[str, float | None] = {}
    for key, _ in BREAKDOWN_ROWS:
        values = [c[key] for c in calls if isinstance(c[key], (int, float))]
        out[key] = statistics.median(values) if values else None
    return out


def breakdown_table(report: dict, runner: str | None) -> list[str]:
    """Extract and prefill side by side: where a call's time goes, and the difference per row."""
    sides = report["sides"]
    e, p = side_name("extract", runner), side_name("prefill", runner)
    names = [n for n in (e, p) if ok(sides.get(n))]
    if not names:
        return ["(no side with results)"]
    medians = {n: breakdown_medians(sides[n]) for n in names}
    both = len(names) == 2
    head = ["row", *names, *(["extract - prefill"] if both else []), "what it is"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, what in BREAKDOWN_ROWS:
        values = [medians[n][key] for n in names]
        if all(v is None for v in values):
            continue
        spec = ".0f" if key == "steps" else ".4f"
        row = [key, *(fmt(v, spec) for v in values)]
        if both:
            a, b = values
            row.append(fmt(a - b, spec) if a is not None and b is not None else "")
        lines.append("| " + " | ".join([*row, what]) + " |")
    return lines


def _pair(sides: dict, slow: str, fast: str, r: int, j: int) -> float | None:
    """``slow``'s time over ``fast``'s for call j of round r: fast's speed in units of slow's."""
    a, b = times(sides[fast], r), times(sides[slow], r)
    return b[j] / a[j] if j < len(a) and j < len(b) else None


def memory_table(numbers: dict) -> list[str]:
    lines = [
        "| side | peak allocated GiB | peak reserved GiB | of it KV cache GiB | peak without KV GiB |",
        "|---|---|---|---|---|",
    ]
    for name, n in numbers["sides"].items():

        def gib(key: str, n=n) -> str:
            return f"{n[key] / GIB:.2f}" if n.get(key) is not None else "-"

        lines.append(
            f"| {name} | {gib('peak_bytes')} | {gib('peak_reserved_bytes')} | {gib('kv_cache_bytes')} | "
            f"{gib('peak_without_kv_bytes')} |"
        )
    for runner, goal in numbers["goals"].items():
        if "peak_memory" in goal:
            lines.append(
                f"\npeak memory extract / prefill{f' ({runner})' if runner else ''}: {goal['peak_memory']['ratio']:.3f}"
            )
    return lines


def check_lines(check: dict | None) -> list[str]:
    if not check:
        return ["not run (--no-check, or no side kept states)"]
    if check.get("error"):
        return [f"failed: {check['error']}"]
    ref = check["reference"]
    lines = [
        f"Sequences {check['positions']} of the last timed call, layers {check['layers']} (decoder layer outputs). "
        f"Reference: transformers {ref.get('transformers')} in float32 (TF32 off) on {ref.get('device')}, "
        f"attention {ref.get('attn_implementation')}, the model's own weights. max_rel = max|x - fp32| / max|fp32|, "
        f"mean_rel = sum|x - fp32| / sum|fp32|. Pass: {check['criterion']}. "
        f"Overall: **{'passed' if check.get('passed') else 'FAILED'}**.",
        "",
    ]
    names = list(check["sides"])
    head = ["layer"]
    for name in names:
        head += [f"{name} max_rel", f"{name} mean_rel"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k, layer in enumerate(check["layers"]):
        row = [str(layer)]
        for name in names:
            rows = check["sides"][name].get("per_layer")
            if not rows:
                row += ["-", "-"]
                continue
            x = rows[k]
            mark = "" if x.get("passed", True) else " **x**"
            row += [f"{x['max_rel']:.4f}{mark}", f"{x['mean_rel']:.5f}"]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for name, s in check["sides"].items():
        if s.get("error"):
            lines.append(f"- {name}: {s['error']}")
        elif "old_bound_worst" in s:
            lines.append(
                f"- {name}: {'passed' if s['passed'] else 'FAILED'}; {worst_line(s)}; against transformers' bf16 "
                f"the earlier bound (3e-2 * max|ref| + 1e-3 per tensor) at worst {s['old_bound_worst']:.2f}x"
            )
    for key, e in (check.get("exact") or {}).items():
        per = ", ".join(
            f"layer {r['layer']}: {r['max_abs']:.3g} ({r['differing_fraction']:.2%} differ)" for r in e["per_layer"]
        )
        batches = "; ".join(f"{n} {b['steps']} ({b['how']})" for n, b in e["batches"].items())
        lines.append(
            f"- {key}: {'bit-identical' if e['identical'] else 'NOT identical: ' + str(e['why'])}; {per}; "
            f"steps [sequences, tokens] of the checked call: {batches}"
        )
    return lines


def handover_value(key: str, value: Any) -> str:
    if key == "bytes" and isinstance(value, (int, float)):
        return f"{value / 2**20:.0f} MiB"
    return fmt(value, ".4f")


def side_line(name: str, result: dict, n: dict | None) -> str:
    runner = result.get("runner") or {}
    parts = [f"- {name}:"]
    if result.get("error"):
        parts.append(f"error: {result['error']};")
    if result.get("init_seconds") is not None:
        parts.append(f"engine ready in {result['init_seconds']:.1f} s;")
    if runner:
        parts.append(f"model runner {runner.get('runner')} ({runner.get('class')});")
    if result.get("stopped"):
        parts.append(f"{result['stopped']};")
    elif result.get("rounds_asked") and result["rounds_asked"] < (result.get("repeat") or 0):
        parts.append(f"{result['rounds_asked']} round(s), as many as the sides before it ran;")
    if result.get("asked_runner") and runner and runner.get("runner") != result["asked_runner"]:
        parts.append(f"ASKED FOR {result['asked_runner']}, RAN {runner.get('runner')};")
    kind = split_name(name)[0]
    if kind == "extract" and n:
        h = n.get("handover")
        parts.append(
            f"collecting states {n['collect_fraction']:.1%} of the calls; hand-over (median a call) "
            + (", ".join(f"{k} {handover_value(k, v)}" for k, v in h.items()) if h else "n/a")
            + "; speculators' copy of one call's states where it really copies "
            + f"{fmt(result.get('copy_states_seconds'))} s; vllm-compat adapters {result.get('applied')}; "
            + f"engine {result.get('engine')}"
        )
    elif kind.startswith("native") and n:
        parts.append(
            f"generate() returned after {n['generate_fraction']:.1%} of the call time, the rest the files; reading "
            f"them back {n['read_seconds_median']:.3f} s a call (untimed); harness {result.get('harness') or 'none'}; "
            f"settings {result.get('settings')}"
        )
    elif kind == "prefill" and result.get("settings"):
        parts.append(f"settings {result['settings']}")
    elif kind == "hf" and n:
        parts.append(f"{result.get('sequences_per_forward')} sequences a forward, {result.get('attn_implementation')}")
    return " ".join(parts)
