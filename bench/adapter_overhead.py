"""What vllm-compat costs per generate() call where speculators runs without it (speculators 0.4.0.1 on vLLM 0.16).

Two generators run side by side, each in its own interpreter (adapters live per process; vLLM spawns workers), on
the same model and the same prompts, and take turns: call i runs on one, then on the other, the order flipping
every call, so that whatever else loads the machine hits both alike. The paired ratio t_with / t_without of each
call is the measurement; the headline is the median of those ratios (target <= 1.02), with their geometric mean
and interquartile range beside it, over ``--rounds`` fresh pairs of processes.

- ``with``: ``import vllm_compat`` first, as a user's script does. Every adapter the probes call for is applied,
  in the parent and, through the plugin, in the worker.
- ``without``: ``VLLM_COMPAT_DISABLE=1`` and no ``import vllm_compat``: nothing of vllm-compat runs in either
  process. On vLLM's CPU platform speculators 0.4.0.1 still cannot size its KV cache (its ``mem_get_info()`` says
  (0, 0) there, the Scheduler then fails), so this side gets the one harness patch it needs: ``mem_get_info`` in
  speculators' module is rebound to a plain function returning the free memory that makes speculators' own
  formula (free * gpu_memory_utilization * 0.2) come out at ``VLLM_CPU_KVCACHE_SPACE`` GiB, the size vllm-compat's
  CPU adapter gives the other side. It runs once, in the constructor, outside every timed call.

Both sides run with ``VLLM_SLEEP_WHEN_IDLE=1`` (the same for both): otherwise the idle side's worker spins on its
message queue while the other side's call runs, which on a small machine slows that call. Both must return the
same states (the largest difference is reported). Start-up is reported apart (import and constructor seconds);
it is not per call. With a tiny model (the default, the one of tests/e2e) a call is mostly Python and RPC, which
makes any per-call cost of the adapters as visible as it can be. vLLM's CPU default dtype (bfloat16) on both sides.

    python bench/adapter_overhead.py                     # needs vLLM (a CPU build is enough) and speculators 0.4.0.1
    python bench/adapter_overhead.py --rounds 3 --calls 60 --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
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
SIDES = ("with", "without")


def prompts(args: argparse.Namespace) -> list[list[list[int]]]:
    rng = random.Random(7)
    n = args.warmup + args.calls
    return [
        [
            [rng.randrange(4, 500) for _ in range(rng.randrange(args.seq_len // 2, args.seq_len + 1))]
            for _ in range(args.seqs)
        ]
        for _ in range(n)
    ]


# ------------------------------------------------------------------------------------------ one side
def serve(args: argparse.Namespace) -> None:
    """Build the generator, then run the calls the orchestrator asks for, one JSON line each way."""
    commands = os.fdopen(args.cmd_fd, "r")
    replies = os.fdopen(args.reply_fd, "w")

    def reply(msg: dict) -> None:
        replies.write(json.dumps(msg) + "\n")
        replies.flush()

    t0 = time.perf_counter()
    if args.side == "with":
        import vllm_compat
    from speculators.data_generation import vllm_hidden_states_generator as gen_module

    if args.side == "without":
        _harness_kv_memory(gen_module)
    t_import = time.perf_counter()
    generator = gen_module.VllmHiddenStatesGenerator(model_path=args.model, layer_ids=[0, 1, 3], max_model_len=2048)
    reply({"import_seconds": t_import - t0, "init_seconds": time.perf_counter() - t_import})
    calls = prompts(args)
    first = None
    for line in commands:
        msg = json.loads(line)
        if msg["op"] == "call":
            start = time.perf_counter()
            results = generator.generate(calls[msg["i"]])
            reply({"seconds": time.perf_counter() - start})
            if first is None:
                first = results
        else:
            break
    applied = sorted(vllm_compat.status()["applied"]) if args.side == "with" else []
    generator.executor.shutdown()
    import torch

    torch.save(first, Path(args.out) / f".{args.side}-states.pt")
    reply({"applied": applied})
    os._exit(0)  # vLLM's exit handlers can hang a finished process; the reply is written


def _harness_kv_memory(gen_module) -> None:
    """The without side's one patch: the free memory for which speculators' formula gives the CPU KV space."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    gib = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 4)
    free = int(gib * (1 << 30) / (GPU_MEMORY_UTILIZATION * CACHE_MEMORY_FRACTION)) + 1
    gen_module.mem_get_info = lambda: (free, free)


# ------------------------------------------------------------------------------------------ orchestration
class Side:
    def __init__(self, args: argparse.Namespace, name: str, out: Path) -> None:
        cmd_read, self._cmd_write = os.pipe()
        self._reply_read, reply_write = os.pipe()
        env = {
            **os.environ,
            "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_SLEEP_WHEN_IDLE": "1",
        }
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.pop("VLLM_COMPAT_DISABLE", None)
        if name == "without":
            env["VLLM_COMPAT_DISABLE"] = "1"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--side",
            name,
            "--model",
            args.model,
            "--out",
            str(out),
            "--calls",
            str(args.calls),
            "--warmup",
            str(args.warmup),
            "--seqs",
            str(args.seqs),
            "--seq-len",
            str(args.seq_len),
            "--cmd-fd",
            str(cmd_read),
            "--reply-fd",
            str(reply_write),
        ]
        self.log = open(out / "adapter_overhead.log", "a")  # noqa: SIM115  (open while the side lives)
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, pass_fds=(cmd_read, reply_write)
        )
        os.close(cmd_read)
        os.close(reply_write)
        self.commands = os.fdopen(self._cmd_write, "w")
        self.replies = os.fdopen(self._reply_read, "r")
        self.name = name

    def receive(self) -> dict:
        line = self.replies.readline()
        if not line:
            raise RuntimeError(f"side {self.name} exited ({self.proc.wait()}); see adapter_overhead.log")
        return json.loads(line)

    def call(self, i: int) -> float:
        self.commands.write(json.dumps({"op": "call", "i": i}) + "\n")
        self.commands.flush()
        return self.receive()["seconds"]

    def finish(self) -> dict:
        self.commands.write(json.dumps({"op": "quit"}) + "\n")
        self.commands.flush()
        result = self.receive()
        self.proc.wait(timeout=120)
        self.log.close()
        return result


