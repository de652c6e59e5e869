"""The harness: runs each side in a process of its own, one after the other, and writes what they measured.

Order: ``build`` (the model, and the states check's float32 references), then under each model runner
(``--model-runner``; one pass where it is not given) ``extract``, ``prefill``, ``native``, ``native_disk``, then
``hf`` once, then the states check here (CPU tensors only: this process never starts vLLM or touches CUDA).
Each side builds its engine once and runs all ``--repeat`` rounds on it (``extract`` first: the others take its
engine settings and KV-cache size).

``--time-budget`` is kept: every side is given a deadline after which it starts no further round (the first
always runs), leaving each side still to come an engine start and a round (estimated from the sides so far), and a
hard timeout past which its process is killed; a side writes its result after every call, so a killed one still
leaves its finished calls. DIR/progress.log gets every progress line as it happens; DIR/results.json and
DIR/summary.md are rewritten after every side, so a command killed from outside still returns them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback

from .common import ROOT, Partial, SideFailure, log, samples_dir, write_json
from .config import KINDS, NATIVE, check_call, checked_layers, parse, side_name, split_name

ENTRY = ROOT / "bench" / "extraction_throughput.py"
END_RESERVE = 20.0  # seconds kept at the end of the budget for the check and the summary
START_GUESS = {"cuda": 100.0, "cpu": 90.0}  # one side's engine start and first round, before any was seen
VLLM_KINDS = ("extract", "prefill", *NATIVE)


# ------------------------------------------------------------------------------------------ a side's own process
def run_one_side(args: argparse.Namespace) -> dict:
    """The body of a side's own process: its result, with ``error`` (one line) where it failed."""
    out, extra = args.out, json.loads(args.side_input)
    partial = Partial(out / f".{args.side}.json", {})
    try:
        kind = split_name(args.side)[0]
        if kind == "build":
            from .build import side_build

            return side_build(args, out, extra)
        if kind == "extract":
            from .extract import side_extract as side
        elif kind == "prefill":
            from .prefill import side_prefill as side
        elif kind in NATIVE:
            from .native import side_native as side
        else:
            from .hf import side_hf as side
        return side(args, out, extra, partial)
    except Exception as exc:
        traceback.print_exc()
        reason = str(exc) if isinstance(exc, SideFailure) else f"{type(exc).__name__}: {exc}"
        return {**partial.result, "error": " ".join(reason.split())[:600]}


