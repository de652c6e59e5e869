"""Hidden-state extraction throughput under vllm-compat beside plain vLLM prefill, vLLM's own extraction, transformers.

The sides run on the same random Llama, the same prompts and the same batching, each in its own process (vLLM
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
- ``native`` and ``native_disk``: vLLM's own extraction (vLLM >= 0.17, the path speculators >= 0.5 drives through
  ``vllm serve``): the speculative method ``extract_hidden_states`` with the ``ExampleHiddenStatesConnector`` KV
  connector, ``LLM.generate`` with ``max_tokens=1`` on prefill's engine settings, the same layers' states (aux
  layer ``l + 1`` is the output of layer ``l``). The connector writes one safetensors file per sequence, after
  ``generate()`` returns, from a thread pool in the worker: ``native`` into a folder in /dev/shm, ``native_disk``
  into ``--native-disk-dir`` (default: DIR/native-states). A call is timed until every file is written (its lock
  released); reading the files back is timed apart, and files are removed after each call. The KV-cache budget is
  the same bytes, of which this path also keeps the states of the running sequences. Harness settings, applied
  only where needed and recorded with the side: chunked prefill off on vLLM 0.22 (its extraction path needs it;
  speculators' launcher turns it off everywhere); on a CPU build, ``--cpu-unpinned-staging`` lets the connector
  stage states in ordinary memory and poll vLLM's CPU event stand-in (bench/cpu_unpinned_staging.py: vLLM's CPU
  build cannot run this connector as shipped), without which the side fails with the reason in the summary.
- ``hf``: transformers' forward with ``output_hidden_states=True`` and ``logits_to_keep=1``, batched to the same
  token budget per forward as vLLM's step (``max_num_batched_tokens``), copying the same layers' states to the CPU.

States check (once, after the first run): the first two sequences of the last call of ``extract`` and ``native``
are compared with transformers' forward in the model's dtype (forward hooks on the decoder layers, in a process of
their own); bound per tensor ``max|diff| <= 3e-2 * max|ref| + 1e-3`` (the GPU end-to-end tests' bound for bf16).

Reported: tokens/s per side and the ratios extract/prefill (target >= 0.95), extract/native, native/prefill and
extract/hf; achieved TFLOP/s and the fraction of ``--peak-tflops`` (790 on an H200, bf16 dense) counting
2 * params * tokens for the layers, one LM head row per sequence and causal attention (4 * layers * heads *
head_dim * L(L+1)/2 per sequence); peak memory of the process running the model (``torch.cuda.max_memory_allocated``;
peak RSS on the CPU), with the KV cache apart, and the extraction parent's own peak (the returned states pass
through it). ``--repeat N`` runs every side N times (the model is built once) and reports min/median/max of each
ratio across the runs.

Presets (``--preset``; any size flag overrides one value): ``default``, a 1B-class Llama (hidden 2048, 16 layers,
8 calls of 32 x 1024 tokens); ``large``, an 8B-class one (hidden 4096, 32 layers, intermediate 14336, vocab 128256,
8 calls of 16 x 2048 tokens); ``small`` (``--small``), for a CPU (hidden 256, 4 layers, 3 calls of 8 x 256).

    python bench/extraction_throughput.py --out DIR --attention-backend TRITON_ATTN      # H200: 1B-class model
    python bench/extraction_throughput.py --out DIR --preset large --attention-backend TRITON_ATTN \
        --sides extract,prefill,native,native_disk --repeat 3                             # H200: 8B-class model
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
DEFAULT = {  # 1B-class
    "hidden": 2048,
    "layers": 16,
    "heads": 16,
    "kv_heads": 8,
    "intermediate": 0,  # 0: the builder's 11/4 x hidden
    "vocab": 32000,
    "seq_len": 1024,
    "seqs_per_call": 32,
    "calls": 8,
    "warmup_calls": 1,
    "max_model_len": 2048,
}
LARGE = {  # 8B-class: Llama 3 8B's shape
    "hidden": 4096,
    "layers": 32,
    "heads": 32,
    "kv_heads": 8,
    "intermediate": 14336,
    "vocab": 128256,
    "seq_len": 2048,
    "seqs_per_call": 16,
    "calls": 8,
    "warmup_calls": 1,
    "max_model_len": 4096,  # a prompt of seq_len plus the one sampled token must fit
}
SMALL = {
    "hidden": 256,
    "layers": 4,
    "heads": 4,
    "kv_heads": 2,
    "intermediate": 0,
    "vocab": 1024,
    "seq_len": 256,
    "seqs_per_call": 8,
    "calls": 3,
    "warmup_calls": 1,
    "max_model_len": 2048,
}
PRESETS = {"small": SMALL, "default": DEFAULT, "large": LARGE}
SIDES = ("extract", "prefill", "native", "native_disk", "hf")
NATIVE = ("native", "native_disk")
RATIOS = (  # (numerator, denominator): tokens/s of one side over another's
    ("extract", "prefill"),
    ("extract", "native"),
    ("native", "prefill"),
    ("extract", "native_disk"),
    ("native_disk", "prefill"),
    ("extract", "hf"),
)
REL_TOL, ABS_TOL = 3e-2, 1e-3  # states check: max|diff| <= REL_TOL * max|ref| + ABS_TOL per tensor (bf16)
NATIVE_NO_CHUNKED_PREFILL = {(0, 22)}  # vLLM releases whose extract_hidden_states path needs chunked prefill off
CHECK_SEQS = 2  # sequences of the last call whose states are checked against transformers


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


def save_sample(out: Path, side: str, call: list[list[int]], layers: list[int], states: list[list]) -> None:
    """Keep the states of the first ``CHECK_SEQS`` sequences of a call for the check against transformers.

    ``layers[i]`` names the decoder layer whose output ``states[seq][i]`` is."""
    import torch

    folder = out / ".samples"
    folder.mkdir(exist_ok=True)
    sample = {
        "ids": [list(ids) for ids in call[:CHECK_SEQS]],
        "layers": list(layers),
        "states": [[h.detach().clone() for h in seq] for seq in states[:CHECK_SEQS]],
    }
    torch.save(sample, folder / f"{side}.pt")


def vllm_release() -> tuple[int, int]:
    """(major, minor) of the installed vLLM, without importing it (a side decides settings before it starts)."""
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("vllm")).release[:2]


# ------------------------------------------------------------------------------------------ sides
def side_build(args: argparse.Namespace, out: Path) -> dict:
    build_random_llama = _load(ROOT / "tests" / "gpu" / "random_llama.py").build_random_llama

    wanted = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "vocab")}
    intermediate = args.intermediate or None  # None: the builder's default, 11/4 x hidden
    shape_file = Path(args.model_dir) / "shape.json"
    if shape_file.exists():
        shape = json.loads(shape_file.read_text())
        same = all(shape.get(k) == v for k, v in wanted.items()) and shape.get("dtype") == args.dtype
        if same and shape.get("intermediate") == (intermediate or 11 * args.hidden // 4):
            log(out, "build", f"reusing {args.model_dir}")
            return shape
    t0 = time.perf_counter()
    shape = build_random_llama(
        args.model_dir, **wanted, intermediate=intermediate, dtype=args.dtype, device=args.device, std=0.02
    )
    log(out, "build", f"built {shape['params'] / 1e6:.0f}M params on {args.device} in {time.perf_counter() - t0:.1f}s")
    return shape


def side_extract(args: argparse.Namespace, out: Path, sample: bool = False) -> dict:
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
    if sample:
        # the worker captures each chosen layer once, in the model's order
        layers = sorted(set(generator.layer_ids))
        save_sample(out, "extract", calls[-1], layers, [r["hidden_states"] for r in results])
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


def side_prefill(args: argparse.Namespace, out: Path, engine: dict) -> dict:
    t0 = time.perf_counter()
    import torch
    from vllm import LLM, SamplingParams

    kwargs = engine_kwargs(args, engine)
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
    shutdown(llm)
    return {
        "init_seconds": init,
        "call_seconds": times,
        "memory": memory,
        "settings": kwargs,
        "torch": torch.__version__,
    }


class SideFailure(Exception):
    """A side that cannot run here: its one-line reason goes into the summary instead of a number."""


def native_storage(args: argparse.Namespace, out: Path, side: str) -> Path:
    """Where the connector writes: a folder in /dev/shm named after DIR (so the parent can clean it), or disk."""
    if side == "native":
        import hashlib

        return Path("/dev/shm") / f"vllm-compat-bench-native-{hashlib.sha1(str(out).encode()).hexdigest()[:10]}"
    return Path(args.native_disk_dir) if args.native_disk_dir else out / "native-states"


def _engine_dead(llm) -> bool:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    return bool(getattr(getattr(core, "resources", None), "engine_dead", False))


def _written(path: str) -> bool:
    """Whether the connector has finished ``path``: its ``.lock`` (made when the request is scheduled, held by the
    writer until the file is written) can be locked shared. Connectors without locks (before vLLM's writes went to a
    thread pool) wrote the file before the request finished: there the file itself says so. Raises where the lock
    was let go but no file is there (the write failed)."""
    import fcntl

    lock = path + ".lock"
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return os.path.exists(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: its writer let go of the lock without writing the file")
    return True


def wait_written(llm, paths: list[str], timeout: float) -> None:
    """Block until every file in ``paths`` is written (polling the writer's locks), or fail on a dead engine."""
    pending = list(paths)
    deadline = time.monotonic() + timeout
    while pending:
        pending = [path for path in pending if not _written(path)]
        if not pending:
            return
        if _engine_dead(llm):
            raise RuntimeError(f"vLLM's engine died with {len(pending)} of {len(paths)} states files unwritten")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} of {len(paths)} states files not written after {timeout:.0f}s")
        time.sleep(0.0005)


