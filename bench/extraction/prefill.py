"""The ``prefill`` side: plain vLLM, ``LLM.generate`` with ``max_tokens=1``, nothing of vllm-compat in the process.

It runs on the engine settings the generator ended up with (dtype, block size, max_num_seqs,
max_num_batched_tokens, prefix caching off, async scheduling as the generator had it, eager mode, the same KV-cache
size where vLLM takes ``kv_cache_memory_bytes``, the same attention backend and model runner). One ``LLM``, every
round of timed calls on it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .common import (
    Partial,
    Rounds,
    install_step_timer,
    log,
    memory_report,
    prompt_calls,
    read_step_timer,
    reset_peak,
    runner_info,
    tokens_of,
)


def engine_kwargs(args: argparse.Namespace, engine: dict) -> dict:
    """``LLM(...)`` arguments for the engine settings the generator ended up with (prefill and native sides)."""
    kwargs = {
        "model": args.model_dir,
        "dtype": engine["dtype"],
        "max_model_len": engine["max_model_len"],
        "enable_prefix_caching": engine["enable_prefix_caching"],
        "max_num_seqs": engine["max_num_seqs"],
        "max_num_batched_tokens": engine["max_num_batched_tokens"],
        "async_scheduling": engine["async_scheduling"],
        "enforce_eager": engine["enforce_eager"],
        "gpu_memory_utilization": engine["gpu_memory_utilization"],
        "seed": 0,
    }
    if engine.get("block_size"):
        kwargs["block_size"] = engine["block_size"]
    if engine.get("kv_cache_bytes") and args.device == "cuda":
        kwargs["kv_cache_memory_bytes"] = engine["kv_cache_bytes"]
    if args.attention_backend:
        kwargs["attention_backend"] = args.attention_backend
    return kwargs


def shutdown(llm) -> None:
    """Stop an ``LLM``'s engine process and its workers: a side ends in ``os._exit``, which skips vLLM's clean-up,
    and an engine left behind keeps running with its KV cache (host memory on a CPU) after the side is gone."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # an engine that died already; say so, the result stands
        print(f"[bench] shutting vLLM's engine down: {type(exc).__name__}: {exc}", flush=True)


def side_prefill(args: argparse.Namespace, out: Path, extra: dict, partial: Partial) -> dict:
    t0 = time.perf_counter()
    import torch
    from vllm import LLM, SamplingParams

    name = extra["name"]
    kwargs = engine_kwargs(args, extra["engine"])
    llm = LLM(**kwargs)
    result = partial.result
    result |= {
        "init_seconds": time.perf_counter() - t0,
        "runner": llm.collective_rpc(runner_info)[0],
        "settings": kwargs,
        "warmup": [],
        "rounds": [],
        "torch": torch.__version__,
    }
    log(out, name, f"LLM ready in {result['init_seconds']:.1f}s; {result['runner']}")
    llm.collective_rpc(install_step_timer)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    calls = prompt_calls(args)

    def one_call(call: list[list[int]]) -> dict:
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in call], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        if len(outputs) != len(call):
            raise RuntimeError(f"generate() returned {len(outputs)} outputs for {len(call)} prompts")
        return {"seconds": elapsed, "worker_steps": llm.collective_rpc(read_step_timer)[0]}

    try:
        for i in range(args.warmup_calls):
            result["warmup"].append(one_call(calls[i]))
            log(out, name, f"warm-up call {i}: {result['warmup'][-1]['seconds']:.3f}s")
        llm.collective_rpc(reset_peak)
        rounds = Rounds(extra.get("rounds", args.repeat), extra.get("deadline"))
        for r in rounds:
            done: list[dict] = []
            result["rounds"].append({"calls": done})
            for j, call in enumerate(calls[args.warmup_calls :]):
                done.append(one_call(call))
                partial.write()
                log(out, name, f"round {r + 1} call {j}: {tokens_of(call)} tokens in {done[-1]['seconds']:.3f}s")
        result["stopped"] = rounds.stopped
        result["memory"] = llm.collective_rpc(memory_report)[0]
    finally:
        shutdown(llm)
    return result
