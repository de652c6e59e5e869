"""Adapters for the Scheduler speculators builds and drives by hand."""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import GENERATOR_MODULE, accepts, after_construct, rewrite_kwargs, wrap_instance_method

from vllm_compat.adapter import Adapter
from vllm_compat.errors import AdapterError

logger = logging.getLogger("vllm_compat")


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


class FinishedIdsToNextStep(Adapter):
    """Keep the ids of the requests speculators 0.3.0 finished after a call's last step for the workers' next step.

    What broke (a speculators 0.3.0 defect, on every vLLM; fatal on Model Runner V2): vLLM's scheduler hands the ids
    of the requests finished since the previous step to the workers once, in the next ``schedule()`` output's
    ``finished_req_ids``, and forgets them there (``Scheduler._update_after_schedule``). 0.3.0 aborts every request
    right after its step, and its loop ends on the ``schedule()`` output with nothing to run, which it never sends:
    the ids of the requests of each call's last step never reach the workers. Model Runner V2 gives each request one
    of ``max_num_seqs`` (32) slots and frees it only when a step it runs lists the request as finished
    (``model_runner.v2_request_slots``), so the slots of those requests are held for good and a later step dies in
    ``RequestState.add_request`` with ``AssertionError: No free indices`` (on an H200 with vLLM 0.34.0, in tests/gpu;
    the steps vLLM's scheduler makes for its calls, replayed through 0.34.0's slot code: calls of 5, 3 and 12 sequences
    leave 20 of the 32 slots held, and the fourth call's second step finds none free). Model Runner V1 keeps each such
    request's cached state (its prompt and block ids) in ``model_runner.requests`` for as long as the worker lives.
    0.4.0.1 aborts its requests after its loop and before the next ``schedule()``, so its ids reach the workers with
    the next call's first step, before that step adds its requests.
    Where fixed: speculators' own Scheduler object: when ``schedule()`` returns an output with no token to run (the
    one 0.3.0 drops), the finished and preempted ids it carries are kept and added to the next output (the next
    call's first step), which the workers run: V2 frees those slots before that step's new requests take theirs, as
    with vLLM's own engine, which never drops a step. No RPC is added. An output whose ``finished_req_ids`` is not a
    set is refused (``AdapterError``). An id sent twice (a caller that does run the empty output) is harmless: both
    runners ignore the id of a request they do not hold.
    """

    id = "finished-ids-to-next-step"
    always = (
        "a speculators 0.3.0 defect: the ids of the requests it finishes after a call's last step never reach the "
        "workers (Model Runner V2 holds their request slots until they do)"
    )
    speculators = "==0.3.*"
    target = GENERATOR_MODULE
    first_vllm = "0.11.0 (cached request states kept); 0.34.0 on a GPU (Model Runner V2 only: No free indices)"
    remove_when = "speculators 0.3.x is no longer served"

    def apply(self, module: ModuleType) -> None:
        def hook(scheduler: Any) -> None:
            dropped = _DroppedIds()

            def schedule(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                output = wrapped(*args, **kwargs)
                if not self.applied:
                    return output
                dropped.hand_to(output)
                if not output.total_num_scheduled_tokens:
                    dropped.keep(output)
                return output

            wrap_instance_method(scheduler, "schedule", schedule)

        self.wrap(module, "Scheduler", after_construct(hook))


class _DroppedIds:
    """The ids that outputs with nothing to run carried (speculators 0.3.0 never sends those), until the next output."""

    FIELDS = ("finished_req_ids", "preempted_req_ids")

    def __init__(self) -> None:
        self.ids: dict[str, set[str]] = {field: set() for field in self.FIELDS}

    def keep(self, output: Any) -> None:
        for field in self.FIELDS:
            ids = getattr(output, field, None)
            if ids is None and field == "preempted_req_ids":
                continue  # releases that send None for "no preempted requests"
            if not isinstance(ids, set | frozenset):
                raise AdapterError(
                    f"finished-ids-to-next-step: SchedulerOutput.{field} is {type(ids).__name__}, not a set of "
                    "request ids: cannot keep them for the workers' next step"
                )
            self.ids[field].update(ids)
        if any(self.ids.values()):
            logger.debug(
                "vllm-compat: finished-ids-to-next-step: %d finished, %d preempted request ids kept for the next step",
                len(self.ids["finished_req_ids"]),
                len(self.ids["preempted_req_ids"]),
            )

    def hand_to(self, output: Any) -> None:
        for field, ids in self.ids.items():
            if ids:
                setattr(output, field, set(getattr(output, field, None) or ()) | ids)
                self.ids[field] = set()