# ------------------------------------------------------------------------------------------ the parent
class Budget:
    """Deadlines and timeouts for the sides, from ``--time-budget`` (none: only ``--side-timeout``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.end = args.started + args.time_budget if args.time_budget else None
        self.side_timeout = args.side_timeout
        self.guess = START_GUESS.get(args.device, 150.0)
        self.seen: list[float] = []

    def note(self, wall: float, result: dict) -> None:
        """What a vLLM side took for its start and first round (its later rounds subtracted)."""
        later = sum(c["seconds"] for r in (result.get("rounds") or [])[1:] for c in r["calls"])
        self.seen.append(max(1.0, wall - later))

    def estimate(self) -> float:
        return max(self.seen) if self.seen else self.guess

    def for_side(self, later: int) -> tuple[float | None, int]:
        """(deadline for starting another round, hard timeout in seconds) for a side with ``later`` sides after it."""
        if self.end is None:
            return None, self.side_timeout
        now = time.time()
        last = self.end - END_RESERVE
        deadline = last - later * self.estimate()
        hard = min(last - now - later * self.estimate() / 2, last - now)  # may eat into the later sides' time a bit
        return deadline, int(max(0, min(self.side_timeout, hard)))


def side_env(args: argparse.Namespace, name: str, extract_runner: str | None) -> dict:
    env = {
        **os.environ,
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # the bench's own RPCs send functions to the workers
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("VLLM_COMPAT_DISABLE", None)
    kind, runner = split_name(name)
    if kind in VLLM_KINDS:
        if runner:  # --model-runner: every side under the same runner
            env["VLLM_COMPAT_MODEL_RUNNER"] = runner
            env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
        elif kind != "extract" and extract_runner:  # the runner the generator ran on
            env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if extract_runner == "v2" else "0"
    if kind in ("prefill", *NATIVE):
        env["VLLM_COMPAT_DISABLE"] = "1"  # plain vLLM: nothing of vllm-compat in that process
    if kind in NATIVE and args.cpu_unpinned_staging and args.device == "cpu":  # its worker imports the shim
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "bench"), env.get("PYTHONPATH")]))
    if args.device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return env


def run_side(args: argparse.Namespace, name: str, extra: dict, timeout: int, env: dict) -> tuple[dict, float]:
    """Run one side in a fresh interpreter; its result (``error`` where it has none) and its wall time."""
    out = args.out
    result_file = out / f".{name}.json"
    result_file.unlink(missing_ok=True)
    if timeout < 10:
        log(out, "main", f"side {name} skipped: the time budget is spent")
        return {"error": "not run: the time budget was spent"}, 0.0
    cmd = [sys.executable, str(ENTRY), "--side", name, "--side-input", json.dumps(extra), *args.passthrough]
    log(out, "main", f"side {name} starting (timeout {timeout}s)")
    start = time.perf_counter()
    with open(out / "sides.log", "a") as sink:
        sink.write(f"\n===== side {name} ({time.strftime('%H:%M:%S')}) =====\n")
        sink.flush()
        try:
            code: object = subprocess.run(
                cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout, check=False
            ).returncode
        except subprocess.TimeoutExpired:
            code = "killed at its timeout"
    wall = time.perf_counter() - start
    log(out, "main", f"side {name} exited {code} after {wall:.0f}s")
    if split_name(name)[0] in NATIVE:  # what a killed side left behind
        from .native import storage_of

        shutil.rmtree(storage_of(args, out, name), ignore_errors=True)
    if not result_file.exists():
        return {"error": f"exited {code} without a result (sides.log has its output)"}, wall
    result = json.loads(result_file.read_text())
    result_file.unlink()
    if code == "killed at its timeout":
        result["error"] = f"killed at its timeout ({timeout}s) after {len(result.get('rounds') or [])} round(s)"
    if result.get("error"):
        log(out, "main", f"side {name} failed: {result['error']}")
    return result, wall


def plan(args: argparse.Namespace) -> list[str]:
    """The sides in the order they run."""
    wanted = args.sides.split(",")
    names = []
    for runner in args.runners or [None]:
        names += [side_name(kind, runner) for kind in VLLM_KINDS if kind in wanted]
    if "hf" in wanted:
        names.append("hf")
    return names


def engine_of(args: argparse.Namespace, report: dict, runner: str | None) -> dict:
    """The engine settings the generator ended up with under ``runner``; speculators' own where it did not run."""
    extract = report["sides"].get(side_name("extract", runner)) or {}
    engine = dict(extract.get("engine") or {})
    if not engine:
        engine = {
            "dtype": args.dtype,
            "max_model_len": args.max_model_len,
            "block_size": None,
            "enable_prefix_caching": False,
            "max_num_seqs": 32,
            "max_num_batched_tokens": max(8192, args.max_model_len),
            "async_scheduling": False,
            "enforce_eager": True,
            "gpu_memory_utilization": args.gpu_memory_utilization,
        }
    engine["kv_cache_bytes"] = (extract.get("memory") or {}).get("kv_cache_bytes")
    return engine


def inputs_of(args: argparse.Namespace, report: dict, name: str) -> dict:
    kind, runner = split_name(name)
    extract = report["sides"].get(side_name("extract", runner)) or {}
    layers = extract.get("layers") or [int(x) for x in checked_layers(args, report["shape"]["layers"])]
    extra: dict = {"name": name, "sample": not args.no_check}
    if kind in ("prefill", *NATIVE):
        extra["engine"] = engine_of(args, report, runner)
    if kind in NATIVE or kind == "hf":
        extra["layers"] = layers
    if kind == "hf":
        first = args.runners[0] if args.runners else None
        extra["max_num_batched_tokens"] = engine_of(args, report, first)["max_num_batched_tokens"]
    return extra


def rounds_cap(args: argparse.Namespace, report: dict) -> int:
    """As many rounds as every side before ran (a side cut by the time budget cuts the ones after it too: rounds
    are compared pairwise)."""
    ran = [len(r["rounds"]) for r in report["sides"].values() if r.get("rounds") and r["rounds"][0]["calls"]]
    return min([args.repeat, *ran])


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("vllm", "torch", "triton", "transformers", "speculators", "vllm-compat"):
        with contextlib.suppress(PackageNotFoundError):
            found[package] = version(package)
    return found


