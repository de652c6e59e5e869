"""Adapters for the Scheduler speculators builds and drives by hand."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import GENERATOR_MODULE, accepts, after_construct, rewrite_kwargs, wrap_instance_method

from vllm_compat.adapter import Adapter


class SchedulerBlockSize(Adapter):
    """Scheduler's ``block_size`` parameter.

    What broke: vLLM 0.11.1 made ``Scheduler(..., block_size)`` required (EngineCore passes the cache block
    size); speculators 0.3.0 does not pass it, and 0.4.0.1 passes it, which 0.11.0 rejects.
    Where fixed: speculators' call. The value is the VllmConfig's own ``cache_config.block_size`` (what
    EngineCore passes for decode-context-parallel size 1), not a constant.
    """

    id = "scheduler-block-size"
    covers = {"scheduler.scheduler_kwargs": {"requires=block_size", "rejects=block_size"}}
    target = GENERATOR_MODULE
    first_vllm = "0.11.1"

    def apply(self, module: ModuleType) -> None:
        def fix(cls: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            if accepts(cls, "block_size"):
                kwargs.setdefault("block_size", kwargs["vllm_config"].cache_config.block_size)
            else:
                kwargs.pop("block_size", None)
            return kwargs

        self.wrap(module, "Scheduler", rewrite_kwargs(fix))


class DeferAbortUntilPrefilled(Adapter):
    """Do not abort a request whose prompt is only partly prefilled (speculators 0.3.0).

    What broke: vLLM's V1 scheduler splits a prompt across steps when it does not fit the step's token budget
    (chunked prefill, on by default). speculators 0.3.0 aborts every scheduled request right after its first
    step, so the rest of a split prompt is never computed and its hidden states are missing or misaligned
    (speculators issue #279).
    Where fixed: the abort call on speculators' own Scheduler object: an abort of a request with prompt tokens
    still to compute is deferred until the step that completes its prompt, when 0.3.0 aborts it again.
    """

    id = "defer-abort-until-prefilled"
    covers = {"scheduler.chunked_prefill": {"chunked"}}
    speculators = "==0.3.*"
    target = GENERATOR_MODULE
    first_vllm = "0.11.0 (present in speculators 0.3.0's own baseline)"
    remove_when = "speculators 0.3.x is no longer served"

    def apply(self, module: ModuleType) -> None:
        aborted = module.RequestStatus.FINISHED_ABORTED

        def finish_requests(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            ids, status = [*args, None, None][:2]
            ids = kwargs.get("request_ids", ids)
            status = kwargs.get("finished_status", status)
            if status is not aborted or ids is None:
                return wrapped(*args, **kwargs)
            scheduler = wrapped.__self__
            ready = [
                rid for rid in ([ids] if isinstance(ids, str) else list(ids)) if not _prefill_pending(scheduler, rid)
            ]
            if not ready:
                return None
            return wrapped(ready, status)

        def hook(scheduler: Any) -> None:
            wrap_instance_method(scheduler, "finish_requests", finish_requests)

        self.wrap(module, "Scheduler", after_construct(hook))


def _prefill_pending(scheduler: Any, request_id: str) -> bool:
    request = scheduler.requests.get(request_id)
    return request is not None and request.num_computed_tokens < request.num_prompt_tokens