def engine_error(log_file: Path, offset: int) -> str | None:
    """The error vLLM's engine or worker logged since ``offset`` of sides.log (a side's output goes there)."""
    import re

    try:
        with open(log_file, errors="replace") as f:
            f.seek(offset)
            text = f.read()
    except OSError:
        return None
    found = re.findall(r"Worker failed with error '(.+?)', please check", text)
    if found:
        return found[-1]
    found = re.findall(r"\b(\w+(?:Error|Exception): .+)$", text, re.MULTILINE)
    return found[-1].strip() if found else None


def side_native(
    args: argparse.Namespace, out: Path, side: str, engine: dict, layers: list[int], sample: bool = False
) -> dict:
    """vLLM's own extraction: ``extract_hidden_states`` + ``ExampleHiddenStatesConnector``, timed until written."""
    log_file = out / "sides.log"
    offset = log_file.stat().st_size if log_file.exists() else 0
    release = vllm_release()
    if release < (0, 17):
        raise SideFailure(f"vLLM {release[0]}.{release[1]} has no extract_hidden_states method (vLLM >= 0.17 has)")
    import shutil

    storage = native_storage(args, out, side)
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(parents=True)
    try:
        return _native_calls(args, out, side, engine, layers, storage, release, sample)
    except SideFailure:
        raise
    except Exception as exc:
        here = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        cause = engine_error(log_file, offset)
        reason = f"vLLM's worker failed: {cause} (here: {here})" if cause else here
        if cause and "pin_memory" in cause and args.device == "cpu":
            reason = (
                "vLLM's ExampleHiddenStatesConnector stages states in pinned host memory, which a CPU build of "
                f"torch cannot allocate (worker: {cause}); --cpu-unpinned-staging works around it on a CPU (a harness "
                f"setting, bench/cpu_unpinned_staging.py); here: {here}"
            )
        raise SideFailure(reason) from exc
    finally:
        shutil.rmtree(storage, ignore_errors=True)


