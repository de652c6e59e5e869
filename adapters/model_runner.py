"""Adapters that run the extraction on Model Runner V2: pin it for the workers, and record each step's layout there."""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import GENERATOR_MODULE, WORKER_MODULE, on_cpu

from vllm_compat import batch_order, runners
from vllm_compat.adapter import Adapter
from vllm_compat.errors import AdapterError
from vllm_compat.patching import scoped_environ

logger = logging.getLogger("vllm_compat")


class ModelRunnerV2(Adapter):
    """Run the extraction on Model Runner V2 where the runner choice takes it.

    What changed: vLLM 0.12.0 added Model Runner V2, made it the default for more and more models from 0.22.0, and
    will delete V1. V2 has no ``model_runner.input_batch`` (speculators 0.4.0.1 reads ``req_id_to_index`` there, and
    the capture of both lines needs each step's row order): it builds a fresh batch for every step and sorts its
    requests its own way. vllm-compat takes V2 where V1 is gone, where ``VLLM_COMPAT_MODEL_RUNNER=v2`` (or
    ``VLLM_USE_V2_MODEL_RUNNER=1``) asks for it, or where V2 is vLLM's default and preferred (vllm_compat/runners.py);
    rows are then attributed from V2's own per-step batch (``v2-batch-layout`` records it, vllm_compat/batch_order.py
    reads it). This also makes V1's absence or drift harmless: V1 does not run.
    Where fixed: the environment (``VLLM_USE_V2_MODEL_RUNNER=1``), set while speculators' constructor builds its
    VllmConfig and starts the workers, so the run uses the runner the plan chose whatever vLLM's default for the
    model; vLLM raises its own error where V2 does not support the configuration. Refused on vLLM's CPU platform:
    V2 needs Triton on a GPU there.
    """

    id = "model-runner-v2"
    covers = {
        "config.model_runner_default": {"v2_opt_in", "v2_default", "v2_only"},
        "model_runner.v1_attributes": {"absent", "changed"},
        "scheduler.batch_order": {"absent", "no_index"},
    }
    relies_on = runners.V2_FACTS
    target = GENERATOR_MODULE
    first_vllm = "0.12.0 (on request), 0.22.0 (vLLM's default for some models), V1's removal (the only runner)"
    remove_when = "speculators no longer uses the in-process generator (>= 0.5)"
    VARIABLE = runners.VLLM_ENV

    def apply(self, module: ModuleType) -> None:
        self.refuse()  # at import already, where it can: before anything is built

        def init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            self.refuse()
            with scoped_environ({self.VARIABLE: "1"}):
                return wrapped(*args, **kwargs)

        self.wrap(module, "VllmHiddenStatesGenerator.__init__", init)

    def refuse(self) -> None:
        want, source = runners.requested()
        if want == "v1":
            raise AdapterError(
                f"{source} asks for Model Runner V1, but vllm-compat chose Model Runner V2 when speculators' generator "
                f"was imported. Set {runners.ENV} (or {self.VARIABLE}) before importing speculators."
            )
        if on_cpu():
            raise AdapterError(
                "Model Runner V2 needs Triton on a GPU; vLLM's CPU platform runs Model Runner V1 only. "
                f"Unset {runners.ENV} and {self.VARIABLE}, or set {runners.ENV}=v1."
            )


class V2BatchLayout(Adapter):
    """Record the row layout of each step Model Runner V2 runs, for the capture to attribute rows to requests.

    What changed: V2 (vLLM 0.12.0 on) builds a step's batch inside ``execute_model`` (``prepare_inputs``, requests
    sorted by scheduled tokens) and keeps it in a local until the forward is over; speculators' patched forward, which
    captures the states, cannot see it.
    V2 also runs its warm-up (``compile_or_warm_up_model``: dummy runs, and steps of made-up requests through
    ``execute_model``) after speculators set up the capture; those are no call's steps.
    Where fixed: the worker's own model runner object, when speculators sets up the capture: its ``prepare_inputs``
    is wrapped to keep the returned batch's request order and row offsets (``query_start_loc``) for
    ``vllm_compat.batch_order.rows_of_step``, and the worker's ``compile_or_warm_up_model`` marks the runner as
    warming up while it runs (``rows_of_step`` answers None: nothing to capture). Applied only where the plan takes
    ``model-runner-v2``; under V1 there is nothing to wrap.
    """

    id = "v2-batch-layout"
    covers: dict[str, set[str]] = {}
    companion_of = "model-runner-v2"
    target = WORKER_MODULE
    side = "worker"
    first_vllm = "0.12.0"

    def apply(self, module: ModuleType) -> None:
        def setup(wrapped: Any, ext: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = wrapped(*args, **kwargs)
            runner = ext.model_runner
            if any(getattr(patch, "owner", None) is runner for patch in self._patches):
                return result  # set up again on the same runner: its layout is recorded already
            if batch_order.is_v2_runner(runner):
                self.wrap(runner, "prepare_inputs", batch_order.record_v2_steps())
                if callable(getattr(ext, "compile_or_warm_up_model", None)):  # ext is the worker (its extension)
                    self.wrap(ext, "compile_or_warm_up_model", _warming_up(runner))
                logger.debug("vllm-compat: recording the batch layout of %s", type(runner).__qualname__)
            else:
                logger.debug("vllm-compat: %s is not Model Runner V2: no layout to record", type(runner).__qualname__)
            return result

        self.wrap(module, "HiddenStatesWorkerExtension._setup_hidden_states_capture", setup)


def _warming_up(runner: Any) -> Any:
    """A wrapper for the worker's ``compile_or_warm_up_model``: the runner is marked as warming up while it runs."""

    def warm_up(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        setattr(runner, batch_order.WARMING_UP_ATTRIBUTE, True)
        try:
            return wrapped(*args, **kwargs)
        finally:
            setattr(runner, batch_order.WARMING_UP_ATTRIBUTE, False)

    return warm_up
