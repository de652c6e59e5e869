"""Which request each row of a step's captured states belongs to, whichever model runner ran the step.

speculators' patched forward captures one tensor per requested layer and step, one row per scheduled token, in the
order the model runner laid the step's requests out. That order is the runner's own, never the caller's input order:

- Model Runner V1 keeps a persistent ``input_batch`` whose rows requests keep from step to step (moved between rows
  by ``condense``/``swap_states``): a step's rows follow ``input_batch.req_ids[:num_reqs]``.
- Model Runner V2 builds a fresh ``InputBatch`` for every step in ``prepare_inputs`` and sorts the step's requests
  (fewest scheduled tokens first, decodes first), a local of ``execute_model`` that nothing else holds during the
  forward. :func:`record_v2_steps` records each step's layout as ``prepare_inputs`` returns it (``req_ids`` and
  the row offsets ``query_start_loc_np``), before the forward runs.

The capture code in the worker asks :func:`rows_of_step` for that layout and routes each request's rows to its place.
Which branch answers is decided by what the runner has (``input_batch``, or ``req_states`` and ``prepare_inputs``),
not by its class name. The facts each branch relies on are probed in probes/model_runner.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_compat.errors import AdapterError

__all__ = [
    "STEP_ATTRIBUTE",
    "WARMING_UP_ATTRIBUTE",
    "StepRows",
    "is_v2_runner",
    "prompt_lengths",
    "record_v2_steps",
    "rows_of_step",
]

StepRows = list[tuple[str, int]]  # (request id, rows it has in the step), in row order
STEP_ATTRIBUTE = "_vllm_compat_v2_step"  # on a V2 runner: the layout of the step it prepared last
WARMING_UP_ATTRIBUTE = "_vllm_compat_warming_up"  # on a V2 runner: True while its worker warms the model up


@dataclass(frozen=True)
class _V2Step:
    scheduler_output: Any  # held, so identity tells this step from any other
    rows: StepRows
    problem: str = ""  # why the layout cannot be trusted (raised when the rows are asked for)
    warm_up: bool = False  # prepared while the worker warmed the model up: no call's step


def is_v2_runner(runner: Any) -> bool:
    """Model Runner V2, told by what it has: per-step batches (``prepare_inputs``), requests in ``req_states``, and no
    persistent ``input_batch``."""
    return (
        not hasattr(runner, "input_batch")
        and hasattr(runner, "req_states")
        and callable(getattr(runner, "prepare_inputs", None))
    )


def record_v2_steps() -> Callable[..., Any]:
    """A wrapt wrapper for a V2 runner's ``prepare_inputs``: keeps the layout of the batch it returns on the runner."""

    def record(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        batch = wrapped(*args, **kwargs)
        runner = instance if instance is not None else getattr(wrapped, "__self__", None)
        scheduler_output = kwargs.get("scheduler_output", args[0] if args else None)
        if runner is not None:
            step = _v2_layout(scheduler_output, batch)
            if getattr(runner, WARMING_UP_ATTRIBUTE, False):
                step = _V2Step(step.scheduler_output, step.rows, step.problem, warm_up=True)
            setattr(runner, STEP_ATTRIBUTE, step)
        return batch

    return record


def _v2_layout(scheduler_output: Any, batch: Any) -> _V2Step:
    """The rows of each request of a V2 batch: ``req_ids`` in row order, counts from ``query_start_loc_np`` (the
    layout the forward gets; ``num_scheduled_tokens`` can be an upper bound under adaptive draft verification)."""
    try:
        count = int(batch.num_reqs)
        ids = list(batch.req_ids)[:count]
        starts = [int(n) for n in list(batch.query_start_loc_np)[: count + 1]]
    except (AttributeError, TypeError, ValueError) as exc:
        return _V2Step(scheduler_output, [], f"Model Runner V2's InputBatch has changed shape ({exc})")
    if len(ids) != count or len(starts) != count + 1 or starts[0] != 0 or starts != sorted(starts):
        return _V2Step(
            scheduler_output,
            [],
            f"Model Runner V2's batch does not lay its requests out one after another (req_ids {ids}, "
            f"query_start_loc {starts})",
        )
    return _V2Step(scheduler_output, [(ids[i], starts[i + 1] - starts[i]) for i in range(count)])


def rows_of_step(runner: Any, scheduler_output: Any) -> StepRows | None:
    """The step's requests in the order of the captured rows, with their row counts.

    ``runner`` is the worker's model runner and ``scheduler_output`` the step it executes. Returns None for a
    forward that is no step of a call, which Model Runner V2 runs through ``execute_model`` too: its dummy runs
    (requests the runner never holds) and the steps of made-up requests with which the worker warms the model up
    (``compile_or_warm_up_model``; marked by the v2-batch-layout adapter). There is nothing to capture there.
    Raises AdapterError where the rows cannot be attributed (the runner's batch does not hold exactly the scheduled
    requests, or its layout is unknown): rows are never guessed.
    """
    scheduled: dict[str, int] = dict(scheduler_output.num_scheduled_tokens)
    if is_v2_runner(runner):
        rows = _rows_of_v2_step(runner, scheduler_output, scheduled)
        if rows is None:
            return None
        order = [rid for rid, _ in rows]
        counts = dict(rows)
    else:
        batch = getattr(runner, "input_batch", None)
        if batch is None or not hasattr(batch, "req_ids") or not hasattr(batch, "num_reqs"):
            raise AdapterError(
                f"cannot tell the row order of a step under {type(runner).__name__}: it has neither a V1 input_batch "
                "(req_ids, num_reqs) nor V2's per-step batches (req_states, prepare_inputs); vllm-compat has no "
                "capture path for this model runner"
            )
        order = [rid for rid in list(batch.req_ids)[: batch.num_reqs] if rid in scheduled]
        counts = scheduled
    if len(order) != len(scheduled) or set(order) != set(scheduled) or any(counts[r] != scheduled[r] for r in order):
        raise AdapterError(
            f"the step scheduled {sorted(scheduled.items())} but the model runner's batch holds "
            f"{[(r, counts.get(r)) for r in order]}; cannot attribute captured rows to requests"
        )
    return [(rid, scheduled[rid]) for rid in order]


def _rows_of_v2_step(runner: Any, scheduler_output: Any, scheduled: dict[str, int]) -> StepRows | None:
    for attribute, what in (("pcp_manager", "prefill context parallelism"), ("ubatch_runner", "micro-batching")):
        if getattr(runner, attribute, None) is not None:
            raise AdapterError(
                f"Model Runner V2 runs this step with {what} ({attribute}), which splits a step's rows in ways "
                "vllm-compat's capture does not follow; run without it"
            )
    step = getattr(runner, STEP_ATTRIBUTE, None)
    if isinstance(step, _V2Step) and step.scheduler_output is scheduler_output:
        if step.warm_up:
            return None
        if step.problem:
            raise AdapterError(step.problem)
        return step.rows
    states = getattr(runner, "req_states", None)
    known = getattr(states, "req_id_to_index", None)
    if getattr(runner, WARMING_UP_ATTRIBUTE, False) or (known is not None and not any(r in known for r in scheduled)):
        return None  # a dummy run (warm-up, profiling): none of its requests is the runner's
    raise AdapterError(
        "Model Runner V2 ran a step whose batch layout was not recorded (the v2-batch-layout adapter records it when "
        "speculators sets up the capture); cannot attribute captured rows to requests"
    )


def prompt_lengths(scheduler_output: Any) -> dict[str, int]:
    """The prompt length of each request the step schedules for the first time (``scheduled_new_reqs``): the same
    under both runners, unlike the runners' own request records (V1 ``requests``, V2 ``req_states``)."""
    lengths = {}
    for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        ids = getattr(new, "prompt_token_ids", None)
        if ids is not None:
            lengths[new.req_id] = len(ids)
    return lengths
