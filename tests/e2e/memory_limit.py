"""A real generator for a 16k-token context inside a container's memory limit (run by tests/e2e/test_memory_limit.py,
already inside the limit's cgroup).

    python tests/e2e/memory_limit.py --model DIR --out OUT.json

Records the worker's states memory (its slabs: the ``memfd:vllm-compat-states`` mappings in /proc/PID/maps) after
start, while results are held, after they are dropped (without another call) and after later calls; every state is
judged against transformers' float32 forward.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

from faults import LAYERS, Judge, _worker_pids, prompts

SLAB_NAME = "memfd:vllm-compat-states"


def slab_bytes(pids: list[int]) -> int:
    """The states memory the worker processes map (each slab is mapped once, shared, in the worker that made it)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if SLAB_NAME in line:
                        start, end = (int(x, 16) for x in line.split()[0].split("-"))
                        total += end - start
        except OSError:
            continue
    return total


def settle(pids: list[int], seconds: float = 5.0) -> int:
    """The slab bytes once they stop changing (slabs are made and closed by the worker's threads)."""
    last, deadline = -1, time.monotonic() + seconds
    while time.monotonic() < deadline:
        now = slab_bytes(pids)
        if now == last:
            return now
        last = now
        time.sleep(0.5)
    return last


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-model-len", type=int, default=16384)
    args = parser.parse_args()
    import vllm_compat  # first, as in a user's script

    record: dict[str, Any] = {"installed": vllm_compat.status()["installed"]}
    from speculators.data_generation import vllm_hidden_states_generator as gen_module

    original = gen_module.ModelConfig

    def float32(*a: Any, **kw: Any) -> Any:
        kw["dtype"] = "float32"  # a test-harness choice: compare with transformers at 1e-4
        return original(*a, **kw)

    gen_module.ModelConfig = float32
    generator = gen_module.VllmHiddenStatesGenerator(
        model_path=args.model, layer_ids=LAYERS, max_model_len=args.max_model_len
    )
    workers = _worker_pids()
    record["workers"] = len(workers)
    record["slab_bytes_at_start"] = settle(workers)
    judge = Judge(args.model)
    worst, held = 0.0, []
    for seed in range(6):
        call = prompts(seed, 8, 256)
        results = generator.generate(call)
        worst = max(worst, judge.worst(call, results))
        held.append(results)
    record["call_bytes"] = sum(h.numel() * h.element_size() for r in held[-1] for h in r["hidden_states"])
    record["slab_bytes_holding_6_calls"] = settle(workers)
    del held, results
    gc.collect()
    record["slab_bytes_after_dropping"] = settle(workers)
    for seed in range(6, 10):
        call = prompts(seed, 8, 256)
        worst = max(worst, judge.worst(call, generator.generate(call)))
    record["slab_bytes_after_later_calls"] = settle(workers)
    record["calls"] = 10
    record["worst"] = worst
    record["workers_alive"] = all(os.path.exists(f"/proc/{pid}") for pid in workers)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    generator.executor.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
