"""Which request each row of a step's captured states belongs to, whichever model runner ran the step.

speculators' patched forward captures one tensor per requested layer and step, one row per scheduled token, in the
order the model runner laid the step's requests out. That order is the runner's own (V1 moves requests between
batch rows; V2 orders a step's requests its own way), never the caller's input order. The capture code in the
worker asks :func:`rows_of_step` for that layout and routes each request's rows to its place.
"""

from __future__ import annotations

from typing import Any

from vllm_compat.errors import AdapterError

__all__ = ["StepRows", "rows_of_step"]

StepRows = list[tuple[str, int]]  # (request id, rows it has in the step), in row order


def rows_of_step(runner: Any, scheduler_output: Any) -> StepRows:
    """The step's requests in the order of the captured rows, with their row counts.

    ``runner`` is the worker's model runner and ``scheduler_output`` the step it executes. Raises AdapterError
    where the runner's batch does not hold exactly the scheduled requests: rows that cannot be attributed are never
    guessed.
    """
    scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens
    batch = getattr(runner, "input_batch", None)
    if batch is not None and hasattr(batch, "req_ids") and hasattr(batch, "num_reqs"):
        order = [rid for rid in list(batch.req_ids)[: batch.num_reqs] if rid in scheduled]
    else:
        raise AdapterError(
            f"cannot tell the row order of a step under {type(runner).__name__}: it has no V1 input_batch "
            "(req_ids, num_reqs); vllm-compat has no capture path for this model runner"
        )
    if len(order) != len(scheduled):
        raise AdapterError(
            f"the step scheduled {sorted(scheduled)} but the model runner's batch holds {order}; "
            "cannot attribute captured rows to requests"
        )
    return [(rid, scheduled[rid]) for rid in order]
