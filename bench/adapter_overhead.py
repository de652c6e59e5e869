"""What vllm-compat costs per generate() call where speculators runs without it (speculators 0.4.0.1 on vLLM 0.16).

Two sides run speculators' unchanged ``VllmHiddenStatesGenerator`` on the same model and prompts, each in a fresh
interpreter (vLLM spawns workers; adapters live per process), alternating ABAB... over ``--rounds`` rounds so that
load on the machine hits both alike:

- ``with``: ``import vllm_compat`` first, as a user's script does. Every adapter the probes call for is applied,
  in the parent and, through the plugin, in the worker.
- ``without``: ``VLLM_COMPAT_DISABLE=1`` and no ``import vllm_compat``: nothing of vllm-compat runs in either
  process. On vLLM's CPU platform speculators 0.4.0.1 still cannot size its KV cache (its ``mem_get_info()`` says
  (0, 0) there, the Scheduler then fails), so this side gets the one harness patch it needs: ``mem_get_info`` in
  speculators' module is rebound to a plain function returning the free memory that makes speculators' own
  formula (free * gpu_memory_utilization * 0.2) come out at ``VLLM_CPU_KVCACHE_SPACE`` GiB, the size vllm-compat's
  CPU adapter gives the other side. It runs once, in the constructor, and is not part of any call timed here.

The timed quantity is the wall time of each ``generate()`` after ``--warmup`` calls; the headline is the ratio of
the medians with/without (target <= 1.02), with the means beside it. Both sides must return the same states (the
largest difference between them is reported). With a tiny model (the default, as in tests/e2e) a call is mostly
Python and RPC, which makes any per-call cost of the adapters as visible as it can be. The harness setting of the
end-to-end tests, float32 instead of vLLM's CPU choice of bfloat16, is not used: both sides run vLLM's default.

    python bench/adapter_overhead.py                     # needs vLLM (a CPU build is enough) and speculators 0.4.0.1
    python bench/adapter_overhead.py --rounds 5 --calls 40 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE_MEMORY_FRACTION = 0.2  # speculators' generator: cache = free * gpu_memory_utilization * 0.2
GPU_MEMORY_UTILIZATION = 0.8  # the generator's default


def prompts(args: argparse.Namespace) -> list[list[list[int]]]:
    rng = random.Random(7)
    n = args.warmup + args.calls
    return [[[rng.randrange(4, 500) for _ in range(rng.randrange(args.seq_len // 2, args.seq_len + 1))]
             for _ in range(args.seqs)] for _ in range(n)]


def side(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    if args.side == "with":
        import vllm_compat
    from speculators.data_generation import vllm_hidden_states_generator as gen_module

    if args.side == "without":
        _harness_kv_memory(gen_module)
    t_import = time.perf_counter()
    generator = gen_module.VllmHiddenStatesGenerator(model_path=args.model, layer_ids=[0, 1, 3], max_model_len=2048)
    t_init = time.perf_counter()
    seconds, first = [], None
    for i, call in enumerate(prompts(args)):
        start = time.perf_counter()
        results = generator.generate(call)
        elapsed = time.perf_counter() - start
        if i >= args.warmup:
            seconds.append(elapsed)
        if first is None:
            first = results
    applied = sorted(vllm_compat.status()["applied"]) if args.side == "with" else []
    generator.executor.shutdown()
    import torch

    torch.save(first, Path(args.out) / f".{args.side}-states.pt")
    return {"import_seconds": t_import - t0, "init_seconds": t_init - t_import, "call_seconds": seconds,
            "applied": applied, "vllm_compat_imported": "vllm_compat" in sys.modules}


def _harness_kv_memory(gen_module) -> None:
    """The without side's one patch: the free memory for which speculators' formula gives the CPU KV space."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    gib = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 4)
    free = int(gib * (1 << 30) / (GPU_MEMORY_UTILIZATION * CACHE_MEMORY_FRACTION)) + 1
    gen_module.mem_get_info = lambda: (free, free)