def _native_calls(
    args: argparse.Namespace,
    out: Path,
    side: str,
    engine: dict,
    layers: list[int],
    storage: Path,
    release: tuple[int, int],
    sample: bool,
) -> dict:
    t0 = time.perf_counter()
    import torch
    from vllm import LLM

    aux = sorted({layer + 1 for layer in layers})  # aux layer l + 1: the residual stream after layer l
    kwargs = engine_kwargs(args, engine)
    kwargs["speculative_config"] = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux}},
    }
    kwargs["kv_transfer_config"] = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    harness = {}
    if release in NATIVE_NO_CHUNKED_PREFILL:
        kwargs["enable_chunked_prefill"] = harness["enable_chunked_prefill"] = False
    if args.cpu_unpinned_staging and args.device == "cpu":
        kwargs["worker_extension_cls"] = harness["worker_extension_cls"] = "cpu_unpinned_staging.UnpinnedStagingOnCpu"
    outputs_of = [a - 1 for a in aux]
    log(out, side, f"aux layers {aux} (outputs of layers {outputs_of}), files in {storage}; harness {harness}")
    llm = LLM(**kwargs)
    try:
        return _timed_native_calls(args, out, side, llm, aux, storage, sample, t0) | {
            "settings": {k: v for k, v in kwargs.items() if k != "model"},
            "harness": harness,
            "vllm": ".".join(map(str, release)),
            "torch": torch.__version__,
        }
    finally:
        shutdown(llm)


