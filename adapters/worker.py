"""Adapters applied inside vLLM's worker processes, to speculators' HiddenStatesWorkerExtension."""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import WORKER_MODULE
from vllm_compat.probes.model import FAMILIES

from vllm_compat import capture
from vllm_compat.adapter import Adapter
from vllm_compat.batch_order import rows_of_step
from vllm_compat.errors import AdapterError
from vllm_compat.lines import judge_line

logger = logging.getLogger("vllm_compat")


def base_model_of(model: Any) -> Any:
    """The module holding the decoder layers: the language model of a multimodal wrapper, else ``model.model``.

    A wrapper's language model is usually a CausalLM whose ``.model`` holds the layers; in some releases (Kimi-K2.5
    in vLLM 0.15.0) it holds the layers itself.
    """
    if hasattr(model, "get_language_model"):
        language_model = model.get_language_model()
        inner = getattr(language_model, "model", None)
        if inner is None and hasattr(language_model, "layers"):
            return language_model
        return language_model.model
    return model.model


class EmbeddingMethodAlias(Adapter):
    """The base model's embedding method was renamed.

    What broke: vLLM 0.11.1 renamed ``LlamaModel.get_input_embeddings`` to ``embed_input_ids`` (and every family
    of probes/model.py alike). speculators 0.3.0's patched forward calls ``get_input_embeddings`` (AttributeError on the
    first batch); 0.4.0.1 calls ``embed_input_ids``, missing on 0.11.0.
    Where fixed: the base model instance in the worker, right after speculators patched its forward: the missing
    name is bound to the one the model has.
    """

    id = "embedding-method-alias"
    covers = {f"{family.prefix}.embedding_method": {"embed_input_ids", "get_input_embeddings"} for family in FAMILIES}
    target = WORKER_MODULE
    side = "worker"
    first_vllm = "0.11.1"

    def apply(self, module: ModuleType) -> None:
        def setup(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = wrapped(*args, **kwargs)
            base = base_model_of(instance.model_runner.model)
            for missing, present in (
                ("get_input_embeddings", "embed_input_ids"),
                ("embed_input_ids", "get_input_embeddings"),
            ):
                if not hasattr(base, missing) and hasattr(base, present):
                    object.__setattr__(base, missing, getattr(base, present))
            return result

        self.wrap(module, "HiddenStatesWorkerExtension._setup_hidden_states_capture", setup)


class PerRequestCapture(Adapter):
    """Put each request's captured rows in their place in the call as the steps run, for both speculators lines.

    What broke: speculators 0.3.0 concatenates the captured rows of every step and slices them by the input lengths,
    assuming the rows follow the input order (speculators issue #279, on every vLLM): vLLM moves requests between
    batch rows (``InputBatch.condense``/``swap_states``) and splits prompts across steps, so the slices can belong to
    other sequences: silently wrong hidden states. 0.4.0.1 sorts per-step metadata by V1's
    ``input_batch.req_id_to_index``, which Model Runner V2 does not have; and both keep every step's captures on the
    GPU until the call ends, then copy them again.
    Where fixed: the worker extension. The generator's process sends the call's plan (its requests and prompt
    lengths, call-plan-to-workers) in place of ``_reset_capture``; each step's rows are attributed to requests in the
    model runner's own row order (vllm_compat.batch_order) and copied to their place in a call block laid out per
    layer in input order (vllm_compat.capture), overlapped with the next step on a GPU. ``_get_captured_states``
    returns what speculators' line expects: per layer, every sequence's rows in input order (0.3.0), or per request
    its list of layers (0.4.0.1). A request missing from the step's batch, a short capture or a prompt not wholly
    captured raises instead of returning.
    """

    id = "per-request-capture"
    always = "each step's rows go to their request's place while the call runs (speculators groups them at its end)"
    covers = {"scheduler.batch_order": {"reorders"}}
    target = WORKER_MODULE
    side = "worker"
    first_vllm = "0.11.0 (present in speculators 0.3.0's own baseline)"
    remove_when = "speculators no longer uses the in-process generator (>= 0.5)"

    def apply(self, module: ModuleType) -> None:
        cls = module.HiddenStatesWorkerExtension
        line = judge_line().line or "0.4.0.1"

        def setup(wrapped: Any, ext: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = wrapped(*args, **kwargs)
            ext._vllm_compat_call = None
            ext._vllm_compat_step = None
            runner = ext.model_runner
            if not getattr(runner, "_vllm_compat_step_recorder", False):
                original = runner.execute_model

                def execute_model(scheduler_output: Any, *rest: Any, **kw: Any) -> Any:
                    ext._vllm_compat_step = scheduler_output
                    try:
                        return original(scheduler_output, *rest, **kw)
                    finally:
                        ext._vllm_compat_step = None

                runner.execute_model = execute_model
                runner._vllm_compat_step_recorder = True
            layer_ids = args[0] if args else kwargs.get("layer_ids", ())
            _prepare_slabs(ext, layer_ids)
            return result

        def begin_call(ext: Any, plan: list[tuple[str, int]]) -> None:
            """speculators' ``_reset_capture``, then the call's plan (sent by the generator's process)."""
            ext._reset_capture()
            ext._vllm_compat_call = capture.CallCapture(plan, line)

        def store(wrapped: Any, ext: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            step = getattr(ext, "_vllm_compat_step", None)
            if step is None:
                return None  # a warm-up or profiling forward: not a scheduled step, nothing to capture
            rows = rows_of_step(ext.model_runner, step)
            if rows is None:
                return None  # a step of no call (a runner's warm-up or dummy run): nothing to capture
            call = getattr(ext, "_vllm_compat_call", None)
            if call is None:
                raise AdapterError(
                    "per-request-capture: a step ran without the call's plan from the generator's process "
                    "(call-plan-to-workers is not active there); refusing to guess which rows belong to which request"
                )
            aux = args[0] if args else kwargs["aux_hidden_states"]
            call.store(list(aux), rows)
            return None

        def reset(wrapped: Any, ext: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = wrapped(*args, **kwargs)
            previous = getattr(ext, "_vllm_compat_call", None)
            if previous is not None:
                previous.release()  # a call that never collected (it failed): its slab goes back
            ext._vllm_compat_call = None
            capture.SLABS.call_ended()  # whatever call came before is over
            return result

        def collect(wrapped: Any, ext: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            call = getattr(ext, "_vllm_compat_call", None)
            if call is None or not call.stored:
                return wrapped(*args, **kwargs)  # nothing captured here (another tensor-parallel rank)
            ext._vllm_compat_call = None
            wrapped(*args, **kwargs)  # lets speculators clear its own (empty) buffers
            return capture.hand_over(call)

        self.wrap(cls, "_setup_hidden_states_capture", setup)
        self.set_attr(cls, "_vllm_compat_begin_call", begin_call)
        self.wrap(cls, "_store_captured_states", store)
        self.wrap(cls, "_reset_capture", reset)
        self.wrap(cls, "_get_captured_states", collect)


def _prepare_slabs(ext: Any, layer_ids: Any) -> None:
    """Have a slab for the first call made in the background while vLLM finishes starting (capturing rank only):
    sized for a call of the scheduler's most sequences at the model's context length, the largest call a wave has."""
    try:
        from vllm.distributed import get_tp_group

        if get_tp_group().rank_in_group != 0:
            return
        import torch

        runner = ext.model_runner
        config = getattr(ext, "vllm_config", None) or runner.vllm_config
        model = config.model_config
        itemsize = torch.empty(0, dtype=model.dtype).element_size()
        rows = config.scheduler_config.max_num_seqs * model.max_model_len
        size = len(set(layer_ids)) * capture.transport.aligned(rows * model.get_hidden_size() * itemsize)
        device = getattr(runner, "device", None)
        index = device.index if getattr(device, "type", None) == "cuda" else None
        if index is None and getattr(device, "type", None) == "cuda":
            index = torch.cuda.current_device()
    except Exception as exc:  # no estimate: the first call makes its slab when it needs one
        logger.debug("per-request-capture: no slab made ahead (%r)", exc)
        return
    capture.SLABS.prepare(size, index)