def write_report(args: argparse.Namespace, report: dict) -> str:
    """results.json and summary.md as they stand (after every side, and at the end)."""
    from .summary import derive, render

    report["wall_seconds"] = round(time.time() - args.started, 1)
    try:
        report["numbers"] = derive(report)
        text = render(report)
    except Exception as exc:  # a summary that cannot be made must not lose the raw results
        traceback.print_exc()
        report["numbers"] = None
        text = f"summary failed: {type(exc).__name__}: {exc}\n"
    write_json(args.out / "results.json", report, indent=1)
    (args.out / "summary.md").write_text(text)
    return text


def states_check(args: argparse.Namespace, report: dict) -> dict | None:
    """Compare the sides' kept states with the build side's references (here, on the CPU)."""
    reference = (report["shape"] or {}).get("reference")
    folder = samples_dir(args.out)
    samples = {p.stem: p for p in sorted(folder.glob("*.pt"))} if folder.exists() else {}
    if args.no_check or not samples:
        return None
    if not reference:
        return {"error": "no references (the build side made none)"}
    from .check import run_check
    from .common import prompt_calls

    lengths = [len(s) for s in prompt_calls(args)[check_call(args)]]
    try:
        report_ = run_check(reference["path"], samples, report["sides"], args.check_factor, lengths)
    except Exception as exc:
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}
    for name, s in report_["sides"].items():
        if s.get("per_layer"):
            rows = ", ".join(f"{r['layer']}: {r['max_rel']:.4f}/{r['mean_rel']:.5f}" for r in s["per_layer"])
            verdict = f"; passed {s['passed']}" if "passed" in s else ""
            log(args.out, "check", f"{name} vs float32 (layer: max_rel/mean_rel) {rows}{verdict}")
    for key, e in report_["exact"].items():
        log(args.out, "check", f"{key}: identical {e['identical']} {e['why'] or ''}")
    return report_


def orchestrate(args: argparse.Namespace) -> int:
    out = args.out
    log(out, "main", f"args: {' '.join(args.passthrough)}")
    shutil.rmtree(samples_dir(out), ignore_errors=True)
    budget = Budget(args)
    names = plan(args)
    report: dict = {
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "passthrough")} | {"out": str(out)},
        "versions": versions(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "shape": {},
        "order": names,
        "sides": {},
        "check": None,
        "timeline": [],
    }
    _, timeout = budget.for_side(len(names))
    shape, wall = run_side(args, "build", {}, timeout, side_env(args, "build", None))
    report["timeline"].append({"side": "build", "seconds": round(wall, 1)})
    if shape.get("error"):
        log(out, "main", f"could not build the model: {shape['error']}")
        report["shape"] = {"error": shape["error"]}
        write_report(args, report)
        return 1
    report["shape"] = shape
    for k, name in enumerate(names):
        kind, runner = split_name(name)
        extra = inputs_of(args, report, name)
        extra["deadline"], timeout = budget.for_side(len(names) - k - 1)
        extra["rounds"] = rounds_cap(args, report)
        extract = report["sides"].get(side_name("extract", runner)) or {}
        env = side_env(args, name, (extract.get("runner") or {}).get("runner"))
        result, wall = run_side(args, name, extra, timeout, env)
        result["rounds_asked"] = extra["rounds"]
        if runner:
            result["asked_runner"] = runner
        report["sides"][name] = result
        report["timeline"].append({"side": name, "seconds": round(wall, 1)})
        if kind != "hf" and result.get("rounds"):
            budget.note(wall, result)
        write_report(args, report)
    report["check"] = states_check(args, report)
    shutil.rmtree(samples_dir(out), ignore_errors=True)
    text = write_report(args, report)
    print(text, flush=True)
    from .summary import ok

    failed = [n for n in names if not ok(report["sides"].get(n)) or report["sides"][n].get("error")]
    check = report["check"] or {}
    if failed:
        log(out, "main", f"sides with an error or without a result: {failed}")
    if check and not check.get("passed"):
        log(out, "main", f"states check: not passed {check.get('error') or ''}")
    return 0 if not failed and (not check or check.get("passed")) else 1


def main(argv: list[str], description: str = "") -> int:
    args = parse(argv, description)
    if args.resummarize:
        from .summary import render

        report = json.loads(args.resummarize.read_text())
        report.pop("numbers", None)
        print(render(report), end="")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.side:  # one side, in its own process
        result = run_one_side(args)
        write_json(args.out / f".{args.side}.json", result)
        sys.stdout.flush()
        os._exit(0)  # vLLM's atexit handlers can hang a finished process; the result is written
    return orchestrate(args)


__all__ = ["KINDS", "main"]
