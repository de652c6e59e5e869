"""Adapters for the call conventions of the MultiprocExecutor speculators drives."""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import GENERATOR_MODULE, accepts, after_construct, wrap_instance_method

from vllm_compat.adapter import Adapter
from vllm_compat.lines import judge_line

logger = logging.getLogger("vllm_compat")

# The worker-extension methods speculators calls with unique_reply_rank. Only these replies are reshaped:
# vLLM's own executor calls collective_rpc(..., unique_reply_rank=...) internally and needs its own shape.
_EXTENSION_REPLIES = frozenset({"_get_captured_states"})
ENV_STEPS_IN_FLIGHT = "VLLM_COMPAT_STEPS_IN_FLIGHT"  # at most this many steps in flight; 1: wait for each step
_STEP_METHODS = frozenset({"execute_model", "sample_tokens"})


class StepsInFlight(Adapter):
    """Send speculators' engine steps without waiting for each reply, as vLLM's own engine does.

    What was slow (speculators, on every vLLM with the two-phase step protocol, 0.11.1 on): the generator drives the
    engine by hand and waits for each step's reply (``execute_model()``, then ``sample_tokens()``, both blocking)
    before it schedules and sends the next step. Between two steps the GPU idles for the reply's trip back, the
    generator's scheduling and the next request's trip to the worker. vLLM's own engine sends both calls with
    ``non_block=True`` and keeps ``max_concurrent_batches`` steps in flight. On an H200 (Model Runner V2, an 886M
    model, 32 x 1024 tokens a call, the same host) a call took 0.1685 s one step at a time, 0.1617 s with two in
    flight (median of 8 calls).
    Where fixed: speculators' executor object, innermost of the adapters' wrappers (``sample-after-execute`` sees
    ``execute_model()`` return None and sends ``sample_tokens()``, as on a blocking executor). Both calls are sent
    with ``non_block=True``; speculators reads neither reply (it schedules from its own bookkeeping: its scheduler
    never sees the outputs). Once a step's ``sample_tokens()`` is sent, the oldest steps are waited for until fewer
    than two (or vLLM's ``max_concurrent_batches``, if more) remain in flight, as EngineCore's batch queue does. A
    worker runs its RPCs one at a time in the order they were sent, so what it computes is what it computed before;
    with async scheduling off (``async-scheduling-off``) it finishes a step before it reads the next, and what is
    saved is the generator's side of the gap. Any other RPC (a call's collect, its next reset) waits for every step in
    flight first, as vLLM's executor returns replies in order, and a step that failed raises its own error there.
    Applied where the executor's ``execute_model`` and ``sample_tokens`` take ``non_block``;
    ``VLLM_COMPAT_STEPS_IN_FLIGHT=1`` turns it off.
    """

    id = "steps-in-flight"
    always = "speculators waits for each engine step's reply before it sends the next; vLLM's engine does not"
    target = GENERATOR_MODULE
    order = -10  # its wrappers of the executor's methods sit innermost, under sample-after-execute's
    first_vllm = "0.11.1 (the two-phase step protocol)"

    def apply(self, module: ModuleType) -> None:
        def hook(executor: Any) -> None:
            depth = _steps_in_flight(executor)
            if depth < 2 or not _takes_non_block(executor):
                logger.debug("vllm-compat: steps-in-flight: one step at a time (depth %d)", depth)
                return
            steps = _Steps(depth, lambda: self.applied)
            executor._vllm_compat_steps = steps
            wrap_instance_method(executor, "execute_model", steps.execute_model)
            wrap_instance_method(executor, "sample_tokens", steps.sample_tokens)
            wrap_instance_method(executor, "collective_rpc", steps.other_rpc)

        def generate(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            interrupted = False
            try:
                return wrapped(*args, **kwargs)
            except BaseException as exc:
                interrupted = not isinstance(exc, Exception)  # Ctrl-C: vllm_compat.recovery reads the replies owed
                raise
            finally:
                steps = getattr(getattr(instance, "executor", None), "_vllm_compat_steps", None)
                if steps is not None:
                    if interrupted:
                        steps.forget()
                    else:
                        steps.settle()  # a call that failed between steps leaves none in flight for the next one

        self.wrap(module, "MultiprocExecutor", after_construct(hook))
        self.wrap(module, "VllmHiddenStatesGenerator.generate", generate)


def _steps_in_flight(executor: Any) -> int:
    """How many steps may be in flight: VLLM_COMPAT_STEPS_IN_FLIGHT, else two, or more where vLLM's engine would keep
    more (the executor's or, in later releases, the config's ``max_concurrent_batches``: pipeline parallelism)."""
    value = os.environ.get(ENV_STEPS_IN_FLIGHT, "").strip()
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            logger.warning("vllm-compat: %s=%r is not a whole number; using 2", ENV_STEPS_IN_FLIGHT, value)
            return 2
    for owner in (executor, getattr(executor, "vllm_config", None)):
        try:
            depth = getattr(owner, "max_concurrent_batches", None)
        except Exception:  # a property that cannot answer for this config
            depth = None
        if isinstance(depth, int):
            return max(2, depth)
    return 2


def _takes_non_block(executor: Any) -> bool:
    """Whether the executor's own two-phase step methods (not a stand-in) take ``non_block``."""
    cls = type(executor)
    return all(
        callable(getattr(cls, name, None)) and accepts(getattr(executor, name), "non_block") for name in _STEP_METHODS
    )


class _Steps:
    """The steps one executor has in flight: (execute_model's future, sample_tokens' future or None), oldest last."""

    def __init__(self, depth: int, enabled: Callable[[], bool]) -> None:
        self.depth = depth
        self.enabled = enabled  # False once the adapter is reverted: calls wait for their replies again
        self.in_flight: deque[list[Any]] = deque()
        self.peak = 0  # the most steps that were in flight at once (what tests and benchmarks read)

    def execute_model(self, wrapped: Any, executor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.enabled():
            self.drain()
            return wrapped(*args, **kwargs)
        self.in_flight.appendleft([wrapped(*args, **{**kwargs, "non_block": True}), None])
        return None  # what a blocking execute_model() returns before sample_tokens() (speculators reads no output)

    def sample_tokens(self, wrapped: Any, executor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.enabled() and not (self.in_flight and self.in_flight[0][1] is None):
            return wrapped(*args, **kwargs)
        future = wrapped(*args, **{**kwargs, "non_block": True})
        if self.in_flight and self.in_flight[0][1] is None:
            self.in_flight[0][1] = future
        else:
            self.in_flight.appendleft([None, future])
        self.peak = max(self.peak, len(self.in_flight))
        while len(self.in_flight) >= self.depth:
            self._wait(self.in_flight.pop())
        return None

    def other_rpc(self, wrapped: Any, executor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        method = kwargs.get("method", args[0] if args else None)
        if kwargs.get("non_block") or method in _STEP_METHODS or not self.in_flight:
            return wrapped(*args, **kwargs)
        self.drain()  # replies come back in order: the steps' first, and a failed step's error is raised here
        return wrapped(*args, **kwargs)

    def drain(self) -> None:
        """Wait for every step in flight, oldest first; a failed step raises its error."""
        while self.in_flight:
            self._wait(self.in_flight.pop())

    def forget(self) -> None:
        """Forget the steps in flight without waiting (an interrupted call: their replies are drained by
        vllm_compat.recovery, which reads each worker's replies up to one of its own)."""
        self.in_flight.clear()

    def settle(self) -> None:
        """Wait for every step in flight and forget their errors (the call ends, or failed already)."""
        while self.in_flight:
            step = self.in_flight.pop()
            for future in step:
                if future is not None:
                    try:
                        future.result()
                    except Exception as exc:  # the call's own error is on its way out
                        logger.debug("vllm-compat: steps-in-flight: a step of a call that failed: %r", exc)

    @staticmethod
    def _wait(step: list[Any]) -> None:
        execute, sample = step
        for future in (sample, execute):  # the sample's reply comes later: then the forward's error, if any, is known
            if future is not None:
                future.result()


class SampleAfterExecute(Adapter):
    """Finish each step with ``sample_tokens()`` for speculators 0.3.0.

    What broke: from vLLM 0.11.1 ``execute_model()`` runs the forward and returns None; ``sample_tokens()``
    must follow before the next ``execute_model()``, or the worker raises "State error: sample_tokens() must be
    called after execute_model() returns None". 0.3.0 only calls ``execute_model()``.
    Where fixed: speculators' own executor object: when ``execute_model()`` returns None, ``sample_tokens(None)``
    completes the step (no structured output: no grammar bitmask), exactly as EngineCore does.
    """

    id = "sample-after-execute"
    covers = {"executor.execute_model_protocol": {"two_phase"}}
    speculators = "==0.3.*"
    target = GENERATOR_MODULE
    first_vllm = "0.11.1"

    def apply(self, module: ModuleType) -> None:
        def execute_model(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            output = wrapped(*args, **kwargs)
            if output is None:
                output = wrapped.__self__.sample_tokens(None)
            return output

        self.wrap(
            module,
            "MultiprocExecutor",
            after_construct(lambda ex: wrap_instance_method(ex, "execute_model", execute_model)),
        )


class SampleTokensInExecute(Adapter):
    """Give speculators 0.4.0.1 a ``sample_tokens()`` on vLLM 0.11.0.

    What broke: 0.4.0.1 calls ``execute_model()`` then ``sample_tokens(output)``, the two-phase protocol of vLLM
    0.11.1 and later; on 0.11.0 ``execute_model()`` samples too and there is no ``sample_tokens``.
    Where fixed: speculators' executor object: ``sample_tokens(output)`` returns the output ``execute_model()``
    already produced.
    """

    id = "sample-tokens-in-execute"
    covers = {"executor.execute_model_protocol": {"single_phase"}}
    speculators = "==0.4.*"
    target = GENERATOR_MODULE
    first_vllm = "0.11.0 (the protocol appeared in 0.11.1)"

    def apply(self, module: ModuleType) -> None:
        def add_sample_tokens(executor: Any) -> None:
            if not hasattr(executor, "sample_tokens"):
                executor.sample_tokens = lambda output=None, *args, **kwargs: output

        self.wrap(module, "MultiprocExecutor", after_construct(add_sample_tokens))


class UniqueReplyShape(Adapter):
    """Give speculators the ``collective_rpc(..., unique_reply_rank=0)`` reply shape it was written for.

    What broke: vLLM 0.11.1 made ``collective_rpc`` return the single reply (not a one-element list) when
    ``unique_reply_rank`` is set. speculators 0.3.0 indexes ``[0]`` and so takes the first layer's tensor
    as the list of layers (then ``if not aux_hidden_states`` fails on a tensor); 0.4.0.1 expects the single
    reply and gets ``[dict]`` on 0.11.0.
    Where fixed: speculators' executor object, for speculators' own extension methods only.
    """

    id = "unique-reply-shape"
    covers = {"executor.unique_reply_shape": {"single", "list"}}
    target = GENERATOR_MODULE
    first_vllm = "0.11.1"

    def apply(self, module: ModuleType) -> None:
        # The direction follows from the line of the code that runs (this adapter is applied only when vLLM's
        # convention differs from that line's): the reply itself cannot tell, since speculators' own replies are lists.
        wants_list = judge_line().line == "0.3.0"

        def collective_rpc(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            reply = wrapped(*args, **kwargs)
            method = kwargs.get("method", args[0] if args else None)
            if kwargs.get("unique_reply_rank") is None or method not in _EXTENSION_REPLIES:
                return reply
            return [reply] if wants_list else reply[0]

        self.wrap(
            module,
            "MultiprocExecutor",
            after_construct(lambda ex: wrap_instance_method(ex, "collective_rpc", collective_rpc)),
        )


class WarmUpAfterInitialize(Adapter):
    """Warm the model up after the KV cache is allocated, as EngineCore does.

    What broke: up to vLLM 0.26 ``Executor.initialize_from_config()`` also ran ``compile_or_warm_up_model`` on
    the workers; from 0.27.0 EngineCore calls ``Executor.compile_or_warm_up_model()`` separately. speculators
    only calls ``initialize_from_config()``, so kernels are compiled on the first real batch and the workers'
    seed is never re-set after profiling.
    Where fixed: speculators' executor object: ``compile_or_warm_up_model()`` right after
    ``initialize_from_config()``. Warm-up forwards run outside any scheduled step, and the capture code ignores
    them (per-request capture) or speculators resets them (``_reset_capture`` before each batch).
    """

    id = "warm-up-after-initialize"
    covers = {"executor.warmup_in_initialize": {"separate"}}
    target = GENERATOR_MODULE
    first_vllm = "0.27.0"

    def apply(self, module: ModuleType) -> None:
        def initialize(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = wrapped(*args, **kwargs)
            wrapped.__self__.compile_or_warm_up_model()
            return result

        self.wrap(
            module,
            "MultiprocExecutor",
            after_construct(lambda ex: wrap_instance_method(ex, "initialize_from_config", initialize)),
        )
