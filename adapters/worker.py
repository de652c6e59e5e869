"""Adapters applied inside vLLM's worker processes, to speculators' HiddenStatesWorkerExtension."""

from __future__ import annotations

import logging
import re
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import WORKER_MODULE
from vllm_compat.probes.model import FAMILIES

from vllm_compat.adapter import Adapter
from vllm_compat.errors import AdapterError

logger = logging.getLogger("vllm_compat")
_REQUEST_INDEX = re.compile(r"_(\d+)$")


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
    """Attribute captured rows to requests, so speculators 0.3.0 gets each sequence's own states in input order.

    What broke (speculators issue #279, on every vLLM): 0.3.0 concatenates the captured rows of every step and
    slices them by the input lengths, assuming the rows follow the input order. vLLM moves requests between batch
    rows (``InputBatch.condense``/``swap_states``) and splits prompts across steps, so the slices can belong to
    other sequences: silently wrong hidden states.
    Where fixed: the worker extension. Each step's rows are split by request using the step's scheduler output and
    ``input_batch.req_ids`` (the V1 runner's row order at forward time; see model-runner-v1), stored per request,
    and ``_get_captured_states`` returns the per-layer concatenation in input order, which is what 0.3.0's slicing
    assumes. Any inconsistency (a request missing from the batch, a short capture) raises instead of returning.
    """

    id = "per-request-capture"
    covers = {"scheduler.batch_order": {"reorders"}}
    speculators = "==0.3.*"
    target = WORKER_MODULE
    side = "worker"
    first_vllm = "0.11.0 (present in speculators 0.3.0's own baseline)"
    remove_when = "speculators 0.3.x is no longer served"

    def apply(self, module: ModuleType) -> None:
        cls = module.HiddenStatesWorkerExtension

        def setup(wrapped: Any, ext: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = wrapped(*args, **kwargs)
            ext._vllm_compat_states = {}
            ext._vllm_compat_prompt_lens = {}
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
            return result

        def store(wrapped: Any, ext: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            step = getattr(ext, "_vllm_compat_step", None)
            if step is None:
                return None  # a warm-up or profiling forward: not a scheduled step, nothing to capture
            aux = args[0] if args else kwargs["aux_hidden_states"]
            _store_step(ext, step, aux)
            return None

        def reset(wrapped: Any, ext: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = wrapped(*args, **kwargs)
            ext._vllm_compat_states = {}
            ext._vllm_compat_prompt_lens = {}
            return result

        def collect(wrapped: Any, ext: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            wrapped(*args, **kwargs)  # lets speculators clear its own buffers
            return _collect_in_input_order(ext)

        self.wrap(cls, "_setup_hidden_states_capture", setup)
        self.wrap(cls, "_store_captured_states", store)
        self.wrap(cls, "_reset_capture", reset)
        self.wrap(cls, "_get_captured_states", collect)


def _store_step(ext: Any, step: Any, aux: list[Any]) -> None:
    runner = ext.model_runner
    batch = runner.input_batch
    scheduled: dict[str, int] = step.num_scheduled_tokens
    rows = [rid for rid in list(batch.req_ids)[: batch.num_reqs] if rid in scheduled]
    if len(rows) != len(scheduled):
        raise AdapterError(
            f"per-request-capture: the step scheduled {sorted(scheduled)} but the batch holds {rows}; "
            "cannot attribute captured rows to requests"
        )
    total = sum(scheduled[rid] for rid in rows)
    if any(h.shape[0] < total for h in aux):
        raise AdapterError(f"per-request-capture: captured {aux[0].shape[0]} rows for {total} scheduled tokens")
    offset = 0
    for rid in rows:
        n = scheduled[rid]
        per_layer = ext._vllm_compat_states.setdefault(rid, [[] for _ in aux])
        for layer, h in enumerate(aux):
            per_layer[layer].append(h[offset : offset + n])
        offset += n
        if rid not in ext._vllm_compat_prompt_lens:
            state = runner.requests.get(rid)
            ext._vllm_compat_prompt_lens[rid] = len(state.prompt_token_ids) if state is not None else None


def _collect_in_input_order(ext: Any) -> list[Any] | None:
    import torch

    states: dict[str, list[list[Any]]] = ext._vllm_compat_states
    if not states:
        return None

    def index(rid: str) -> int:
        found = _REQUEST_INDEX.search(rid)
        if found is None:
            raise AdapterError(f"per-request-capture: request id {rid!r} is not speculators' req_<call>_<i>")
        return int(found.group(1))

    ordered = sorted(states, key=index)
    per_request = {rid: [torch.cat(chunks, dim=0) for chunks in states[rid]] for rid in ordered}
    for rid in ordered:
        expected = ext._vllm_compat_prompt_lens.get(rid)
        got = per_request[rid][0].shape[0]
        if expected is not None and got != expected:
            raise AdapterError(
                f"per-request-capture: request {rid} has {got} captured rows for a {expected}-token prompt "
                "(was it aborted before its prefill finished?)"
            )
    layers = len(next(iter(per_request.values())))
    result = [torch.cat([per_request[rid][layer] for rid in ordered], dim=0) for layer in range(layers)]
    ext._vllm_compat_states = {}
    ext._vllm_compat_prompt_lens = {}
    return result
