"""Hidden-state extraction throughput under vllm-compat, side by side with plain vLLM prefill and transformers.

Three sides run on the same random Llama, the same prompts and the same batching, each in its own process (vLLM
spawns its workers and re-imports the main module; a process that initialised CUDA first makes it spawn anyway):

- ``extract``: speculators' unchanged ``VllmHiddenStatesGenerator`` with ``import vllm_compat`` first, one
  ``generate()`` per call of ``--seqs-per-call`` prompts; states for ``--layers`` (speculators' default choice if
  omitted) come back as CPU tensors. Measured apart per call: the engine steps and the scheduler (timed from the
  parent), the one ``_get_captured_states`` RPC that hands the states over (and the worker's copy into a fresh
  shared-memory file, with its bandwidth, and whether that file was ready or made on the spot), and what follows
  it (speculators' ``.clone().cpu()`` of every state, a private mapping under vllm-compat); after the timed calls, what
  that copy costs where it really copies (the time the hand-over saves).
- ``prefill``: ``LLM.generate`` with ``max_tokens=1`` on the engine settings the generator ended up with (dtype,
  block size, max_num_seqs, max_num_batched_tokens, prefix caching off, async scheduling as the generator had it,
  eager mode, the same KV-cache size where vLLM takes ``kv_cache_memory_bytes``, the same attention backend).
- ``hf``: transformers' forward with ``output_hidden_states=True`` and ``logits_to_keep=1``, batched to the same
  token budget per forward as vLLM's step (``max_num_batched_tokens``), copying the same layers' states to the CPU.

Reported: tokens/s per side and the ratios extract/prefill (target >= 0.95) and extract/hf; achieved TFLOP/s and
the fraction of ``--peak-tflops`` (790 on an H200, bf16 dense) counting 2 * params * tokens for the layers, one LM
head row per sequence and causal attention (4 * layers * heads * head_dim * L(L+1)/2 per sequence); peak memory
of the process running the model (``torch.cuda.max_memory_allocated``; peak RSS on the CPU), with the KV cache
apart, and the extraction parent's own peak (the returned states pass through it).

    python bench/extraction_throughput.py --out DIR --attention-backend TRITON_ATTN      # H200: 1B-class model
    python bench/extraction_throughput.py --out DIR --small                              # CPU: anyone can run it

Progress lines and every side's output go to DIR/sides.log, numbers to DIR/results.json, the table to
DIR/summary.md. The random model is written to ``--model-dir`` (default: a temp folder), not to DIR.
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
LARGE = {
    "hidden": 2048,
    "layers": 16,
    "heads": 16,
    "kv_heads": 8,
    "vocab": 32000,
    "seq_len": 1024,
    "seqs_per_call": 32,
    "calls": 8,
    "warmup_calls": 1,
}
SMALL = {
    "hidden": 256,
    "layers": 4,
    "heads": 4,
    "kv_heads": 2,
    "vocab": 1024,
    "seq_len": 256,
    "seqs_per_call": 8,
    "calls": 3,
    "warmup_calls": 1,
}


# ------------------------------------------------------------------------------------------ helpers
def _load(path: Path):
    """Import a file of the project by path: the project root must not go on sys.path, which vLLM's spawned
    workers inherit (they would import vllm_compat from the source tree instead of the installed package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"vllm_compat_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def log(out: Path, side: str, msg: str) -> None:
    """A progress line: on stdout, and in sides.log (a side's stdout already goes there)."""
    line = f"[bench {time.strftime('%H:%M:%S')} {side}] {msg}"
    print(line, flush=True)
    if side == "main":
        with open(out / "sides.log", "a") as f:
            f.write(line + "\n")


def prompt_calls(args: argparse.Namespace) -> list[list[list[int]]]:
    """Warm-up calls first, then timed calls: fixed-length random prompts (no padding on the transformers side)."""
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


def _memory_report(worker=None) -> dict:
    """Peak memory of this process (runs in vLLM's model process through collective_rpc, or in-process)."""
    import resource

    import torch

    report = {"rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        report["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        report["cuda_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    runner = getattr(worker, "model_runner", None)
    caches = getattr(runner, "kv_caches", None)
    if caches:
        try:
            report["kv_cache_bytes"] = sum(t.numel() * t.element_size() for t in _flatten(caches))
        except Exception as exc:  # a layout this report does not know: say so rather than guess
            report["kv_cache_bytes_error"] = repr(exc)
    return report


def _flatten(items):
    for item in items if isinstance(items, (list, tuple)) else [items]:
        if isinstance(item, (list, tuple)):
            yield from _flatten(item)
        else:
            yield item


def _transfer_stats(worker=None) -> dict:
    """The worker's last hand-over of states through shared memory (empty where that adapter is not active)."""
    try:
        from vllm_compat.adapters import transfer
    except ImportError:
        return {}
    return dict(transfer.WRITER.stats)


def _time_phases(generator, seconds: dict) -> dict:
    """Time the scheduler and the engine steps of ``generate()`` from the parent (instance attributes only)."""
    phases: dict = {}

    def timed(owner, name: str) -> None:
        original = getattr(owner, name)

        def call(*a, **kw):
            start = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                phases[name] = round(phases.get(name, 0.0) + time.perf_counter() - start, 4)

        setattr(owner, name, call)

    timed(generator.scheduler, "schedule")
    timed(generator.scheduler, "add_request")
    timed(generator.executor, "execute_model")
    if hasattr(generator.executor, "sample_tokens"):
        timed(generator.executor, "sample_tokens")
    return phases


def _reset_peak(worker=None) -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


# ------------------------------------------------------------------------------------------ sides
def side_build(args: argparse.Namespace, out: Path) -> dict:
    build_random_llama = _load(ROOT / "tests" / "gpu" / "random_llama.py").build_random_llama

    wanted = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "vocab")}
    shape_file = Path(args.model_dir) / "shape.json"
    if shape_file.exists():
        shape = json.loads(shape_file.read_text())
        if all(shape.get(k) == v for k, v in wanted.items()) and shape.get("dtype") == args.dtype:
            log(out, "build", f"reusing {args.model_dir}")
            return shape
    t0 = time.perf_counter()
    shape = build_random_llama(args.model_dir, **wanted, dtype=args.dtype, device=args.device, std=0.02)
    log(out, "build", f"built {shape['params'] / 1e6:.0f}M params on {args.device} in {time.perf_counter() - t0:.1f}s")
    return shape


def side_extract(args: argparse.Namespace, out: Path) -> dict:
    t0 = time.perf_counter()
    import vllm_compat  # first, before speculators, as a user's script does

    # isort: split
    from speculators.data_generation import vllm_hidden_states_generator as gen_module

    if args.attention_backend:
        _load(ROOT / "tests" / "gpu" / "extract.py").force_attention_backend(gen_module, args.attention_backend)
    import torch

    layers = [int(x) for x in args.extract_layers.split(",")] if args.extract_layers else None
    generator = gen_module.VllmHiddenStatesGenerator(
        model_path=args.model_dir,
        layer_ids=layers,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    init = time.perf_counter() - t0
    log(out, "extract", f"generator ready in {init:.1f}s; layers {generator.layer_ids}")
    executor = generator.executor
    rpc_seconds: dict[str, float] = {}
    marks: dict[str, float] = {}
    original_rpc = executor.collective_rpc

    def timed_rpc(method, *a, **kw):
        start = time.perf_counter()
        try:
            return original_rpc(method, *a, **kw)
        finally:
            if isinstance(method, str):
                marks[method] = time.perf_counter()
                rpc_seconds[method] = rpc_seconds.get(method, 0.0) + marks[method] - start

    executor.collective_rpc = timed_rpc
    phases = _time_phases(generator, rpc_seconds)  # scheduler and engine steps, timed from the parent
    calls = prompt_calls(args)
    times, collect, after, worker_pack, breakdown = [], [], [], [], []
    results = []
    for i, call in enumerate(calls):
        if i == args.warmup_calls:
            executor.collective_rpc(_reset_peak)
            _reset_peak()
        rpc_seconds.clear()
        marks.clear()
        start = time.perf_counter()
        results = generator.generate(call)
        end = time.perf_counter()
        elapsed = end - start
        assert len(results) == len(call)
        for ids, result in zip(call, results, strict=True):
            assert result["input_ids"].tolist() == ids
            assert all(
                h.shape == (len(ids), generator.vllm_config.model_config.get_hidden_size())
                for h in result["hidden_states"]
            )
        # after the states arrived: speculators copies them out (``.clone().cpu()``) and empties the CUDA cache
        tail = end - marks.get("_get_captured_states", end)
        pack = (original_rpc(_transfer_stats) or [{}])[0]  # the worker's side of the hand-over (outside the timing)
        if i >= args.warmup_calls:
            times.append(elapsed)
            collect.append(rpc_seconds.get("_get_captured_states", 0.0))
            after.append(tail)
            worker_pack.append(pack)
            breakdown.append(dict(rpc_seconds))
        got = rpc_seconds.get("_get_captured_states", 0.0)
        log(
            out,
            "extract",
            f"call {i}: {sum(map(len, call))} tokens in {elapsed:.3f}s "
            f"(collecting states {got:.3f}s, of it the worker's "
            f"copy into its file {pack.get('seconds', float('nan')):.3f}s for "
            f"{pack.get('bytes', 0) / 2**20:.0f} MiB, pinned staging={pack.get('pinned')}, "
            f"file made on the spot={pack.get('made_now')} (waited {pack.get('waited_seconds', float('nan')):.3f}s "
            f"for the spare); "
            f"after it {tail:.3f}s; steps {phases})",
        )
        phases.clear()
    # speculators' copy of the returned states where it really copies (without the hand-over): timed alone
    copy_seconds = []
    for _ in range(3):
        start = time.perf_counter()
        copies = [h.clone() for r in results for h in r["hidden_states"]]
        copy_seconds.append(time.perf_counter() - start)
        del copies
    log(out, "extract", f"cloning one call's returned states again in this process: {min(copy_seconds):.3f}s")
    if args.profile:  # one more call under cProfile (not timed): where the generator's process spends its time
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        generator.generate(calls[-1])
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        log(out, "extract", "profile of one call (the generator's process, by own time):\n" + text.getvalue())
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
        log(out, "extract", "profile of one call (cumulative):\n" + text.getvalue())
    threads = __import__("torch").get_num_threads()
    log(out, "extract", f"torch threads in the generator's process between calls: {threads}")
    workers = executor.collective_rpc(_memory_report)
    parent = _memory_report()
    config = generator.vllm_config
    engine = {
        "dtype": str(config.model_config.dtype).replace("torch.", ""),
        "max_model_len": config.model_config.max_model_len,
        "block_size": config.cache_config.block_size,
        "enable_prefix_caching": bool(config.cache_config.enable_prefix_caching),
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "enforce_eager": bool(config.model_config.enforce_eager),
        "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
        "VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
        "attention_backend": args.attention_backend,
    }
    applied = sorted(vllm_compat.status()["applied"])
    executor.shutdown()
    hidden = config.model_config.get_hidden_size()
    return {
        "init_seconds": init,
        "call_seconds": times,
        "collect_seconds": collect,
        "after_collect_seconds": after,
        "worker_pack": worker_pack,
        "rpc_breakdown": breakdown,
        "copy_states_seconds": min(copy_seconds),
        "layers": list(generator.layer_ids),
        "hidden": hidden,
        "engine": engine,
        "memory": workers[0],
        "parent_memory": parent,
        "applied": applied,
        "torch": torch.__version__,
    }


def side_prefill(args: argparse.Namespace, out: Path, engine: dict) -> dict:
    t0 = time.perf_counter()
    import torch
    from vllm import LLM, SamplingParams

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
    llm = LLM(**kwargs)
    init = time.perf_counter() - t0
    log(out, "prefill", f"LLM ready in {init:.1f}s")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    times = []
    for i, call in enumerate(prompt_calls(args)):
        if i == args.warmup_calls:
            llm.collective_rpc(_reset_peak)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in call], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert len(outputs) == len(call)
        if i >= args.warmup_calls:
            times.append(elapsed)
        log(out, "prefill", f"call {i}: {sum(map(len, call))} tokens in {elapsed:.3f}s")
    memory = llm.collective_rpc(_memory_report)[0]
    return {
        "init_seconds": init,
        "call_seconds": times,
        "memory": memory,
        "settings": kwargs,
        "torch": torch.__version__,
    }


def side_hf(args: argparse.Namespace, out: Path, layers: list[int], per_forward_tokens: int) -> dict:
    import torch
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM

    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, **{key: dtype}).to(args.device).eval()
    cuda = args.device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    batch = max(1, per_forward_tokens // args.seq_len)
    times, forward_times = [], []
    with torch.no_grad():
        for i, call in enumerate(prompt_calls(args)):
            if i == args.warmup_calls:
                _reset_peak()
            sync()
            start = time.perf_counter()
            forward = 0.0
            delivered = []
            for b in range(0, len(call), batch):
                ids = torch.tensor(call[b : b + batch], device=args.device)
                f0 = time.perf_counter()
                output = model(ids, output_hidden_states=True, logits_to_keep=1)
                sync()
                forward += time.perf_counter() - f0
                on_cpu = [output.hidden_states[layer + 1].cpu() for layer in layers]
                delivered += [[h[j] for h in on_cpu] for j in range(ids.shape[0])]
            elapsed = time.perf_counter() - start
            assert len(delivered) == len(call)
            if i >= args.warmup_calls:
                times.append(elapsed)
                forward_times.append(forward)
            log(out, "hf", f"call {i}: {sum(map(len, call))} tokens in {elapsed:.3f}s (forward {forward:.3f}s)")
    return {
        "call_seconds": times,
        "forward_seconds": forward_times,
        "sequences_per_forward": batch,
        "memory": _memory_report(),
        "transformers": transformers.__version__,
        "attn_implementation": model.config._attn_implementation,
    }


# ------------------------------------------------------------------------------------------ orchestration
def run_side(args: argparse.Namespace, out: Path, side: str, extra: dict | None = None) -> dict | None:
    result_file = out / f".{side}.json"
    result_file.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--side",
        side,
        "--side-input",
        json.dumps(extra or {}),
        *args.passthrough,
    ]
    env = {
        **os.environ,
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("VLLM_COMPAT_DISABLE", None)
    if side == "prefill":  # the same model runner as the generator's (vllm-compat may pin V1 there)
        if (extra or {}).get("VLLM_USE_V2_MODEL_RUNNER") is not None:
            env["VLLM_USE_V2_MODEL_RUNNER"] = extra["VLLM_USE_V2_MODEL_RUNNER"]
        env["VLLM_COMPAT_DISABLE"] = "1"  # plain vLLM: nothing of vllm-compat in that process
    if args.device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    timeout = args.side_timeout
    if args.time_budget:
        timeout = min(timeout, max(1, int(args.started + args.time_budget - time.time())))
    log(out, "main", f"side {side} starting (timeout {timeout}s)")
    start = time.perf_counter()
    with open(out / "sides.log", "a") as sink:
        try:
            done = subprocess.run(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout, check=False)
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    log(out, "main", f"side {side} exited {code} after {time.perf_counter() - start:.0f}s")
    if result_file.exists():
        result = json.loads(result_file.read_text())
        result_file.unlink()
        return result
    return None


def summarize(args: argparse.Namespace, shape: dict, results: dict) -> tuple[dict, str]:
    calls = prompt_calls(args)[args.warmup_calls :]
    tokens = sum(len(s) for c in calls for s in c)
    total_flops = flops(shape, calls)
    rows, numbers = [], {"tokens_timed": tokens, "flops_timed": total_flops}
    for side in ("extract", "prefill", "hf"):
        r = results.get(side)
        if not r:
            continue
        seconds = sum(r["call_seconds"])
        numbers[f"{side}_tokens_per_s"] = tokens / seconds
        # per call, the median: one slow call (a late compile, a collection) moves the total, not this
        numbers[f"{side}_median_tokens_per_s"] = tokens / len(calls) / statistics.median(r["call_seconds"])
        numbers[f"{side}_tflops"] = total_flops / seconds / 1e12
        if args.peak_tflops:
            numbers[f"{side}_peak_fraction"] = numbers[f"{side}_tflops"] / args.peak_tflops
        mem = r["memory"]
        peak = mem.get("cuda_peak_allocated_bytes", mem.get("rss_peak_bytes"))
        kv = mem.get("kv_cache_bytes")
        numbers[f"{side}_peak_bytes"] = peak
        numbers[f"{side}_kv_cache_bytes"] = kv
        if kv is not None and peak is not None and "cuda_peak_allocated_bytes" in mem:
            numbers[f"{side}_peak_without_kv_bytes"] = peak - kv
        rows.append((side, seconds, r))
    if results.get("extract"):
        e = results["extract"]
        numbers["extract_collect_fraction"] = sum(e["collect_seconds"]) / sum(e["call_seconds"])
        # everything but the one RPC that returns the states: the engine steps and the parent's own work
        loop = [c - g for c, g in zip(e["call_seconds"], e["collect_seconds"], strict=True)]
        numbers["extract_without_collect_tokens_per_s"] = tokens / sum(loop)
        numbers["extract_without_collect_median_tokens_per_s"] = tokens / len(calls) / statistics.median(loop)
        if results.get("hf"):
            numbers["hf_forward_only_tokens_per_s"] = tokens / sum(results["hf"]["forward_seconds"])
        if e.get("after_collect_seconds"):
            numbers["extract_after_collect_fraction"] = sum(e["after_collect_seconds"]) / sum(e["call_seconds"])
        if e.get("copy_states_seconds"):
            numbers["copy_states_seconds"] = e["copy_states_seconds"]  # per call, saved by the hand-over
        packs = [p for p in e.get("worker_pack") or [] if p.get("seconds") is not None]
        if packs:
            numbers["worker_pack_seconds_median"] = statistics.median(p["seconds"] for p in packs)
            numbers["worker_pack_gbytes_per_s"] = (
                statistics.median(p["bytes"] for p in packs) / 1e9 / numbers["worker_pack_seconds_median"]
            )
            numbers["worker_pack_pinned"] = all(p.get("pinned") for p in packs)
            numbers["worker_spare_ready_fraction"] = sum(not p.get("made_now") for p in packs) / len(packs)
            numbers["worker_wait_seconds_median"] = statistics.median(p.get("waited_seconds", 0.0) for p in packs)
        numbers["extract_parent_peak_bytes"] = e["parent_memory"].get(
            "cuda_peak_allocated_bytes", e["parent_memory"].get("rss_peak_bytes")
        )
    for other in ("prefill", "hf"):
        if "extract_tokens_per_s" in numbers and f"{other}_tokens_per_s" in numbers:
            numbers[f"ratio_extract_vs_{other}"] = numbers["extract_tokens_per_s"] / numbers[f"{other}_tokens_per_s"]
            numbers[f"ratio_extract_vs_{other}_median"] = (
                numbers["extract_median_tokens_per_s"] / numbers[f"{other}_median_tokens_per_s"]
            )
    if "extract_without_collect_tokens_per_s" in numbers and "prefill_tokens_per_s" in numbers:
        numbers["ratio_extract_without_collect_vs_prefill"] = (
            numbers["extract_without_collect_tokens_per_s"] / numbers["prefill_tokens_per_s"]
        )
        numbers["ratio_extract_without_collect_vs_prefill_median"] = (
            numbers["extract_without_collect_median_tokens_per_s"] / numbers["prefill_median_tokens_per_s"]
        )
    if "extract_peak_bytes" in numbers and "prefill_peak_bytes" in numbers:
        numbers["ratio_peak_memory_extract_vs_prefill"] = numbers["extract_peak_bytes"] / numbers["prefill_peak_bytes"]
        if "extract_peak_without_kv_bytes" in numbers and "prefill_peak_without_kv_bytes" in numbers:
            numbers["ratio_peak_without_kv_extract_vs_prefill"] = (
                numbers["extract_peak_without_kv_bytes"] / numbers["prefill_peak_without_kv_bytes"]
            )

    gib = 1 << 30
    lines = [
        f"model: random Llama, hidden {shape['hidden']}, {shape['layers']} layers, {shape['heads']} heads "
        f"({shape['kv_heads']} KV), vocab {shape['vocab']}, {shape['params'] / 1e6:.0f}M params, {shape['dtype']}, "
        f"device {args.device}",
        f"prompts: {args.calls} timed calls (+{args.warmup_calls} warm-up) of {args.seqs_per_call} x {args.seq_len} "
        f"tokens = {tokens} tokens timed; {total_flops / 1e12:.1f} TFLOP",
        "",
        "| side | tokens/s | median call tok/s | TFLOP/s | of peak | peak mem GiB | KV cache GiB | peak w/o KV GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for side, _seconds, _r in rows:
        frac = numbers.get(f"{side}_peak_fraction")
        peak = numbers.get(f"{side}_peak_bytes")
        kv = numbers.get(f"{side}_kv_cache_bytes")
        wo = numbers.get(f"{side}_peak_without_kv_bytes")
        lines.append(
            f"| {side} | {numbers[f'{side}_tokens_per_s']:.0f} | {numbers[f'{side}_median_tokens_per_s']:.0f} | "
            f"{numbers[f'{side}_tflops']:.3g} | "
            f"{f'{frac:.1%}' if frac is not None else '-'} | {f'{peak / gib:.2f}' if peak else '-'} | "
            f"{f'{kv / gib:.2f}' if kv else '-'} | {f'{wo / gib:.2f}' if wo is not None else '-'} |"
        )
    lines.append("")
    for key in (
        "ratio_extract_vs_prefill",
        "ratio_extract_vs_prefill_median",
        "ratio_extract_vs_hf",
        "ratio_extract_vs_hf_median",
        "ratio_peak_memory_extract_vs_prefill",
        "ratio_peak_without_kv_extract_vs_prefill",
        "extract_collect_fraction",
        "ratio_extract_without_collect_vs_prefill",
        "ratio_extract_without_collect_vs_prefill_median",
        "extract_after_collect_fraction",
        "copy_states_seconds",
        "worker_pack_seconds_median",
        "worker_pack_gbytes_per_s",
        "worker_spare_ready_fraction",
        "worker_wait_seconds_median",
    ):
        if key in numbers:
            lines.append(f"{key}: {numbers[key]:.3f}")
    if "hf_forward_only_tokens_per_s" in numbers:
        only = numbers["hf_forward_only_tokens_per_s"]
        lines.append(f"hf forward only (states left on the device): {only:.0f} tokens/s")
    if numbers.get("extract_parent_peak_bytes"):
        lines.append(f"extract parent process peak: {numbers['extract_parent_peak_bytes'] / gib:.2f} GiB")
    return numbers, "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if --small is not given)")
    parser.add_argument("--small", action="store_true", help="the CPU-sized preset (hidden 256, 4 layers, 6k tokens)")
    for key, value in LARGE.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"default {value}")
    parser.add_argument("--extract-layers", default=None, help="comma-separated ids; default: speculators'")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default=None, help="e.g. TRITON_ATTN (a harness setting, both sides)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="default 790 on cuda (H200 bf16 dense)")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--sides", default="extract,prefill,hf")
    parser.add_argument("--profile", action="store_true", help="cProfile one extra extraction call (not timed)")
    parser.add_argument("--side-timeout", type=int, default=480, help="seconds for one side")
    parser.add_argument("--time-budget", type=int, default=None, help="seconds for the whole run (sides get the rest)")
    parser.add_argument(
        "--resummarize", type=Path, default=None, help="print the summary of an earlier results.json again (no run)"
    )
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--side-input", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    preset = SMALL if args.small else LARGE
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.device = args.device or ("cpu" if args.small else "cuda")
    if args.peak_tflops is None and args.device == "cuda":
        args.peak_tflops = 790.0
    if args.model_dir is None:
        from importlib.metadata import PackageNotFoundError, version

        try:  # a tokenizer saved by transformers 5 does not load in transformers 4
            writer = f"tf{version('transformers')}"
        except PackageNotFoundError:
            writer = "tf-none"
        tag = f"h{args.hidden}-l{args.layers}-v{args.vocab}-{args.dtype}-{args.device}-{writer}"
        args.model_dir = str(Path(tempfile.gettempdir()) / f"vllm-compat-bench-model-{tag}")
    args.out = args.out.resolve()
    args.started = time.time()
    args.passthrough = _without_options(argv, ("--side", "--side-input", "--side-timeout", "--time-budget"))
    return args