def _timed_native_calls(
    args: argparse.Namespace, out: Path, side: str, llm, aux: list[int], storage: Path, sample: bool, t0: float
) -> dict:
    from safetensors.torch import load_file
    from vllm import SamplingParams

    init = time.perf_counter() - t0
    log(out, side, f"LLM ready in {init:.1f}s")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    hidden = llm.llm_engine.model_config.get_hidden_size()
    calls = prompt_calls(args)
    times, generate_times, read_times, file_bytes = [], [], [], []
    for i, call in enumerate(calls):
        if i == args.warmup_calls:
            llm.collective_rpc(_reset_peak)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in call], params, use_tqdm=False)
        returned = time.perf_counter()
        assert len(outputs) == len(call)
        paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outputs]
        if not all(paths):
            raise RuntimeError("a request finished without a hidden_states_path in its kv_transfer_params")
        wait_written(llm, paths, args.native_wait_timeout)
        end = time.perf_counter()
        states = []
        for ids, path in zip(call, paths, strict=True):  # read back, checked, removed: not timed with the call
            data = load_file(path)
            got = data["hidden_states"]
            if data["token_ids"].tolist() != ids:
                raise RuntimeError(f"{path} holds other token ids than its prompt")
            if tuple(got.shape) != (len(ids), len(aux), hidden):
                raise RuntimeError(f"{path}: states of shape {tuple(got.shape)}, not {(len(ids), len(aux), hidden)}")
            if sample and i == len(calls) - 1 and len(states) < CHECK_SEQS:
                states.append([got[:, k] for k in range(len(aux))])
            if i == args.warmup_calls:
                file_bytes.append(os.path.getsize(path))
            for name in (path, path + ".lock"):
                if os.path.exists(name):
                    os.remove(name)
        read = time.perf_counter() - end
        if i >= args.warmup_calls:
            times.append(end - start)
            generate_times.append(returned - start)
            read_times.append(read)
        log(
            out,
            side,
            f"call {i}: {sum(map(len, call))} tokens in {end - start:.3f}s (generate() returned after "
            f"{returned - start:.3f}s, files written {end - returned:.3f}s later); reading them back {read:.3f}s",
        )
    if sample:
        save_sample(out, side, calls[-1], [a - 1 for a in aux], states)
    memory = llm.collective_rpc(_memory_report)[0]
    return {
        "init_seconds": init,
        "call_seconds": times,
        "generate_seconds": generate_times,
        "read_seconds": read_times,
        "call_file_bytes": sum(file_bytes),
        "storage": str(storage),
        "aux_layers": aux,
        "memory": memory,
    }


