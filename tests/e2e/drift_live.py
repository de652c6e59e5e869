"""Make the installed vLLM drift in one way no adapter knows, then run a user's extraction start-up; record the error.

Run by tests/e2e/test_fail_closed.py, one fresh interpreter per case. The change is made to the real vLLM modules in
this process only (a monkeypatch, before speculators is imported), so the probes see it exactly as they would see a
future release. Then, as a user would: ``import vllm_compat`` (``--mode auto``) or also
``vllm_compat.install(strict=True)`` (``--mode strict``), import speculators' generator and build it on a real model.
The JSON written to ``--out`` says where it stopped (install, import, constructor or nowhere), the exception's type
and message, whether vLLM's MultiprocExecutor was ever constructed, and which child processes exist.

    python tests/e2e/drift_live.py KIND --mode auto|strict --model DIR --out OUT.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
from typing import Any

import procs  # tests/e2e/procs.py

RECORD: dict[str, Any] = {"stage": "none", "executors_built": 0}


# -- the changes: each one a drift no adapter covers ------------------------------------------------------------------
def request_new_required_parameter() -> None:
    """``Request(...)`` gains a required keyword-only parameter (a new field vLLM needs)."""
    from vllm.v1 import request

    original = request.Request.__init__

    def __init__(self: Any, *args: Any, scheduling_tier: int, **kwargs: Any) -> None:
        original(self, *args, **kwargs)

    request.Request.__init__ = __init__


def planning_helper_removed() -> None:
    """``get_kv_cache_config_from_groups`` disappears from kv_cache_utils, and nowhere known has it."""
    from vllm.v1.core import kv_cache_utils

    del kv_cache_utils.get_kv_cache_config_from_groups


def planning_parameter_renamed() -> None:
    """``get_kv_cache_config_from_groups(kv_cache_groups=...)`` is renamed to ``groups``."""
    from vllm.v1.core import kv_cache_utils

    original = kv_cache_utils.get_kv_cache_config_from_groups

    def get_kv_cache_config_from_groups(vllm_config: Any, groups: Any, available_memory: int) -> Any:
        return original(vllm_config, groups, available_memory)

    kv_cache_utils.get_kv_cache_config_from_groups = get_kv_cache_config_from_groups


def reply_convention_changed() -> None:
    """``collective_rpc`` returns its replies in a shape the probe has never seen (a dict keyed by rank)."""
    from vllm.v1.executor import multiproc_executor

    base = multiproc_executor.MultiprocExecutor

    class MultiprocExecutor(base):  # type: ignore[misc, valid-type]
        def collective_rpc(self, method: Any, timeout: Any = None, args: Any = (), kwargs: Any = None, **kw: Any):
            replies = super().collective_rpc(method, timeout, args, kwargs, **kw)
            return {"by_rank": dict(enumerate(replies if isinstance(replies, list) else [replies]))}

    MultiprocExecutor.__module__ = __name__
    multiproc_executor.MultiprocExecutor = MultiprocExecutor


def model_runner_v2_forced() -> None:
    """Not a vLLM change: the user forces Model Runner V2, which vLLM's CPU platform cannot run: model-runner-v2 must
    refuse (or, where vLLM has no V2, the guard must stop the run for want of a capture path)."""
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"


KINDS = {
    "request-new-required-parameter": request_new_required_parameter,
    "planning-helper-removed": planning_helper_removed,
    "planning-parameter-renamed": planning_parameter_renamed,
    "reply-convention-changed": reply_convention_changed,
    "model-runner-v2-forced": model_runner_v2_forced,
}


def count_executors() -> None:
    """Count MultiprocExecutor constructions (wrapt keeps the signature, so the probes see the class unchanged)."""
    import wrapt
    from vllm.v1.executor import multiproc_executor

    def counting(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        RECORD["executors_built"] += 1
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(multiproc_executor.MultiprocExecutor, "__init__", counting)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("--mode", choices=["auto", "strict"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    RECORD.update(kind=args.kind, mode=args.mode)
    try:
        KINDS[args.kind]()
        count_executors()
        RECORD["stage"] = "install"
        import vllm_compat

        if args.mode == "strict":
            vllm_compat.install(strict=True)
        RECORD["stage"] = "import"
        module = importlib.import_module("speculators.data_generation.vllm_hidden_states_generator")
        RECORD["applied"] = sorted(vllm_compat.status()["applied"])
        RECORD["stage"] = "constructor"
        generator = module.VllmHiddenStatesGenerator(model_path=args.model, layer_ids=[0, 2, 3], max_model_len=256)
        RECORD["stage"] = "none"
        generator.executor.shutdown()
    except BaseException as exc:
        RECORD["error_type"] = f"{type(exc).__module__}.{type(exc).__qualname__}"
        RECORD["error_mro"] = [f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__]
        RECORD["message"] = str(exc)
        RECORD["trace"] = traceback.format_exc()[-4000:]
        if hasattr(exc, "findings"):
            RECORD["findings"] = [{"probe": f.probe, "symbol": f.symbol, "state": str(f.state)} for f in exc.findings]
    RECORD["children"] = [{"pid": p.pid, "cmdline": p.cmdline[:120]} for p in procs.workers()]
    with open(args.out, "w") as f:
        json.dump(RECORD, f, indent=2)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.exit(main())
