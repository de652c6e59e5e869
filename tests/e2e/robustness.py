"""Drive speculators' generator (with ``import vllm_compat`` first) through bad input and failures; record all of it.

Run by tests/e2e/test_bad_input.py and tests/e2e/test_constructor_failures.py in a fresh interpreter, one engine at a
time. Every call runs in a thread joined with a timeout, so a hang is recorded as one instead of stalling the test.
For each case the JSON written to ``--out`` holds what the user sees (exception type and message, or a summary of the
result), how long it took, whether a following valid call still works, and which vLLM worker processes are running.

    python tests/e2e/robustness.py inputs --model DIR --out OUT.json       # one generator, every bad input, then a
                                                                           # worker killed in the middle of generate()
    python tests/e2e/robustness.py constructor --model DIR --out OUT.json  # constructor failures, before and after
                                                                           # the executor started its workers
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import procs  # tests/e2e/procs.py (this folder is sys.path[0] when run as a script)

CALL_TIMEOUT = 180.0  # seconds one generate() may take before it counts as a hang
GONE_TIMEOUT = 30.0  # seconds workers may take to exit after a failure
LAYERS = [0, 2, 3]
VALID = [[5, 6, 7, 8], [9, 10, 11]]
RECORD: dict[str, Any] = {"cases": {}, "pid": os.getpid()}
BOX: dict[str, Any] = {}  # the generator the last successful constructor call built
LAST: dict[str, BaseException] = {}  # the last error, traceback and all


def call(fn: Callable[[], Any], timeout: float = CALL_TIMEOUT) -> dict[str, Any]:
    """Run ``fn`` in a thread; its outcome: ok (with a summary), error (type, message) or hang."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = LAST["error"] = exc  # kept alive, with its traceback, as a user's `except` block would
            box["trace"] = traceback.format_exc(limit=30)

    start = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    seconds = round(time.monotonic() - start, 2)
    if thread.is_alive():
        return {"outcome": "hang", "seconds": seconds}
    if "error" in box:
        exc = box["error"]
        return {
            "outcome": "error",
            "error_type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "message": str(exc),
            "notes": list(getattr(exc, "__notes__", [])),
            "trace": box["trace"][-4000:],
            "seconds": seconds,
        }
    return {"outcome": "ok", "result": summarize(box.get("value")), "seconds": seconds}


def summarize(results: Any) -> Any:
    """generate()'s results as plain data: per sequence, its input length and each layer's shape."""
    if not isinstance(results, list):
        return repr(results)[:200]
    return [
        {
            "input_ids": r["input_ids"].tolist()[:8],
            "input_len": len(r["input_ids"]),
            "shapes": [list(h.shape) for h in r["hidden_states"]],
            "dtypes": sorted({str(h.dtype) for h in r["hidden_states"]}),
        }
        for r in results
    ]


def worker_pids() -> list[dict[str, Any]]:
    return [{"pid": p.pid, "cmdline": p.cmdline[:120]} for p in procs.workers()]


def record(name: str, outcome: dict[str, Any]) -> None:
    RECORD["cases"][name] = outcome
    print(
        f"[robustness] {name}: {outcome['outcome']} {outcome.get('error_type', '')} "
        f"{outcome.get('message', '')[:300]!r} ({outcome['seconds']} s)",
        flush=True,
    )
    flush()


def flush() -> None:
    with open(ARGS.out, "w") as f:
        json.dump(RECORD, f, indent=2)


def build(gen_module: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("model_path", ARGS.model)
    kwargs.setdefault("layer_ids", LAYERS)
    kwargs.setdefault("max_model_len", ARGS.max_model_len)
    return gen_module.VllmHiddenStatesGenerator(**kwargs)


def still_usable(generator: Any) -> dict[str, Any]:
    after = call(lambda: generator.generate(VALID))
    after["valid_results"] = (
        after.get("outcome") == "ok"
        and [r["input_len"] for r in after["result"]] == [len(s) for s in VALID]
        and all(len(r["shapes"]) == len(generator.layer_ids) for r in after["result"])
    )
    after["workers"] = worker_pids()
    return after


# -- scenarios ----------------------------------------------------------------------------------------------------
def scenario_inputs(gen_module: Any) -> None:
    import torch
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(ARGS.model).vocab_size
    max_len = ARGS.max_model_len
    RECORD.update(vocab_size=vocab, max_model_len=max_len, speculators=_speculators_version())
    started = call(lambda: build(gen_module), timeout=600)
    record("start", started)
    if started["outcome"] != "ok":
        return
    generator = BOX.pop("generator")
    RECORD["workers_at_start"] = worker_pids()
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("valid", lambda: generator.generate(VALID)),
        ("empty_batch", lambda: generator.generate([])),
        ("empty_batch_tensor", lambda: generator.generate(torch.empty((0, 4), dtype=torch.long))),
        ("empty_sequence", lambda: generator.generate([[]])),
        ("empty_sequence_in_batch", lambda: generator.generate([[5, 6, 7], []])),
        ("longer_than_max_model_len", lambda: generator.generate([[4 + i % 100 for i in range(max_len + 10)]])),
        ("token_id_too_large", lambda: generator.generate([[5, 6, vocab + 10]])),
        ("token_id_negative", lambda: generator.generate([[5, -1, 6]])),
        ("token_id_not_an_int", lambda: generator.generate([[5, "6", 7]])),
        ("float_tensor", lambda: generator.generate(torch.tensor([[5.0, 6.5, 7.0]]))),
        ("rank1_tensor", lambda: generator.generate(torch.tensor([5, 6, 7]))),
        ("rank3_tensor", lambda: generator.generate(torch.ones((1, 2, 3), dtype=torch.long))),
        ("flat_list", lambda: generator.generate([5, 6, 7])),
        ("tuples", lambda: generator.generate(((5, 6, 7), (8, 9)))),  # valid: taken as lists are
        # more sequences than the scheduler's max_num_seqs (speculators sets 32): valid input
        ("more_sequences_than_max_num_seqs", lambda: generator.generate([[4 + i, 5, 6] for i in range(40)])),
    ]
    for name, fn in cases:
        outcome = call(fn)
        if outcome["outcome"] == "hang":
            record(name, outcome)
            return
        outcome["after"] = still_usable(generator)
        record(name, outcome)
    kill_mid_generate(generator)


