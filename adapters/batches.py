"""Adapters for the size of a ``generate()`` call."""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import GENERATOR_MODULE, wrap_instance_method
from vllm_compat.adapters.inputs import check_token_ids, vocab_size

from vllm_compat.adapter import Adapter

logger = logging.getLogger("vllm_compat")
_told: set[str] = set()  # the first split call of a process is logged at INFO, the others at DEBUG


class BatchesInWaves(Adapter):
    """Serve a ``generate()`` call of any size with speculators 0.4.0.1: more sequences than the scheduler runs at once
    are run in waves.

    What broke (a speculators defect, on every vLLM): 0.4.0.1 builds its scheduler with ``max_num_seqs = 32``
    (``MAX_NUM_SEQS``) and its loop never finishes a request before the call ends, so the first 32 requests hold every
    running slot: the scheduler never takes request 33, the loop stops when nothing is left to schedule, and the call
    raises ``RuntimeError: Request req_N_32 not found in captured states``. speculators' data-generation script has
    ``--batch-size`` (default 8); any value above 32 fails this way. 0.3.0 aborts each request after its step, which
    frees its slot, so it serves any size unchanged.
    Where fixed: ``generate`` of each generator object, set on the object when it is built, so it sits outside every
    adapter on the class's ``generate`` (those see one wave at a time, whatever order the adapters were applied in). A
    call of at most ``max_num_seqs`` sequences (the scheduler's limit, read from the generator's VllmConfig) is passed
    through untouched: same work, same cost. A larger call is checked as a whole first (so an error names the
    sequence's place in the call), then split in order into waves of at most ``max_num_seqs`` sequences, each a
    ``generate()`` call of its own, and the results are concatenated: every sequence's states, in input order. Waves
    rather than a longer loop: the loop is speculators' code, which would have to finish requests mid-call (its
    bookkeeping does not allow it), and the scheduler never runs more than ``max_num_seqs`` sequences at once anyway,
    so a wave adds only a call's fixed cost (a few calls to the workers). Each wave's states are handed over
    (``states-through-shared-memory``) before the next wave starts.
    """

    id = "batches-in-waves"
    always = "a speculators 0.4.0.1 defect: a generate() call of more than max_num_seqs (32) sequences fails"
    speculators = "==0.4.*"
    target = GENERATOR_MODULE
    remove_when = "speculators 0.4.x is no longer served"

    def apply(self, module: ModuleType) -> None:
        default_limit = getattr(module, "MAX_NUM_SEQS", None)

        def generate(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not self.applied:  # reverted since this generator was built
                return wrapped(*args, **kwargs)
            generator = instance if instance is not None else getattr(wrapped, "__self__", None)
            token_ids = kwargs.pop("token_ids", args[0] if args else None)
            rest = args[1:] if args else ()
            limit = _wave_size(generator, default_limit)
            try:
                size = len(token_ids)
            except TypeError:
                size = None
            if limit is None or size is None or size <= limit:
                return wrapped(token_ids, *rest, **kwargs)
            check_token_ids(token_ids, vocab_size(generator))  # the whole call, before any wave runs
            waves = [(start, min(start + limit, size)) for start in range(0, size, limit)]
            log = logger.debug if _told else logger.info
            _told.add("split")
            log("vllm-compat: generate() of %d sequences runs in %d waves of at most %d", size, len(waves), limit)
            results: list[Any] = []
            for number, (start, end) in enumerate(waves, 1):
                try:
                    part = wrapped(token_ids[start:end], *rest, **kwargs)
                except Exception as exc:
                    if hasattr(exc, "add_note"):
                        exc.add_note(
                            f"vllm-compat: in wave {number} of {len(waves)} (sequences {start} to {end - 1} of this "
                            f"call of {size}; waves of at most {limit}, the scheduler's max_num_seqs)"
                        )
                    raise
                if len(part) != end - start:
                    raise RuntimeError(
                        f"vllm-compat batches-in-waves: wave {number} of {len(waves)} returned {len(part)} results "
                        f"for {end - start} sequences"
                    )
                results.extend(part)
            return results

        def init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = wrapped(*args, **kwargs)
            wrap_instance_method(instance, "generate", generate)  # outermost: the other adapters see one wave
            return result

        self.wrap(module, "VllmHiddenStatesGenerator.__init__", init)


def _wave_size(generator: Any, default: Any) -> int | None:
    """The most sequences the generator's scheduler runs at once (its VllmConfig's ``max_num_seqs``)."""
    try:
        limit = generator.vllm_config.scheduler_config.max_num_seqs
    except AttributeError:
        limit = default
    return limit if isinstance(limit, int) and limit > 0 else None