def _without_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` minus the options ``names`` and their values (``--opt value`` or ``--opt=value``)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not any(arg.startswith(f"{name}=") for name in names):
            kept.append(arg)
    return kept


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.resummarize:
        report = json.loads(args.resummarize.read_text())
        earlier = argparse.Namespace(**{**vars(args), **report["args"]})
        print(summarize(earlier, report["shape"], report["sides"])[1])
        return 0
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.side:  # one side, in its own process
        extra = json.loads(args.side_input)
        if args.side == "build":
            result = side_build(args, out)
        elif args.side == "extract":
            result = side_extract(args, out)
        elif args.side == "prefill":
            result = side_prefill(args, out, extra)
        else:
            result = side_hf(args, out, extra["layers"], extra["max_num_batched_tokens"])
        (out / f".{args.side}.json").write_text(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)  # vLLM's atexit handlers can hang a finished process; the result is written

    log(out, "main", f"args: {vars(args)}")
    shape = run_side(args, out, "build")
    if shape is None:
        log(out, "main", "could not build the model")
        return 1
    wanted = args.sides.split(",")
    results: dict = {}
    if "extract" in wanted:
        results["extract"] = run_side(args, out, "extract")
    engine = dict((results.get("extract") or {}).get("engine") or {})
    if not engine:  # no extraction side: speculators' settings, written out
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
    if results.get("extract"):
        engine["kv_cache_bytes"] = results["extract"]["memory"].get("kv_cache_bytes")
    if "prefill" in wanted:
        results["prefill"] = run_side(args, out, "prefill", engine)
    if "hf" in wanted:
        layers = (results.get("extract") or {}).get("layers")
        if not layers:  # speculators' default choice, as the generator would make it
            n = shape["layers"]
            chosen = args.extract_layers
            layers = [int(x) for x in chosen.split(",")] if chosen else [2, n // 2, n - 3, n - 1]
        results["hf"] = run_side(
            args, out, "hf", {"layers": layers, "max_num_batched_tokens": engine["max_num_batched_tokens"]}
        )
    numbers, table = summarize(args, shape, results)
    report = {
        "args": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(out)},
        "shape": shape,
        "sides": results,
        "numbers": numbers,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "summary.md").write_text(table + "\n")
    print(table, flush=True)
    missing = [s for s in wanted if not results.get(s)]
    if missing:
        log(out, "main", f"sides without a result: {missing}")
    return 0 if not missing else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