def side_check(args: argparse.Namespace, out: Path) -> dict:
    """Every saved sample against transformers' forward in the model's dtype (hooks on the decoder layers)."""
    import torch
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM

    samples = {p.stem: torch.load(p, weights_only=False) for p in sorted((out / ".samples").glob("*.pt"))}
    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, **{key: getattr(torch, args.dtype)})
    model = model.to(args.device).eval()
    wanted = sorted({layer for sample in samples.values() for layer in sample["layers"]})
    captured: dict[int, torch.Tensor] = {}
    for layer in wanted:
        model.model.layers[layer].register_forward_hook(
            lambda _m, _i, output, layer=layer: captured.__setitem__(
                layer, (output[0] if isinstance(output, tuple) else output)[0].float().cpu()
            )
        )
    references: dict[tuple[int, ...], dict[int, torch.Tensor]] = {}
    with torch.no_grad():
        for sample in samples.values():
            for ids in sample["ids"]:
                if tuple(ids) not in references:
                    model(torch.tensor([ids], device=args.device), logits_to_keep=1)
                    references[tuple(ids)] = dict(captured)
    report: dict = {"bound": f"max|diff| <= {REL_TOL} * max|ref| + {ABS_TOL} per tensor", "sides": {}}
    for side, sample in samples.items():
        worst_ratio = worst_diff = 0.0
        for ids, states in zip(sample["ids"], sample["states"], strict=True):
            for layer, got in zip(sample["layers"], states, strict=True):
                want = references[tuple(ids)][layer]
                diff = (got.float() - want).abs().max().item()
                worst_diff = max(worst_diff, diff)
                worst_ratio = max(worst_ratio, diff / (REL_TOL * want.abs().max().item() + ABS_TOL))
        report["sides"][side] = {
            "max_abs_diff": worst_diff,
            "worst_of_bound": worst_ratio,
            "passed": worst_ratio <= 1.0,
            "sequences": len(sample["ids"]),
            "layers": sample["layers"],
        }
        log(out, "check", f"{side}: worst {worst_ratio:.3f} of the bound (max|diff| {worst_diff:.4g})")
    if "extract" in samples and any(n in samples for n in NATIVE):  # vLLM against vLLM: the same kernels
        e = samples["extract"]
        for side in (n for n in NATIVE if n in samples):
            n = samples[side]
            worst = 0.0
            for e_states, n_states in zip(e["states"], n["states"], strict=True):
                by_layer = dict(zip(n["layers"], n_states, strict=True))
                for layer, got in zip(e["layers"], e_states, strict=True):
                    worst = max(worst, (got.float() - by_layer[layer].float()).abs().max().item())
            report[f"{side}_vs_extract_max_abs_diff"] = worst
    report["transformers"] = transformers.__version__
    return report


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
def run_side(args: argparse.Namespace, out: Path, side: str, extra: dict | None = None) -> dict:
    """Run one side in a fresh interpreter; its result, or ``{"error": one line}`` where it has none."""
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
    if side == "prefill" or side in NATIVE:  # the same model runner as the generator's (vllm-compat may pin V1)
        runner = ((extra or {}).get("engine") or extra or {}).get("VLLM_USE_V2_MODEL_RUNNER")
        if runner is not None:
            env["VLLM_USE_V2_MODEL_RUNNER"] = runner
        env["VLLM_COMPAT_DISABLE"] = "1"  # plain vLLM: nothing of vllm-compat in that process
    if side in NATIVE and args.cpu_unpinned_staging and args.device == "cpu":  # its worker imports the shim
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "bench"), env.get("PYTHONPATH")]))
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
    if side == "native":  # what a killed side left in /dev/shm
        import shutil

        shutil.rmtree(native_storage(args, out, side), ignore_errors=True)
    if result_file.exists():
        result = json.loads(result_file.read_text())
        result_file.unlink()
        if result.get("error"):
            log(out, "main", f"side {side} failed: {result['error']}")
        return result
    return {"error": f"exited {code} without a result (sides.log has its output)"}


def ok(result: dict | None) -> bool:
    return bool(result) and not result.get("error")


