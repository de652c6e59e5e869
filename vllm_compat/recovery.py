"""Bring a generator whose ``generate()`` call was interrupted (Ctrl-C) back in step with its engine, or say it cannot.

Why: vLLM's executor pairs each RPC it sends with the next reply on each worker's response queue. A
``KeyboardInterrupt`` raised while the generator's process waits for a reply (or any other ``BaseException`` that is
not an ``Exception``) leaves that reply, and those of the steps still in flight, on the queue; vLLM's reply future is
popped from its queue before it waits, so every later RPC reads the reply of the one before: one call late, for good
(``TypeError: object of type 'ModelRunnerOutput' has no len()``, ``Failed to capture hidden states from worker``).
The interrupted call's requests also stay in the scheduler.

How: the call's requests are aborted in the scheduler (every request it holds: one call runs at a time); the replies
the executor was waiting for are forgotten; one RPC of our own (a fresh nonce, echoed by every worker once it has run
everything sent before it, finishing a step whose ``sample_tokens()`` never came) is sent, and each worker's response
queue is read until its echo: what came before it was owed to the interrupted call and is dropped (a states handle
among it gives its slab back unmapped). The workers run RPCs in the order sent, so after the echo the queues and the
workers are in step. The scheduler must then hold no request and no KV-cache block. Where any of this cannot be done
or shown (an executor of another shape, a worker that does not answer in time, a second interrupt), the generator
is marked unusable: its next call raises one line that says so and to make a new generator.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from typing import Any

from vllm_compat import transport

__all__ = ["UNUSABLE", "echo", "recover", "unusable_message"]

logger = logging.getLogger("vllm_compat")

UNUSABLE = "_vllm_compat_unusable"  # on a generator that cannot run again: the line its next call raises
DRAIN_SECONDS = 60.0  # how long the workers may take to finish what they were sent before the echo
_POLL = 0.5  # each wait on a reply, between checks that the workers are alive


def unusable_message(why: str) -> str:
    return (
        f"VllmHiddenStatesGenerator.generate(): this generator cannot run again: {why}. "
        "Create a new VllmHiddenStatesGenerator."
    )


def echo(worker: Any, nonce: str) -> str:
    """Run in each worker, after everything sent before it: finish a step left half done (``execute_model()`` sent,
    its ``sample_tokens()`` never), then answer with the nonce."""
    runner = getattr(worker, "model_runner", None)
    if getattr(runner, "execute_model_state", None) is not None:
        with contextlib.suppress(Exception):
            worker.sample_tokens(None)
        if getattr(runner, "execute_model_state", None) is not None:
            runner.execute_model_state = None
    return nonce


def recover(generator: Any, exc: BaseException) -> None:
    """After ``exc`` interrupted a call: the generator in step again, or marked unusable (with the reason logged)."""
    state = generator.__dict__
    what = type(exc).__name__
    state[UNUSABLE] = unusable_message(f"a call was interrupted ({what}) and interrupted again while recovering")
    why = _resynchronise(generator)
    if why is None:
        del state[UNUSABLE]
        logger.warning(
            "vllm-compat: generate() was interrupted (%s); its requests were aborted and the engine's replies "
            "brought back in step: the generator can be called again",
            what,
        )
        return
    state[UNUSABLE] = unusable_message(f"a call was interrupted ({what}) and {why}")
    logger.warning("vllm-compat: %s", state[UNUSABLE])


def _resynchronise(generator: Any) -> str | None:
    """None once the scheduler is empty and every worker's replies are in step; else why not."""
    executor = generator.__dict__.get("executor")
    scheduler = generator.__dict__.get("scheduler")
    if executor is None or scheduler is None:
        return "the generator has no executor or scheduler to bring back in step"
    if getattr(executor, "is_failed", False) or getattr(executor, "shutting_down", False):
        return "vLLM's executor is shut down (a worker process died)"
    counter = generator.__dict__.get("_request_counter")
    if isinstance(counter, int):
        generator._request_counter = counter + 1  # the interrupted call's request ids are never used again
    why = _abort_all(scheduler)
    if why:
        return why
    why = _drain(executor)
    if why:
        return why
    return _scheduler_empty(scheduler)


def _abort_all(scheduler: Any) -> str | None:
    requests = getattr(scheduler, "requests", None)
    if not isinstance(requests, dict):
        return "its scheduler keeps no request table vllm-compat knows"
    left = list(requests)
    if not left:
        return None
    finish = scheduler.finish_requests
    finish = getattr(finish, "__wrapped__", finish)  # past a deferring wrapper (defer-abort-until-prefilled)
    try:
        from vllm.v1.request import RequestStatus

        finish(left, RequestStatus.FINISHED_ABORTED)
    except Exception as exc:
        return f"its requests could not be aborted ({type(exc).__name__}: {exc})"
    return None


def _response_queues(executor: Any) -> list[Any] | None:
    queues = getattr(executor, "response_mqs", None)
    if queues is None:
        workers = getattr(executor, "workers", None) or []
        queues = [getattr(w, "worker_response_mq", None) for w in workers]
    queues = list(queues or [])
    if not queues or any(q is None or not callable(getattr(q, "dequeue", None)) for q in queues):
        return None
    return queues


def _drain(executor: Any) -> str | None:
    """Forget the replies the executor waited for; send the echo; read each worker's queue up to it."""
    if getattr(executor, "io_thread_pool", None) is not None:
        return "its executor reads replies in a thread of its own (pipeline parallel), which cannot be drained safely"
    queues = _response_queues(executor)
    broadcast = getattr(executor, "rpc_broadcast_mq", None)
    if queues is None or broadcast is None:
        return "its executor's reply queues are of a shape vllm-compat does not know"
    futures = getattr(executor, "futures_queue", None)
    if futures is not None:
        futures.clear()  # their replies are read below, up to the echo
    steps = getattr(executor, "_vllm_compat_steps", None)
    if steps is not None:
        steps.forget()
    import cloudpickle

    nonce = secrets.token_hex(8)
    broadcast.enqueue((cloudpickle.dumps(echo), (nonce,), {}, None))
    deadline = time.monotonic() + DRAIN_SECONDS
    dropped = 0
    procs = [getattr(w, "proc", None) for w in getattr(executor, "workers", None) or []]
    with transport.discarding():
        for queue in queues:
            while True:
                if time.monotonic() > deadline:
                    return f"a worker did not answer within {DRAIN_SECONDS:.0f} s"
                if any(p is not None and not p.is_alive() for p in procs):
                    return "a worker process died"
                try:
                    reply = queue.dequeue(timeout=_POLL)
                except TimeoutError:
                    continue
                except Exception as exc:  # a reply that could not be read is one owed to the interrupted call
                    logger.debug("vllm-compat: a reply dropped while draining: %r", exc)
                    dropped += 1
                    continue
                if isinstance(reply, tuple) and len(reply) == 2 and reply[1] == nonce:
                    break
                dropped += 1
    logger.debug("vllm-compat: %d reply(s) owed to the interrupted call dropped", dropped)
    return None


def _scheduler_empty(scheduler: Any) -> str | None:
    left = [
        name for name in ("requests", "running", "waiting") if len(getattr(scheduler, name, None) or ()) != 0
    ]
    if left:
        return f"its scheduler still holds requests ({', '.join(left)}) after they were aborted"
    manager = getattr(scheduler, "kv_cache_manager", None)
    try:
        usage = manager.usage if manager is not None else 0.0
    except Exception:
        usage = 0.0  # no usage figure in this release: the empty request tables are the proof
    if usage:
        return f"its KV cache still has {usage:.1%} in use after every request was aborted"
    return None
