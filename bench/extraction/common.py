"""What every side shares: progress lines, prompts, results written as they grow, and the functions sent to vLLM's
workers (memory, model runner).

Functions sent through ``collective_rpc`` are pickled by value (cloudpickle), so a worker needs nothing of this
package on its path; each imports what it uses inside its body.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the project root (never put on sys.path: the workers inherit it)


class SideFailure(Exception):
    """A side that cannot run here: its one-line reason goes into the summary instead of a number."""


def load_project_file(path: Path):
    """Import a file of the project by path: the project root must not go on sys.path, which vLLM's spawned
    workers inherit (they would import vllm_compat from the source tree instead of the installed package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"vllm_compat_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def log(out: Path, side: str, msg: str) -> None:
    """A progress line: on stdout and in DIR/progress.log as it happens (a killed command still returns the file)."""
    line = f"[bench {time.strftime('%H:%M:%S')} {side}] {msg}"
    print(line, flush=True)
    with open(out / "progress.log", "a") as f:
        f.write(line + "\n")


def jsonable(obj: Any) -> Any:
    """What ``json`` cannot write (a config object vLLM put into a settings dict, a dtype): its ``repr``."""
    return repr(obj)


def write_json(path: Path, data: Any, indent: int | None = None) -> None:
    """Write atomically: a reader (or a kill) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent, default=jsonable))
    os.replace(tmp, path)


def plain(data: Any) -> Any:
    """A JSON round trip: a snapshot of settings before vLLM turns parts of them into config objects."""
    return json.loads(json.dumps(data, default=jsonable))


def prompt_calls(args: argparse.Namespace) -> list[list[list[int]]]:
    """Warm-up calls first, then timed calls: fixed-length random prompts (no padding on the transformers side).
    Every round of a side repeats the same timed calls."""
    rng = random.Random(2024)
    n = args.warmup_calls + args.calls
    return [
        [[rng.randrange(4, args.vocab) for _ in range(args.seq_len)] for _ in range(args.seqs_per_call)]
        for _ in range(n)
    ]


def flops(shape: dict, calls: list[list[list[int]]]) -> float:
    """Model FLOPs of a prefill of ``calls``: layers' matmuls, one LM-head row per sequence, causal attention."""
    tokens = sum(len(s) for c in calls for s in c)
    seqs = sum(len(c) for c in calls)
    pairs = sum(len(s) * (len(s) + 1) // 2 for c in calls for s in c)
    attention = 4 * shape["layers"] * shape["heads"] * shape["head_dim"] * pairs
    return 2 * shape["params_per_token"] * tokens + 2 * shape["lm_head_params"] * seqs + attention


def vllm_release() -> tuple[int, int]:
    """(major, minor) of the installed vLLM, without importing it (a side decides settings before it starts)."""
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("vllm")).release[:2]


def samples_dir(out: Path) -> Path:
    """Where sides leave states for the check: outside DIR, whose files travel back from a remote host."""
    return Path(tempfile.gettempdir()) / f"vllm-compat-bench-samples-{hashlib.sha1(str(out).encode()).hexdigest()[:10]}"


def save_sample(out: Path, side: str, ids: list[list[int]], positions: list[int], layers: list[int], states) -> None:
    """Keep the states of the checked sequences: ``states[k][j]`` is the output of decoder layer ``layers[j]`` for
    sequence ``positions[k]`` of the checked call, whose prompts are ``ids``."""
    import torch

    folder = samples_dir(out)
    folder.mkdir(exist_ok=True)
    sample = {
        "positions": list(positions),
        "ids": [list(ids[p]) for p in positions],
        "layers": list(layers),
        "states": [[h.detach().to("cpu", copy=True) for h in seq] for seq in states],
    }
    torch.save(sample, folder / f"{side}.pt")


class Rounds:
    """Rounds of timed calls within a side's one engine, cut where the next round would end after the deadline.

    The first round always runs; a later one starts only if the slowest round so far, plus a tenth, still fits."""

    def __init__(self, planned: int, deadline: float | None) -> None:
        self.planned = planned
        self.deadline = deadline
        self.longest = 0.0
        self.stopped: str | None = None
        self._started = 0.0

    def __iter__(self):
        for r in range(self.planned):
            if r and self.deadline and time.time() + 1.1 * self.longest > self.deadline:
                self.stopped = f"time budget: {r} of {self.planned} rounds run"
                return
            self._started = time.perf_counter()
            yield r
            self.longest = max(self.longest, time.perf_counter() - self._started)


class Partial:
    """A side's result, written to its file after every call: a side killed at the time budget leaves what it
    measured."""

    def __init__(self, path: Path, result: dict) -> None:
        self.path = path
        self.result = result

    def write(self) -> None:
        write_json(self.path, self.result)


def tokens_of(call: list[list[int]]) -> int:
    return sum(map(len, call))


def finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


# ------------------------------------------------------------------ sent to vLLM's workers (pickled by value)
def memory_report(worker=None) -> dict:
    """Peak memory of this process since the last reset (in vLLM's model process, or in-process)."""
    import resource

    import torch

    report = {"rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        report["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        report["cuda_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    runner = getattr(worker, "model_runner", None)
    caches = getattr(runner, "kv_caches", None)
    if caches:

        def flat(items):
            for item in items if isinstance(items, (list, tuple)) else [items]:
                if isinstance(item, (list, tuple)):
                    yield from flat(item)
                else:
                    yield item

        try:
            report["kv_cache_bytes"] = sum(t.numel() * t.element_size() for t in flat(caches))
        except Exception as exc:  # a layout this report does not know: say so rather than guess
            report["kv_cache_bytes_error"] = repr(exc)
    return report


def reset_peak(worker=None) -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def runner_info(worker=None) -> dict:
    """The model runner this worker really runs: V2 lives in ``vllm.v1.worker.gpu``, V1 (and the CPU one) not."""
    runner = getattr(worker, "model_runner", None)
    cls = type(runner)
    module = cls.__module__
    return {
        "class": f"{module}.{cls.__qualname__}",
        "runner": "v2" if module.startswith("vllm.v1.worker.gpu.") else "v1",
    }


STEP_METHODS = ("execute_model", "sample_tokens")  # what a worker's model runner does in one engine step


def install_step_timer(worker=None) -> bool:
    """In a worker: time every engine step its model runner runs, on the device (the same instrument for every side:
    a breakdown of a call beside plain prefill's). On CUDA a pair of events on the current stream around each call
    of ``execute_model`` and ``sample_tokens``: the device time of the step's work, not when Python returned (Model
    Runner V2 returns before its work is done). Elsewhere the wall time of the call (a CPU runs it synchronously).
    Installed once; ``read_step_timer`` reads and clears it after a call."""
    import time as _time

    import torch

    runner = getattr(worker, "model_runner", None)
    if runner is None or getattr(runner, "_bench_steps", None) is not None:
        return runner is not None
    runner._bench_steps = []
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    for method in STEP_METHODS:
        original = getattr(runner, method, None)
        if original is None:
            continue

        def timed(*a, _original=original, _method=method, **kw):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                began = _time.perf_counter()
                try:
                    return _original(*a, **kw)
                finally:
                    end.record()
                    runner._bench_steps.append((_method, start, end, _time.perf_counter() - began))
            began = _time.perf_counter()
            try:
                return _original(*a, **kw)
            finally:
                spent = _time.perf_counter() - began
                runner._bench_steps.append((_method, spent, None, spent))

        setattr(runner, method, timed)
    return True


def read_step_timer(worker=None) -> dict | None:
    """In a worker, after a call: its engine steps (``execute_model`` calls), the device seconds of their work and of
    ``sample_tokens``, and the host seconds spent inside those calls; cleared for the next call."""
    import torch

    runner = getattr(worker, "model_runner", None)
    steps = getattr(runner, "_bench_steps", None)
    if steps is None:
        return None
    if steps and not isinstance(steps[0][1], float):
        torch.cuda.synchronize()
    out = {"steps": 0, "samples": 0, "execute_seconds": 0.0, "sample_seconds": 0.0, "host_seconds": 0.0}
    for method, start, end, host in steps:
        device = start if end is None else start.elapsed_time(end) / 1000.0
        execute = method == "execute_model"
        out["steps" if execute else "samples"] += 1
        out["execute_seconds" if execute else "sample_seconds"] += device
        out["host_seconds"] += host
    steps.clear()
    return out


def pickle_by_value(module_name: str) -> None:
    """Send this module's functions to vLLM's workers by value: a worker need not import this package."""
    try:
        import cloudpickle
    except ImportError:  # vLLM brings cloudpickle; without it nothing here is sent to a worker anyway
        return
    register = getattr(cloudpickle, "register_pickle_by_value", None)
    if register is not None:
        register(sys.modules[module_name])


pickle_by_value(__name__)