def summarize(args: argparse.Namespace, shape: dict, results: dict) -> tuple[dict, list[str]]:
    """One run's numbers and its table (without the header lines)."""
    calls = prompt_calls(args)[args.warmup_calls :]
    tokens = sum(len(s) for c in calls for s in c)
    total_flops = flops(shape, calls)
    rows, numbers = [], {"tokens_timed": tokens, "flops_timed": total_flops}
    for side in SIDES:
        r = results.get(side)
        if not ok(r):
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
        rows.append(side)
    if ok(results.get("extract")):
        e = results["extract"]
        numbers["extract_collect_fraction"] = sum(e["collect_seconds"]) / sum(e["call_seconds"])
        # everything but the one RPC that returns the states: the engine steps and the parent's own work
        loop = [c - g for c, g in zip(e["call_seconds"], e["collect_seconds"], strict=True)]
        numbers["extract_without_collect_tokens_per_s"] = tokens / sum(loop)
        numbers["extract_without_collect_median_tokens_per_s"] = tokens / len(calls) / statistics.median(loop)
        if ok(results.get("hf")):
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
    for side in NATIVE:
        r = results.get(side)
        if ok(r):
            numbers[f"{side}_generate_fraction"] = sum(r["generate_seconds"]) / sum(r["call_seconds"])
            numbers[f"{side}_read_seconds_median"] = statistics.median(r["read_seconds"])
            numbers[f"{side}_with_read_tokens_per_s"] = tokens / (sum(r["call_seconds"]) + sum(r["read_seconds"]))
    for a, b in RATIOS:
        if f"{a}_tokens_per_s" in numbers and f"{b}_tokens_per_s" in numbers:
            numbers[f"ratio_{a}_vs_{b}"] = numbers[f"{a}_tokens_per_s"] / numbers[f"{b}_tokens_per_s"]
            numbers[f"ratio_{a}_vs_{b}_median"] = (
                numbers[f"{a}_median_tokens_per_s"] / numbers[f"{b}_median_tokens_per_s"]
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
        "| side | tokens/s | median call tok/s | TFLOP/s | of peak | peak mem GiB | KV cache GiB | peak w/o KV GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for side in rows:
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
    for side in SIDES:
        r = results.get(side)
        if r is not None and not ok(r):
            lines.append(f"| {side} | failed: {r['error']} | | | | | | |")
    lines.append("")
    for a, b in RATIOS:
        for key in (f"ratio_{a}_vs_{b}", f"ratio_{a}_vs_{b}_median"):
            if key in numbers:
                lines.append(f"{key}: {numbers[key]:.3f}")
    for key in (
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
    for side in NATIVE:
        r = results.get(side)
        if ok(r):
            gen = statistics.median(r["generate_seconds"])
            call = statistics.median(r["call_seconds"])
            lines.append(
                f"{side} ({r['storage']}): generate() returned after {gen:.3f}s of a median {call:.3f}s call, "
                f"the files ({r['call_file_bytes'] / 2**20:.0f} MiB a call) written {call - gen:.3f}s later; reading "
                f"them back {numbers[f'{side}_read_seconds_median']:.3f}s a call (with it "
                f"{numbers[f'{side}_with_read_tokens_per_s']:.0f} tokens/s); vLLM {r['vllm']}, harness settings "
                f"{r['harness'] or 'none'}"
            )
    if "hf_forward_only_tokens_per_s" in numbers:
        only = numbers["hf_forward_only_tokens_per_s"]
        lines.append(f"hf forward only (states left on the device): {only:.0f} tokens/s")
    if numbers.get("extract_parent_peak_bytes"):
        lines.append(f"extract parent process peak: {numbers['extract_parent_peak_bytes'] / gib:.2f} GiB")
    return numbers, lines


def across_runs(numbers: list[dict]) -> dict:
    """min / median / max of every ratio over the runs that have it."""
    keys = sorted({k for n in numbers for k in n if k.startswith("ratio_")})
    spread = {}
    for key in keys:
        values = [n[key] for n in numbers if key in n]
        spread[key] = {"min": min(values), "median": statistics.median(values), "max": max(values), "values": values}
    return spread


def check_lines(check: dict | None) -> list[str]:
    if not check:
        return []
    if check.get("error"):
        return [f"states vs transformers: check failed: {check['error']}"]
    parts = [
        f"{side} worst {c['worst_of_bound']:.3f} of the bound (max|diff| {c['max_abs_diff']:.3g}, "
        f"{'ok' if c['passed'] else 'MISMATCH'})"
        for side, c in check["sides"].items()
    ]
    parts += [
        f"{k.removesuffix('_max_abs_diff').replace('_vs_', ' vs ')} max|diff| {v:.3g}"
        for k, v in check.items()
        if k.endswith("_vs_extract_max_abs_diff")
    ]
    first = next(iter(check["sides"].values()))
    return [
        f"states vs transformers {check['transformers']} (the model's dtype, {first['sequences']} sequences of the "
        f"last call, bound {check['bound']}): " + "; ".join(parts)
    ]


def render(args: argparse.Namespace, shape: dict, runs: list[dict], check: dict | None) -> tuple[list, dict, str]:
    """Every run's numbers, the spread of the ratios across runs, and the whole summary text."""
    calls = prompt_calls(args)[args.warmup_calls :]
    tokens = sum(len(s) for c in calls for s in c)
    lines = [
        f"model: random Llama, hidden {shape['hidden']}, {shape['layers']} layers, {shape['heads']} heads "
        f"({shape['kv_heads']} KV), intermediate {shape.get('intermediate')}, vocab {shape['vocab']}, "
        f"{shape['params'] / 1e6:.0f}M params, {shape['dtype']}, device {args.device}",
        f"prompts: {args.calls} timed calls (+{args.warmup_calls} warm-up) of {args.seqs_per_call} x {args.seq_len} "
        f"tokens = {tokens} tokens timed; {flops(shape, calls) / 1e12:.1f} TFLOP",
    ]
    numbers = []
    for i, run in enumerate(runs):
        n, table = summarize(args, shape, run["sides"])
        numbers.append(n)
        lines += ["", f"### run {i + 1} of {len(runs)}", ""] if len(runs) > 1 else [""]
        lines += table
    lines += ["", *check_lines(check)]
    spread = across_runs(numbers)
    if len(runs) > 1:
        lines += ["", f"### ratios across {len(runs)} runs", "", "| ratio | min | median | max |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['min']:.3f} | {v['median']:.3f} | {v['max']:.3f} |" for k, v in spread.items()]
    return numbers, spread, "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cpu for the small preset, else cuda)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, help="sizes (default: default)")
    parser.add_argument("--small", action="store_true", help="--preset small (hidden 256, 4 layers, 6k tokens)")
    for key, value in DEFAULT.items():
        sizes = f"default {value}, large {LARGE[key]}, small {SMALL[key]}" + ("; 0: 11/4 x hidden" if not value else "")
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=sizes)
    parser.add_argument("--extract-layers", default=None, help="comma-separated ids; default: speculators'")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default=None, help="e.g. TRITON_ATTN (a harness setting, all sides)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="default 790 on cuda (H200 bf16 dense)")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--sides", default="extract,prefill,hf", help=f"comma-separated, of {','.join(SIDES)}")
    parser.add_argument("--repeat", type=int, default=1, help="run every side this many times; ratios' spread")
    parser.add_argument("--native-disk-dir", default=None, help="native_disk's folder (default: DIR/native-states)")
    parser.add_argument("--native-wait-timeout", type=float, default=300.0, help="seconds for one call's files")
    parser.add_argument(
        "--cpu-unpinned-staging",
        action="store_true",
        help="CPU only, a harness setting: vLLM's connector stages states in ordinary memory (it asks for pinned)",
    )
    parser.add_argument("--no-check", action="store_true", help="skip the check of states against transformers")
    parser.add_argument("--profile", action="store_true", help="cProfile one extra extraction call (not timed)")
    parser.add_argument("--side-timeout", type=int, default=480, help="seconds for one side")
    parser.add_argument("--time-budget", type=int, default=None, help="seconds for the whole run (sides get the rest)")
    parser.add_argument(
        "--resummarize", type=Path, default=None, help="print the summary of an earlier results.json again (no run)"
    )
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--side-input", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.small and args.preset not in (None, "small"):
        parser.error(f"--small is --preset small, not --preset {args.preset}")
    args.preset = "small" if args.small else args.preset or "default"
    args.small = args.preset == "small"
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    unknown = set(args.sides.split(",")) - set(SIDES)
    if unknown:
        parser.error(f"unknown sides {sorted(unknown)}; choose from {','.join(SIDES)}")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
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
        if args.intermediate:
            tag += f"-i{args.intermediate}"
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