def run_round(args: argparse.Namespace, out: Path, r: int) -> dict:
    order = SIDES if r % 2 == 0 else SIDES[::-1]
    sides, starts = {}, {}
    for name in order:  # one at a time: start-up numbers are not shared with the other's start-up
        sides[name] = Side(args, name, out)
        starts[name] = sides[name].receive()
    seconds: dict[str, list[float]] = {name: [] for name in SIDES}
    for i in range(args.warmup + args.calls):
        pair = order if i % 2 == 0 else order[::-1]
        for name in pair:
            t = sides[name].call(i)
            if i >= args.warmup:
                seconds[name].append(t)
    ends = {name: sides[name].finish() for name in order}
    ratios = [w / wo for w, wo in zip(seconds["with"], seconds["without"], strict=True)]
    print(
        f"round {r}: with {statistics.median(seconds['with']) * 1000:.1f} ms, without "
        f"{statistics.median(seconds['without']) * 1000:.1f} ms (medians of {args.calls} calls); paired ratio "
        f"median {statistics.median(ratios):.3f}; init with {starts['with']['init_seconds']:.1f} s, without "
        f"{starts['without']['init_seconds']:.1f} s",
        flush=True,
    )
    return {"seconds": seconds, "ratios": ratios, "starts": starts, "applied": ends["with"]["applied"]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the e2e tests' tiny Llama, built)")
    parser.add_argument("--rounds", type=int, default=2, help="fresh pairs of processes")
    parser.add_argument("--calls", type=int, default=40, help="timed generate() calls per side and round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seqs", type=int, default=8, help="sequences per call (<= 10 keeps 0.4.0.1's order right)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", default=None, help="folder for the log and results (default: a temp folder)")
    parser.add_argument("--side", choices=SIDES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cmd-fd", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--reply-fd", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="vllm-compat-overhead-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.out = str(out)
    if args.side:
        serve(args)
        return 0

    if args.model is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location("tiny_model", ROOT / "tests" / "e2e" / "tiny_model.py")
        tiny_model = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tiny_model)
        args.model = str(tiny_model.build_tiny_llama(out / "tiny-llama", num_layers=4))
    rounds = [run_round(args, out, r) for r in range(args.rounds)]

    import torch

    a = torch.load(out / ".with-states.pt", weights_only=False)
    b = torch.load(out / ".without-states.pt", weights_only=False)
    same = max(
        (x.float() - y.float()).abs().max().item()
        for ra, rb in zip(a, b, strict=True)
        for x, y in zip(ra["hidden_states"], rb["hidden_states"], strict=True)
    )
    ratios = sorted(q for r in rounds for q in r["ratios"])
    times = {name: [t for r in rounds for t in r["seconds"][name]] for name in SIDES}
    quartiles = statistics.quantiles(ratios, n=4)
    summary = {
        "paired_ratio_median": statistics.median(ratios),
        "paired_ratio_geomean": math.exp(statistics.fmean(math.log(q) for q in ratios)),
        "paired_ratio_q1_q3": [quartiles[0], quartiles[2]],
        "ratio_of_medians": statistics.median(times["with"]) / statistics.median(times["without"]),
        "median_ms": {name: statistics.median(times[name]) * 1000 for name in SIDES},
        "init_seconds": {name: [r["starts"][name]["init_seconds"] for r in rounds] for name in SIDES},
        "import_seconds": {name: [r["starts"][name]["import_seconds"] for r in rounds] for name in SIDES},
        "applied": rounds[0]["applied"],
        "max_abs_diff_between_sides": same,
        "pairs": len(ratios),
    }
    report = {
        "args": {k: v for k, v in vars(args).items() if k not in ("side", "cmd_fd", "reply_fd")},
        "summary": summary,
        "rounds": rounds,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (out / "adapter_overhead.json").write_text(json.dumps(report, indent=2))
    s = summary
    print(
        f"generate() median: with vllm-compat {s['median_ms']['with']:.1f} ms, without "
        f"{s['median_ms']['without']:.1f} ms ({s['pairs']} paired calls of {args.seqs} sequences, "
        f"{args.rounds} rounds)"
    )
    print(
        f"constructor seconds: with {s['init_seconds']['with']}, without {s['init_seconds']['without']}; "
        f"import seconds: with {[round(x, 2) for x in s['import_seconds']['with']]}, "
        f"without {[round(x, 2) for x in s['import_seconds']['without']]}"
    )
    print(f"adapters applied: {', '.join(s['applied']) or 'none'}")
    print(f"states with vs without: max abs diff {same:.3g}")
    print(
        f"paired ratio with/without: median {s['paired_ratio_median']:.3f}, geometric mean "
        f"{s['paired_ratio_geomean']:.3f}, interquartile {s['paired_ratio_q1_q3'][0]:.3f}.."
        f"{s['paired_ratio_q1_q3'][1]:.3f}; ratio of medians {s['ratio_of_medians']:.3f} (target <= 1.02)"
    )
    print(f"results: {out / 'adapter_overhead.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