def run_side(args: argparse.Namespace, name: str, out: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", name, "--model", args.model, "--out", str(out),
           "--calls", str(args.calls), "--warmup", str(args.warmup), "--seqs", str(args.seqs),
           "--seq-len", str(args.seq_len)]
    env = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("VLLM_COMPAT_DISABLE", None)
    if name == "without":
        env["VLLM_COMPAT_DISABLE"] = "1"
    result_file = out / f".{name}.json"
    result_file.unlink(missing_ok=True)
    with open(out / "adapter_overhead.log", "a") as sink:
        done = subprocess.run(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=args.side_timeout,
                              check=False)
    if done.returncode != 0 or not result_file.exists():
        raise RuntimeError(f"side {name} exited {done.returncode}; see {out / 'adapter_overhead.log'}")
    return json.loads(result_file.read_text())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the e2e tests' tiny Llama, built)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20, help="timed generate() calls per process")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seqs", type=int, default=8, help="sequences per call (<= 10 keeps 0.4.0.1's order right)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", default=None, help="folder for the log and results (default: a temp folder)")
    parser.add_argument("--side-timeout", type=int, default=900)
    parser.add_argument("--side", choices=("with", "without"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="vllm-compat-overhead-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.out = str(out)
    if args.side:
        result = side(args)
        (out / f".{args.side}.json").write_text(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)  # vLLM's exit handlers can hang a finished process; the result is written

    if args.model is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location("tiny_model", ROOT / "tests" / "e2e" / "tiny_model.py")
        tiny_model = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tiny_model)
        build_tiny_llama = tiny_model.build_tiny_llama

        args.model = str(build_tiny_llama(out / "tiny-llama", num_layers=4))
    runs: dict[str, list[dict]] = {"with": [], "without": []}
    for r in range(args.rounds):
        for name in (("with", "without") if r % 2 == 0 else ("without", "with")):
            t0 = time.perf_counter()
            runs[name].append(run_side(args, name, out))
            calls = runs[name][-1]["call_seconds"]
            print(f"round {r} {name:7s}: median {statistics.median(calls) * 1000:.1f} ms/call over {len(calls)} "
                  f"calls ({time.perf_counter() - t0:.0f}s with start-up)", flush=True)
    import torch

    a = torch.load(out / ".with-states.pt", weights_only=False)
    b = torch.load(out / ".without-states.pt", weights_only=False)
    same = max((x.float() - y.float()).abs().max().item() for ra, rb in zip(a, b, strict=True)
               for x, y in zip(ra["hidden_states"], rb["hidden_states"], strict=True))
    summary = {}
    for name, results in runs.items():
        calls = [s for r in results for s in r["call_seconds"]]
        summary[name] = {
            "median_ms": statistics.median(calls) * 1000,
            "mean_ms": statistics.fmean(calls) * 1000,
            "round_medians_ms": [statistics.median(r["call_seconds"]) * 1000 for r in results],
            "init_s": statistics.median(r["init_seconds"] for r in results),
            "import_s": statistics.median(r["import_seconds"] for r in results),
            "applied": results[0]["applied"],
        }
    ratio_median = summary["with"]["median_ms"] / summary["without"]["median_ms"]
    ratio_mean = summary["with"]["mean_ms"] / summary["without"]["mean_ms"]
    report = {"args": {k: v for k, v in vars(args).items() if k != "side"}, "summary": summary,
              "ratio_median": ratio_median, "ratio_mean": ratio_mean, "max_abs_diff_between_sides": same,
              "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    (out / "adapter_overhead.json").write_text(json.dumps(report, indent=2))
    w, wo = summary["with"], summary["without"]
    print(f"generate() with vllm-compat:    median {w['median_ms']:.1f} ms, mean {w['mean_ms']:.1f} ms "
          f"({args.rounds} processes x {args.calls} calls of {args.seqs} sequences); init {w['init_s']:.1f} s")
    print(f"generate() without vllm-compat: median {wo['median_ms']:.1f} ms, mean {wo['mean_ms']:.1f} ms; "
          f"init {wo['init_s']:.1f} s")
    print(f"adapters applied: {', '.join(w['applied']) or 'none'}")
    print(f"states with vs without: max abs diff {same:.3g}")
    print(f"ratio with/without: median {ratio_median:.3f}, mean {ratio_mean:.3f} (target <= 1.02)")
    print(f"results: {out / 'adapter_overhead.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
