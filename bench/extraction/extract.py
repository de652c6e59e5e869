"""The ``extract`` side: speculators' unchanged ``VllmHiddenStatesGenerator`` with ``import vllm_compat`` first.

One ``generate()`` per call of ``--seqs-per-call`` prompts; the states of the chosen layers (speculators' default
choice unless ``--extract-layers``) come back as CPU tensors. The generator is built once; every round of timed
calls runs on it. Measured apart per call, from this process: the engine steps and the scheduler, the one
``_get_captured_states`` RPC that hands the states over, and what follows it (speculators' ``.clone().cpu()`` of
every state and its ``empty_cache``); from the worker, after the call and outside its timing, the hand-over's own
statistics (``handover_stats``). After the timed calls: what speculators' copy of one call's states costs where it
really copies (what the hand-over saves).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from .common import (
    ROOT,
    Partial,
    Rounds,
    install_step_timer,
    load_project_file,
    log,
    memory_report,
    pickle_by_value,
    prompt_calls,
    read_step_timer,
    reset_peak,
    runner_info,
    save_sample,
    tokens_of,
)
from .config import check_call, check_positions
from .trace import StallWatch, install_slab_trace, read_slab_trace


def handover_stats(worker=None) -> dict | None:
    """The hand-over's statistics for the worker's last call, read in the worker after the call:
    ``vllm_compat.transport.worker_stats()`` (``bytes``; ``seconds``, the hand-over's time left exposed at the end of
    the call; ``overlapped_seconds``, spent putting rows in place during the steps; ``slab_reused``; ``made_now``;
    ``waited_seconds``; ``pinned``). None where vllm-compat has no such function: the summary then says n/a."""
    try:
        from vllm_compat import transport
    except ImportError:
        return None
    stats = getattr(transport, "worker_stats", None)
    return {**dict(stats() or {}), "source": "transport.worker_stats"} if callable(stats) else None


pickle_by_value(__name__)


class CallTiming:
    """Times, from the generator's process, the RPCs by name, the scheduler and the engine steps of ``generate()``,
    and counts the steps (instance attributes only: nothing of speculators or vLLM is patched)."""

    def __init__(self, generator) -> None:
        self.rpc: dict[str, float] = {}
        self.marks: dict[str, float] = {}  # when each RPC returned
        self.phases: dict[str, float] = {}
        self.steps: list[list[int]] = []  # per step: [sequences, tokens]
        self.first_step: float | None = None  # when the call's first engine step was sent
        executor = generator.executor
        self.original_rpc = executor.collective_rpc

        def timed_rpc(method, *a, **kw):
            start = time.perf_counter()
            try:
                return self.original_rpc(method, *a, **kw)
            finally:
                if isinstance(method, str):
                    self.marks[method] = time.perf_counter()
                    self.rpc[method] = self.rpc.get(method, 0.0) + self.marks[method] - start

        executor.collective_rpc = timed_rpc
        self._time(generator.scheduler, "schedule")
        self._time(generator.scheduler, "add_request")
        self._time(executor, "execute_model", self._count_step)
        if hasattr(executor, "sample_tokens"):
            self._time(executor, "sample_tokens")

    def _count_step(self, scheduler_output=None, *_a, **_kw) -> None:
        """A step the engine runs: its sequences and tokens (the scheduler also plans one that never runs)."""
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        if scheduled:
            if self.first_step is None:
                self.first_step = time.perf_counter()
            self.steps.append([len(scheduled), int(sum(scheduled.values()))])

    def _time(self, owner, name: str, first=None) -> None:
        original = getattr(owner, name)

        def call(*a, **kw):
            if first is not None:
                first(*a, **kw)
            start = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                self.phases[name] = round(self.phases.get(name, 0.0) + time.perf_counter() - start, 4)

        setattr(owner, name, call)

    def reset(self) -> None:
        self.rpc.clear()
        self.marks.clear()
        self.phases.clear()
        self.steps = []
        self.first_step = None


def side_extract(args: argparse.Namespace, out: Path, extra: dict, partial: Partial) -> dict:
    t0 = time.perf_counter()
    import vllm_compat  # first, before speculators, as a user's script does

    # isort: split
    import torch
    from speculators.data_generation import vllm_hidden_states_generator as gen_module

    if args.attention_backend:
        load_project_file(ROOT / "tests" / "gpu" / "extract.py").force_attention_backend(
            gen_module, args.attention_backend
        )
    layers = [int(x) for x in args.extract_layers.split(",")] if args.extract_layers else None
    generator = gen_module.VllmHiddenStatesGenerator(
        model_path=args.model_dir,
        layer_ids=layers,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    name = extra["name"]
    timing = CallTiming(generator)
    rpc = timing.original_rpc  # the bench's own RPCs, outside the timings
    runner = rpc(runner_info)[0]
    rpc(install_step_timer)
    watch = StallWatch() if args.trace_slabs and rpc(install_slab_trace)[0] else None
    result = partial.result
    result |= {
        "init_seconds": time.perf_counter() - t0,
        "layers": list(generator.layer_ids),
        "runner": runner,
        "engine": engine_settings(args, generator.vllm_config),
        "warmup": [],
        "rounds": [],
        "torch": torch.__version__,
    }
    log(out, name, f"generator ready in {result['init_seconds']:.1f}s; layers {generator.layer_ids}; {runner}")
    hidden = generator.vllm_config.model_config.get_hidden_size()
    calls = prompt_calls(args)
    requested = list(generator.layer_ids)  # one state per id, in this order (a repeated id's state is a copy)
    checked = sorted(set(requested))  # each layer once, in the model's order, as the other sides keep them

    def one_call(call: list[list[int]]) -> tuple[list[dict], dict]:
        timing.reset()
        start = time.perf_counter()
        results = generator.generate(call)
        end = time.perf_counter()
        if len(results) != len(call):
            raise RuntimeError(f"generate() returned {len(results)} results for {len(call)} prompts")
        for ids, got in zip(call, results, strict=True):
            if got["input_ids"].tolist() != ids or len(got["hidden_states"]) != len(requested):
                raise RuntimeError("generate() returned other prompts, or another number of layers, than asked")
            if any(h.shape != (len(ids), hidden) for h in got["hidden_states"]):
                raise RuntimeError(f"states of shapes {[tuple(h.shape) for h in got['hidden_states']]}")
        entry = {
            "seconds": end - start,
            "collect_seconds": timing.rpc.get("_get_captured_states", 0.0),
            # after the states arrived: speculators copies them out (``.clone().cpu()``) and empties the CUDA cache
            "after_seconds": end - timing.marks.get("_get_captured_states", end),
            # before the first engine step: speculators builds and adds its requests, the capture's plan is sent
            "before_seconds": (timing.first_step or end) - start,
            "rpc_seconds": {name: round(seconds, 6) for name, seconds in timing.rpc.items()},
            "phases": dict(timing.phases),
            "steps": timing.steps,
            "handover": (rpc(handover_stats) or [None])[0],
            "worker_steps": rpc(read_step_timer)[0],
        }
        if watch is not None:  # --trace-slabs: on the one clock of the host (perf_counter)
            entry["clock"] = {"start": start, "first_step": timing.first_step, "end": end}
            entry["slab_trace"] = rpc(read_slab_trace)[0]
            entry["caller_stalls"] = watch.take()
        return results, entry

    for i in range(args.warmup_calls):
        # the warm-up's results are dropped at once: kept (as ``_`` did until 2026-12-06), they held one of the
        # worker's slabs through every round, which no caller's loop does
        entry = one_call(calls[i])[1]
        result["warmup"].append(entry)
        log(out, name, f"warm-up call {i}: {entry['seconds']:.3f}s; hand-over {brief(entry['handover'])}")
    rpc(reset_peak)
    reset_peak()
    rounds = Rounds(extra.get("rounds", args.repeat), extra.get("deadline"))
    results: list[dict] = []
    for r in rounds:
        done: list[dict] = []
        result["rounds"].append({"calls": done})
        for j, call in enumerate(calls[args.warmup_calls :]):
            results, entry = one_call(call)
            done.append(entry)
            partial.write()
            log(
                out,
                name,
                f"round {r + 1} call {j}: {tokens_of(call)} tokens in {entry['seconds']:.3f}s (collecting states "
                f"{entry['collect_seconds']:.3f}s, after it {entry['after_seconds']:.3f}s; hand-over "
                f"{brief(entry['handover'])}; {len(entry['steps'])} steps; {entry['phases']})",
            )
            if r == 0 and args.warmup_calls + j == check_call(args) and extra.get("sample"):
                positions = check_positions(args)
                states = [[results[p]["hidden_states"][requested.index(k)] for k in checked] for p in positions]
                save_sample(out, name, call, positions, checked, states)  # copied out: the views go now, which
                del states  # held their call's slab (as ``_`` held the warm-up's) through every later call
                result["check_steps"] = entry["steps"]
    result["stopped"] = rounds.stopped
    steps = getattr(generator.executor, "_vllm_compat_steps", None)  # vllm-compat's steps-in-flight, where it runs
    result["steps_in_flight"] = None if steps is None else {"depth": steps.depth, "peak": steps.peak}
    log(out, name, f"engine steps in flight: {result['steps_in_flight'] or 'one at a time'}")
    scheduler_config = getattr(getattr(generator, "vllm_config", None), "scheduler_config", None)
    result["async_scheduling"] = getattr(scheduler_config, "async_scheduling", None)  # on: workers' output thread
    log(out, name, f"async scheduling (where each worker waits for a step's output): {result['async_scheduling']}")
    # speculators' copy of the returned states where it really copies (without the hand-over): timed alone
    copy_seconds = []
    for _ in range(2):
        start = time.perf_counter()
        copies = [h.clone() for got in results for h in got["hidden_states"]]
        copy_seconds.append(time.perf_counter() - start)
        del copies
    result["copy_states_seconds"] = min(copy_seconds)
    log(out, name, f"cloning one call's returned states again in this process: {min(copy_seconds):.3f}s")
    del results
    if args.profile:
        profile_one_call(out, name, generator, calls[-1])
    result["memory"] = rpc(memory_report)[0]
    result["parent_memory"] = memory_report()
    result["applied"] = sorted(vllm_compat.status()["applied"])
    result["torch_threads"] = torch.get_num_threads()
    generator.executor.shutdown()
    return result


def brief(stats: dict | None) -> str:
    """One line of the hand-over's statistics for a progress line."""
    if not stats:
        return "n/a"
    keys = ("bytes", "seconds", "overlapped_seconds", "waited_seconds", "slab_reused", "pinned")
    parts = []
    for key in keys:
        value = stats.get(key)
        if key == "bytes" and isinstance(value, (int, float)):
            parts.append(f"{value / 2**20:.0f} MiB")
        elif isinstance(value, float):
            parts.append(f"{key} {value:.4f}")
        else:
            parts.append(f"{key} {'n/a' if value is None else value}")
    return ", ".join(parts)


def engine_settings(args: argparse.Namespace, config) -> dict:
    """The engine settings the generator ended up with: the prefill and native sides run on the same."""
    return {
        "dtype": str(config.model_config.dtype).replace("torch.", ""),
        "max_model_len": config.model_config.max_model_len,
        "block_size": config.cache_config.block_size,
        "enable_prefix_caching": bool(config.cache_config.enable_prefix_caching),
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "enable_chunked_prefill": bool(getattr(config.scheduler_config, "enable_chunked_prefill", True)),
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "enforce_eager": bool(config.model_config.enforce_eager),
        "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
        "attention_backend": args.attention_backend,
        "VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
    }


def profile_one_call(out: Path, name: str, generator, call: list[list[int]]) -> None:
    """One more call under cProfile (not timed): where the generator's process spends its time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    generator.generate(call)
    profiler.disable()
    for order, count in (("tottime", 25), ("cumulative", 40)):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(count)
        log(out, name, f"profile of one call (the generator's process, by {order}):\n" + text.getvalue())