def run_one_side(args: argparse.Namespace, out: Path) -> dict:
    """The body of a side's own process: its result, or ``{"error": one line}``."""
    extra = json.loads(args.side_input)
    try:
        if args.side == "build":
            return side_build(args, out)
        if args.side == "extract":
            return side_extract(args, out, extra.get("sample", False))
        if args.side == "prefill":
            return side_prefill(args, out, extra)
        if args.side in NATIVE:
            return side_native(args, out, args.side, extra["engine"], extra["layers"], extra.get("sample", False))
        if args.side == "check":
            return side_check(args, out)
        return side_hf(args, out, extra["layers"], extra["max_num_batched_tokens"])
    except Exception as exc:
        import traceback

        traceback.print_exc()
        reason = str(exc) if isinstance(exc, SideFailure) else f"{type(exc).__name__}: {exc}"
        return {"error": " ".join(reason.split())[:600]}


def default_layers(args: argparse.Namespace, shape: dict) -> list[int]:
    """speculators' default choice, as the generator would make it (or ``--extract-layers``)."""
    if args.extract_layers:
        return [int(x) for x in args.extract_layers.split(",")]
    n = shape["layers"]
    return [2, n // 2, n - 3, n - 1]


def run_all_sides(args: argparse.Namespace, out: Path, shape: dict, wanted: list[str], first: bool) -> dict:
    """One side-by-side comparison; the first one also keeps samples of the states for the check."""
    sample = first and not args.no_check
    results: dict = {}
    if "extract" in wanted:
        results["extract"] = run_side(args, out, "extract", {"sample": sample})
    extract = results.get("extract") if ok(results.get("extract")) else {}
    engine = dict(extract.get("engine") or {})
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
    if extract:
        engine["kv_cache_bytes"] = extract["memory"].get("kv_cache_bytes")
    layers = extract.get("layers") or default_layers(args, shape)
    if "prefill" in wanted:
        results["prefill"] = run_side(args, out, "prefill", engine)
    for side in NATIVE:
        if side in wanted:
            results[side] = run_side(args, out, side, {"engine": engine, "layers": layers, "sample": sample})
    if "hf" in wanted:
        results["hf"] = run_side(
            args, out, "hf", {"layers": layers, "max_num_batched_tokens": engine["max_num_batched_tokens"]}
        )
    return results


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.resummarize:
        report = json.loads(args.resummarize.read_text())
        earlier = argparse.Namespace(**{**vars(args), **report["args"]})
        runs = report.get("runs") or [{"sides": report["sides"]}]
        print(render(earlier, report["shape"], runs, report.get("check"))[2])
        return 0
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.side:  # one side, in its own process
        result = run_one_side(args, out)
        (out / f".{args.side}.json").write_text(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)  # vLLM's atexit handlers can hang a finished process; the result is written

    log(out, "main", f"args: {vars(args)}")
    shape = run_side(args, out, "build")
    if not ok(shape):
        log(out, "main", f"could not build the model: {shape.get('error')}")
        return 1
    wanted = args.sides.split(",")
    import shutil

    shutil.rmtree(out / ".samples", ignore_errors=True)
    runs, check = [], None
    for i in range(args.repeat):
        if args.repeat > 1:
            log(out, "main", f"run {i + 1} of {args.repeat}")
        runs.append({"sides": run_all_sides(args, out, shape, wanted, first=i == 0)})
        if i == 0 and any((out / ".samples").glob("*.pt")):
            check = run_side(args, out, "check")
            shutil.rmtree(out / ".samples", ignore_errors=True)
    numbers, spread, table = render(args, shape, runs, check)
    for run, n in zip(runs, numbers, strict=True):
        run["numbers"] = n
    report = {
        "args": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(out)},
        "shape": shape,
        "sides": runs[0]["sides"],  # the first run, as before --repeat
        "numbers": numbers[0],
        "runs": runs,
        "across_runs": spread,
        "check": check,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "summary.md").write_text(table + "\n")
    print(table, flush=True)
    failed = sorted({s for run in runs for s in wanted if not ok(run["sides"].get(s))})
    mismatch = [s for s, c in ((check or {}).get("sides") or {}).items() if not c["passed"]]
    if failed:
        log(out, "main", f"sides without a result: {failed}")
    if mismatch or (check or {}).get("error"):
        log(out, "main", f"states check: mismatch in {mismatch} {(check or {}).get('error') or ''}")
    return 0 if not failed and not mismatch and not (check or {}).get("error") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
