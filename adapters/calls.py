"""Adapters around a ``generate()`` call as a whole, in the generator's process."""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import GENERATOR_MODULE, wrap_instance_method

from vllm_compat.adapter import Adapter

BEGIN_CALL = "_vllm_compat_begin_call"  # the worker extension method per-request-capture adds


class CallPlanToWorkers(Adapter):
    """Tell the workers, as each call starts, which requests it holds and how long their prompts are.

    Why: the workers lay a call's states out and put each step's rows in place while the steps run
    (per-request-capture); for that they need the call's requests in input order and their prompt lengths before the
    first step, which only the generator's process knows.
    Where fixed: speculators' scheduler and executor objects: each request speculators adds is noted (its id and
    prompt length, exactly as speculators built it), and speculators' ``collective_rpc("_reset_capture")``, which it
    sends after adding a call's requests and before its first step, becomes ``_vllm_compat_begin_call(plan)``: the
    same reset in the workers, with the plan. No extra round trip.
    """

    id = "call-plan-to-workers"
    always = "the workers lay each call's states out from its requests, known only to the generator's process"
    target = GENERATOR_MODULE
    remove_when = "speculators no longer uses the in-process generator (>= 0.5)"

    def apply(self, module: ModuleType) -> None:
        def init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = wrapped(*args, **kwargs)
            plan: list[tuple[str, int]] = []
            instance._vllm_compat_plan = plan

            def add_request(wrapped: Any, scheduler: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                request = args[0] if args else kwargs["request"]
                plan.append((request.request_id, _prompt_tokens(request)))
                return wrapped(*args, **kwargs)

            def collective_rpc(wrapped: Any, executor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                method = kwargs.get("method", args[0] if args else None)
                if method != "_reset_capture" or not self.applied:
                    return wrapped(*args, **kwargs)
                requests = list(plan)
                plan.clear()
                rest = {k: v for k, v in kwargs.items() if k not in ("method", "args")}
                return wrapped(BEGIN_CALL, *args[1:2], args=(requests,), **rest)

            wrap_instance_method(instance.scheduler, "add_request", add_request)
            wrap_instance_method(instance.executor, "collective_rpc", collective_rpc)
            return result

        def generate(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            plan = getattr(instance, "_vllm_compat_plan", None)
            if plan is not None:
                plan.clear()  # requests a failed call added before its reset are not this call's
            return wrapped(*args, **kwargs)

        self.wrap(module, "VllmHiddenStatesGenerator.__init__", init)
        self.wrap(module, "VllmHiddenStatesGenerator.generate", generate)


def _prompt_tokens(request: Any) -> int:
    count = getattr(request, "num_prompt_tokens", None)
    return int(count) if isinstance(count, int) else len(request.prompt_token_ids)


class OneCallAtATime(Adapter):
    """Serialise ``generate()`` calls on one generator: a second thread's call waits for the first to end.

    What broke (a speculators defect, on every vLLM): a generator holds one scheduler, one executor and one capture
    state in each worker, and ``generate()`` drives them step by step with no lock. Two threads calling it at once
    interleave their requests and RPCs: one call's states are reset or collected by the other, requests go missing
    (``KeyError``), replies are taken for the wrong call, and a worker can wait forever on a reset that never comes.
    Where fixed: ``generate`` of each generator object, outermost of every wrapper (so waves, input checks and result
    order run inside the lock). Calls from one thread at a time are unaffected; the lock is re-entrant.
    """

    id = "one-call-at-a-time"
    always = "a speculators defect: generate() from two threads at once mixes up both calls"
    target = GENERATOR_MODULE
    order = 100  # applied last: its wrapper is set on each generator after every other adapter's
    remove_when = "speculators no longer uses the in-process generator (>= 0.5)"

    def apply(self, module: ModuleType) -> None:
        def generate(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            generator = instance if instance is not None else getattr(wrapped, "__self__", None)
            lock = getattr(generator, "_vllm_compat_call_lock", None)
            if lock is None or not self.applied:
                return wrapped(*args, **kwargs)
            with lock:
                return wrapped(*args, **kwargs)

        def init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = wrapped(*args, **kwargs)
            instance._vllm_compat_call_lock = threading.RLock()
            wrap_instance_method(instance, "generate", generate)  # after every other adapter's: the outermost
            return result

        self.wrap(module, "VllmHiddenStatesGenerator.__init__", init)