def kill_mid_generate(generator: Any) -> None:
    """SIGKILL a worker while generate() runs: the call must fail within CALL_TIMEOUT and the workers must go."""
    victims = procs.workers()
    RECORD["killed"] = [p.pid for p in victims[:1]]
    if not victims:
        record("worker_killed", {"outcome": "skipped", "seconds": 0, "message": "no worker process found"})
        return
    # 32 sequences (speculators' max_num_seqs) of max_model_len - 1 tokens: several scheduler steps, seconds of work
    big = [[4 + (i * 7 + j) % 500 for j in range(ARGS.max_model_len - 1)] for i in range(32)]
    timeline: dict[str, float] = {}

    def kill_soon() -> None:
        time.sleep(0.5)
        timeline["killed"] = time.monotonic()
        os.kill(victims[0].pid, signal.SIGKILL)

    def run_big() -> Any:
        timeline["started"] = time.monotonic()
        try:
            return generator.generate(big)
        finally:
            timeline["returned"] = time.monotonic()

    threading.Thread(target=kill_soon, daemon=True).start()
    outcome = call(run_big)
    outcome["killed_while_running"] = (
        timeline.get("started", 0) < timeline.get("killed", 0) < timeline.get("returned", float("inf"))
    )
    outcome["workers_after"] = [p.pid for p in procs.wait_gone(timeout=GONE_TIMEOUT)]
    outcome["next_call"] = call(lambda: generator.generate(VALID), timeout=60)
    outcome["shutdown"] = call(lambda: generator.executor.shutdown(), timeout=60)
    outcome["workers_after_shutdown"] = [p.pid for p in procs.wait_gone(timeout=GONE_TIMEOUT)]
    record("worker_killed", outcome)


def scenario_constructor(gen_module: Any) -> None:
    RECORD.update(speculators=_speculators_version(), max_model_len=ARGS.max_model_len)
    cases: list[tuple[str, dict[str, Any], dict[str, str]]] = [
        ("layer_out_of_range", {"layer_ids": [0, 7]}, {}),
        ("layer_negative", {"layer_ids": [-1, 2]}, {}),
        ("layer_ids_empty", {"layer_ids": []}, {}),
        ("layer_id_not_an_int", {"layer_ids": [1.5]}, {}),
        ("model_path_missing", {"model_path": "/nonexistent/vllm-compat-test/model"}, {}),
        # the executor is running when KV-cache planning finds no room (a budget of 0 bytes on vLLM's CPU platform)
        ("kv_cache_too_small", {}, {"VLLM_CPU_KVCACHE_SPACE": "0"}),
    ]
    for name, kwargs, env in cases:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            outcome = call(lambda kwargs=kwargs: build(gen_module, **kwargs), timeout=600)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        # still holding the exception (and so its traceback and the half-built generator) here, as a user's
        # `except` block would: the workers must be gone anyway
        outcome["workers_after"] = [p.pid for p in procs.wait_gone(timeout=GONE_TIMEOUT)]
        generator = BOX.pop("generator", None)
        if generator is not None:  # built: check it works, then shut it down
            outcome["after"] = still_usable(generator)
            outcome["shutdown"] = call(lambda generator=generator: generator.executor.shutdown(), timeout=60)
            outcome["workers_after_shutdown"] = [p.pid for p in procs.wait_gone(timeout=GONE_TIMEOUT)]
            del generator
        record(name, outcome)


def _speculators_version() -> str:
    from importlib.metadata import version

    return version("speculators")


def main() -> int:
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["inputs", "constructor"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-model-len", type=int, default=2048)
    ARGS = parser.parse_args()
    import vllm_compat  # noqa: F401  (the user's first line, before speculators)

    # isort: split
    from speculators.data_generation import vllm_hidden_states_generator as gen_module

    original = gen_module.VllmHiddenStatesGenerator

    class Keep(original):  # keeps the generator a case built, so the driver can use it after call() returns
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            BOX["generator"] = self

    gen_module.VllmHiddenStatesGenerator = Keep
    try:
        {"inputs": scenario_inputs, "constructor": scenario_constructor}[ARGS.scenario](gen_module)
    finally:
        RECORD["workers_at_exit"] = worker_pids()
        flush()
    return 0


ARGS: argparse.Namespace

if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.exit(main())
