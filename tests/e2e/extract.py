"""An unchanged speculators extraction script, as a user runs it: ``import vllm_compat`` first, nothing else.

Run by the end-to-end tests in a fresh interpreter (so vLLM's spawned workers see exactly what a user's
would). It builds speculators' own ``VllmHiddenStatesGenerator`` on a local model, runs a list of calls and
saves what ``generate()`` returned, with timings and what vllm-compat applied, to ``--out`` (torch.save).

``--log-level INFO`` configures logging as speculators' scripts do (``logging.basicConfig``); vllm-compat's messages of
this process are saved with the results either way.

The only test-harness choice: ``--dtype float32`` keeps vLLM's CPU backend from running a float32 checkpoint in
bfloat16 (its choice for ``dtype="auto"``), so states can be compared with transformers at 1e-4. It rebinds
``ModelConfig`` in speculators' module for this process only, and is off unless asked.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

# set by vllm-compat for the processes the generator's constructor starts (its workers), and for no other child
SCOPED_VARIABLES = ("VLLM_COMPAT_ACTIVE", "VLLM_USE_V2_MODEL_RUNNER")


def scoped_variables() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in SCOPED_VARIABLES}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--calls", required=True, help="JSON list of calls, each a list of token-id lists")
    parser.add_argument("--layers", required=True, help="comma-separated layer ids, or 'default' (speculators' choice)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--no-compat", action="store_true", help="do not import vllm_compat")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument("--log-level", default=None, help="logging.basicConfig level, as speculators' scripts set")
    args = parser.parse_args()
    if args.log_level:
        logging.basicConfig(level=args.log_level, format="%(asctime)s - %(name)s - %(levelname)s - %(message)s")
    compat_log = _keep_compat_log()

    env_at_start = scoped_variables()
    t0 = time.perf_counter()
    if not args.no_compat:
        import vllm_compat

    from speculators.data_generation import vllm_hidden_states_generator as gen_module

    if args.dtype:
        _force_dtype(gen_module, args.dtype)
    env_after_import = scoped_variables()

    layer_ids = None if args.layers == "default" else [int(x) for x in args.layers.split(",")]
    with open(args.calls) as f:
        calls = json.load(f)
    t_import = time.perf_counter()
    generator = gen_module.VllmHiddenStatesGenerator(
        model_path=args.model, layer_ids=layer_ids, max_model_len=args.max_model_len, tensor_parallel_size=args.tp
    )
    t_init = time.perf_counter()
    outputs, call_seconds = [], []
    for token_ids in calls:
        start = time.perf_counter()
        outputs.append(generator.generate(token_ids))
        call_seconds.append(time.perf_counter() - start)
    vllm_dtype = str(generator.vllm_config.model_config.dtype)
    status, workers = {}, []
    if not args.no_compat:
        import vllm_compat

        status = vllm_compat.status()
        workers = generator.executor.collective_rpc(_worker_report)
    generator.executor.shutdown()
    env_after_shutdown = scoped_variables()

    import torch

    torch.save(
        {
            "outputs": outputs,
            "import_seconds": t_import - t0,
            "init_seconds": t_init - t_import,
            "call_seconds": call_seconds,
            "vllm_dtype": vllm_dtype,
            "layer_ids": list(generator.layer_ids),  # what speculators' script writes to data_config.json
            "prefix_caching": bool(generator.vllm_config.cache_config.enable_prefix_caching),
            "max_num_batched_tokens": generator.vllm_config.scheduler_config.max_num_batched_tokens,
            "block_hasher": getattr(generator, "block_hasher", None) is not None,
            "steps_in_flight": _steps_in_flight(generator.executor),
            "request_counter": getattr(generator, "_request_counter", None),  # the next call's: req_{counter}_{i}
            "status": status,
            "workers": workers,
            "worker_extension_cls": generator.vllm_config.parallel_config.worker_extension_cls,
            "compat_log": compat_log,
            "env": {"start": env_at_start, "after_import": env_after_import, "after_shutdown": env_after_shutdown},
        },
        args.out,
    )
    return 0


def _steps_in_flight(executor) -> dict | None:
    """steps-in-flight's record on the generator's executor: how many steps it allows, and the most it saw."""
    steps = getattr(executor, "_vllm_compat_steps", None)
    return None if steps is None else {"depth": steps.depth, "peak": steps.peak}


def _keep_compat_log() -> list[str]:
    """vllm-compat's log records of this process, INFO and up: ``LEVEL message``."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.levelname} {record.getMessage()}")

    compat = logging.getLogger("vllm_compat")
    compat.addHandler(Keep(level=logging.INFO))
    if compat.getEffectiveLevel() > logging.INFO:
        compat.setLevel(logging.INFO)
    return records


def _worker_report(worker) -> dict:
    """Runs inside each vLLM worker (collective_rpc with a callable): what vllm-compat did there."""
    import vllm_compat

    inner = getattr(worker, "worker", None)  # some releases hand the callable the wrapper around the worker
    classes = [*type(worker).__mro__, *(type(inner).__mro__ if inner is not None else ())]
    extensions = sorted({f"{c.__module__}.{c.__qualname__}" for c in classes if "WorkerExtension" in c.__name__})
    runner = getattr(worker, "model_runner", None) or getattr(inner, "model_runner", None)
    runner_classes = [f"{c.__module__}.{c.__qualname__}" for c in type(runner).__mro__] if runner is not None else []
    return {
        **vllm_compat.status(),
        "extensions": extensions,
        "env": scoped_variables(),
        "runner": runner_classes,
        "requests_held": _requests_held(runner),
    }


def _requests_held(runner) -> list[str] | None:
    """The ids of the requests the model runner still keeps state for: Model Runner V2's request slots
    (``req_states.req_id_to_index``), V1's cached request states (``requests``); None where it has neither. A request
    is dropped only when a step the runner runs lists it as finished."""
    states = getattr(runner, "req_states", None)
    held = getattr(states, "req_id_to_index", None) if states is not None else getattr(runner, "requests", None)
    return sorted(held) if isinstance(held, dict) else None


def _force_dtype(module, dtype: str) -> None:
    original = module.ModelConfig

    def model_config(*args, **kwargs):
        kwargs["dtype"] = dtype
        return original(*args, **kwargs)

    module.ModelConfig = model_config


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.exit(main())
