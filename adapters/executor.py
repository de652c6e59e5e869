"""Adapters for the call conventions of the MultiprocExecutor speculators drives."""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import GENERATOR_MODULE, after_construct, wrap_instance_method

from vllm_compat.adapter import Adapter
from vllm_compat.lines import judge_line

logger = logging.getLogger("vllm_compat")

# The worker-extension methods speculators calls with unique_reply_rank. Only these replies are reshaped:
# vLLM's own executor calls collective_rpc(..., unique_reply_rank=...) internally and needs its own shape.
_EXTENSION_REPLIES = frozenset({"_get_captured_states"})


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
