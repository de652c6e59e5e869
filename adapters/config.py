"""Adapters for the config dataclasses speculators builds by hand in its generator."""

from __future__ import annotations

import dataclasses
import logging
import os
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import GENERATOR_MODULE, accepts, rewrite_kwargs

from vllm_compat import runners
from vllm_compat.adapter import Adapter
from vllm_compat.errors import AdapterError
from vllm_compat.findings import BASELINE
from vllm_compat.patching import scoped_environ

logger = logging.getLogger("vllm_compat")


class SchedulerConfigKwargs(Adapter):
    """SchedulerConfig's ``is_encoder_decoder`` InitVar.

    What broke: vLLM 0.11.1 added ``is_encoder_decoder`` (InitVar, default False) and 0.12.0 made it and
    ``max_model_len`` required; speculators 0.3.0 does not pass it (pydantic: missing argument), while
    0.4.0.1 passes it and so fails on 0.11.0, which rejects it.
    Where fixed: speculators' call, because False is the only right value for the decoder-only targets the
    generator serves, and vLLM's class must stay strict for everyone else.
    """

    id = "scheduler-config-is-encoder-decoder"
    covers = {"config.scheduler_config_kwargs": {"requires=is_encoder_decoder", "rejects=is_encoder_decoder"}}
    target = GENERATOR_MODULE
    first_vllm = "0.11.1 (added), 0.12.0 (required)"

    def apply(self, module: ModuleType) -> None:
        def fix(cls: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            if accepts(cls, "is_encoder_decoder"):
                kwargs.setdefault("is_encoder_decoder", False)
            else:
                kwargs.pop("is_encoder_decoder", None)
            return kwargs

        self.wrap(module, "SchedulerConfig", rewrite_kwargs(fix))


class AsyncSchedulingOff(Adapter):
    """Keep async scheduling off for the hand-driven loop.

    What broke: from vLLM 0.14.0 ``SchedulerConfig.async_scheduling`` defaults to None and
    ``VllmConfig.__post_init__`` turns it on for the uni/mp executors. Workers then keep sampled tokens on the
    device and expect the AsyncScheduler's placeholders, while speculators drives the plain Scheduler and never
    feeds outputs back (Model Runner V1). Under Model Runner V2, where the flag only moves each worker's wait for a
    step's output to vLLM's output thread, ``async-output-under-v2`` leaves it to vLLM again.
    Where fixed: speculators' SchedulerConfig call (``async_scheduling=False`` unless it asked otherwise); the
    keyword exists in every release from 0.11.0.
    """

    id = "async-scheduling-off"
    covers = {"config.async_scheduling_default": {"auto"}}
    target = GENERATOR_MODULE
    first_vllm = "0.14.0"

    def apply(self, module: ModuleType) -> None:
        def fix(cls: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            kwargs.setdefault("async_scheduling", False)
            return kwargs

        self.wrap(module, "SchedulerConfig", rewrite_kwargs(fix))


class AsyncOutputUnderV2(Adapter):
    """Leave async scheduling to vLLM where the extraction runs on Model Runner V2.

    What was slow (the hand-driven loop under Model Runner V2, the only runner from vLLM 0.34.0): ``async-scheduling-
    off`` keeps async scheduling off, which Model Runner V1 needs (it keeps sampled tokens on the GPU and expects the
    AsyncScheduler's placeholders). Model Runner V2 behaves the same either way; there the flag only decides where
    each worker waits for a step's output: off, in its busy loop, so the next step's RPC is read and its inputs
    prepared only once the GPU has finished (the GPU idles that long every step); on, in vLLM's output thread, as
    in vLLM's own engine, so the next step is prepared while the GPU runs this one. On an H200 (vLLM 0.34.0, an
    886M Llama, calls of 32 x 1024 tokens) a median extraction call spent 22 ms outside the GPU's work against plain
    prefill's 10 ms.
    Where fixed: speculators' SchedulerConfig call, outside ``async-scheduling-off``'s wrapper: ``async_scheduling``
    is passed as None (vLLM's own default) unless speculators asked otherwise, so VllmConfig decides as it does for
    vLLM's engine (on for the multiprocessing executor on a GPU; vLLM's CPU platform turns it off). Applied with
    ``model-runner-v2``, where ``model_runner.v2_async_output`` holds; ``VLLM_COMPAT_ASYNC_OUTPUT=0`` turns it off.
    The worker's replies still come back in the order the RPCs were sent, and the capture's copies are waited for
    before a call's states are handed over, as before.
    """

    id = "async-output-under-v2"
    covers: dict[str, set[str]] = {}
    companion_of = "model-runner-v2"
    relies_on = {"model_runner.v2_async_output": {BASELINE}}
    target = GENERATOR_MODULE
    order = 1  # its wrapper sits outside async-scheduling-off's: the keyword it passes is there first
    first_vllm = "0.14.0 (async scheduling on by default)"
    SWITCH = "VLLM_COMPAT_ASYNC_OUTPUT"

    def apply(self, module: ModuleType) -> None:
        if os.environ.get(self.SWITCH, "").strip().lower() in {"0", "false", "no", "off"}:
            logger.info("vllm-compat: %s=0: each worker waits for a step's output before the next", self.SWITCH)
            return

        def fix(cls: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            if _field_default(cls, "async_scheduling") is None:  # None: "vLLM decides" (0.14.0 on)
                kwargs.setdefault("async_scheduling", None)
            return kwargs

        self.wrap(module, "SchedulerConfig", rewrite_kwargs(fix))


def _field_default(cls: Any, name: str) -> Any:
    """A dataclass field's default, through pydantic's ``Field(default=...)`` (a sentinel string where it has none)."""
    field = getattr(cls, "__dataclass_fields__", {}).get(name)
    default = getattr(field, "default", dataclasses.MISSING)
    if type(default).__name__ == "FieldInfo":
        default = getattr(default, "default", dataclasses.MISSING)
    return "<none>" if default is dataclasses.MISSING or type(default).__name__ == "PydanticUndefinedType" else default


class PrefixCachingOff(Adapter):
    """Turn prefix caching off for speculators 0.3.0, as 0.4.0.1 does.

    What broke: vLLM 0.12.0 made ``enable_prefix_caching`` default to True. 0.3.0 passes no block hasher, so
    ``BlockPool.cache_full_blocks`` asserts once a block fills; and with caching on, a repeated prompt prefix
    would be served from cache and its hidden states never computed, i.e. silently missing.
    Where fixed: speculators' CacheConfig call; extraction must compute every token.
    """

    id = "prefix-caching-off"
    covers = {"config.prefix_caching_default": {"on"}}
    speculators = "==0.3.*"
    target = GENERATOR_MODULE
    first_vllm = "0.12.0"

    def apply(self, module: ModuleType) -> None:
        def fix(cls: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            kwargs.setdefault("enable_prefix_caching", False)
            return kwargs

        self.wrap(module, "CacheConfig", rewrite_kwargs(fix))


class ForceV1ModelRunner(Adapter):
    """Pin Model Runner V1 in vLLM's workers where vLLM would run V2 and the runner choice takes V1.

    What changed: Model Runner V2 became the default (Qwen3 in 0.22.0, Llama in 0.23.0, all dense models in 0.25.0,
    every model in 0.29.0). Where V1 still exists and its facts hold, vllm-compat runs the extraction on the runner
    it chooses (vllm_compat/runners.py: V1 unless measurements or ``VLLM_COMPAT_MODEL_RUNNER=v2`` say otherwise);
    this adapter pins V1 for it, which also makes drift in V2's internals harmless (V2 does not run).
    Where fixed: the environment (``VLLM_USE_V2_MODEL_RUNNER=0``), set while speculators' constructor runs: it builds
    VllmConfig and the Scheduler (which read it) and starts the workers (which inherit it). Other children of the
    process, started later (a ``vllm serve``, say), keep vLLM's default. If the environment asks for V2 by the time
    the constructor runs, it refuses rather than run a runner the plan did not choose.
    """

    id = "model-runner-v1"
    covers = {
        "config.model_runner_default": {"v2_default"},
        **{fact: {"changed"} for fact in runners.V2_FACTS},
    }
    relies_on = runners.V1_FACTS
    target = GENERATOR_MODULE
    first_vllm = "0.22.0 (Qwen3), 0.23.0 (Llama), 0.29.0 (all models)"
    remove_when = "V1 is removed from vLLM (the runner choice then takes model-runner-v2)"
    VARIABLE = runners.VLLM_ENV

    def apply(self, module: ModuleType) -> None:
        self.refuse_other_runner()  # at import already, where it can: before anything is built

        def init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            self.refuse_other_runner()
            with scoped_environ({self.VARIABLE: "0"}):
                return wrapped(*args, **kwargs)

        self.wrap(module, "VllmHiddenStatesGenerator.__init__", init)

    def refuse_other_runner(self) -> None:
        want, source = runners.requested()
        if want == "v2":
            raise AdapterError(
                f"{source} asks for Model Runner V2, but vllm-compat chose Model Runner V1 when speculators' generator "
                f"was imported. Set {runners.ENV} (or {self.VARIABLE}) before importing speculators."
            )
