"""Adapters around a ``generate()`` call as a whole, in the generator's process."""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import GENERATOR_MODULE, wrap_instance_method

from vllm_compat import recovery
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
    same reset in the workers, with the plan. No extra round trip; and 0.4.0.1's ``_set_request_metadata`` before
    every step, which only its own grouping read, is not sent (one round trip to the workers per step saved).
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
                if not self.applied:
                    return wrapped(*args, **kwargs)
                if method == "_set_request_metadata":
                    return None  # per-request-capture takes each step's layout from the runner: a round trip saved
                if method != "_reset_capture":
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


class InterruptedCalls(Adapter):
    """Keep a generator usable after Ctrl-C during ``generate()``, or say in one line that it is not.

    What broke (a speculators defect, on every vLLM; found on vLLM CPU 0.32.0): a ``KeyboardInterrupt`` in the
    generator's process during a call (a SIGINT to the caller) leaves the replies vLLM's executor was waiting for on
    the workers' response queues, and vLLM's reply future, popped before it waits, is lost: every later RPC reads the
    reply of the one before it. The interrupted call's requests stay in the scheduler too. Every later call failed,
    none with a reason (48 of 48 in the audit: ``TypeError: object of type 'ModelRunnerOutput' has no len()``,
    ``per-request-capture: request req_N_8 has 0 captured rows``, ``Failed to capture hidden states from worker``),
    with two steps in flight or one.
    Where fixed: ``generate`` of each generator object, inside one-call-at-a-time's lock and outside every other
    wrapper. When a call ends in a ``BaseException`` that is not an ``Exception`` (KeyboardInterrupt, SystemExit),
    vllm_compat.recovery aborts every request in the scheduler, sends one RPC of its own that every worker answers
    once it has run everything sent before (finishing a step left half done), and drops each worker's replies up to
    that answer; then the scheduler must hold no request and no KV-cache block. The exception is raised as before and
    the next call works. Where that cannot be done or shown, the generator is marked unusable and its next call raises
    a RuntimeError that says so and to make a new generator. A call that returns or raises an ``Exception`` passes
    through (no RPC, copy or system call added).
    """

    id = "interrupted-calls"
    always = "a speculators defect: Ctrl-C during generate() leaves the engine's replies one call late for good"
    target = GENERATOR_MODULE
    order = 99  # its wrapper is set on each generator just before one-call-at-a-time's: inside that lock
    remove_when = "speculators no longer uses the in-process generator (>= 0.5)"

    def apply(self, module: ModuleType) -> None:
        def generate(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            generator = instance if instance is not None else getattr(wrapped, "__self__", None)
            state = getattr(generator, "__dict__", {})
            unusable = state.get(recovery.UNUSABLE)
            if unusable:
                raise RuntimeError(unusable)
            try:
                return wrapped(*args, **kwargs)
            except BaseException as exc:
                if not isinstance(exc, Exception) and self.applied and generator is not None:
                    recovery.recover(generator, exc)
                raise

        def init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = wrapped(*args, **kwargs)
            wrap_instance_method(instance, "generate", generate)  # outside batches-in-waves, inside the call lock
            return result

        self.wrap(module, "VllmHiddenStatesGenerator.__init__", init)
