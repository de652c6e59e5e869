"""Adapters for what the generator returns to its caller."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import GENERATOR_MODULE

from vllm_compat.adapter import Adapter


class ResultsInInputOrder(Adapter):
    """Return speculators 0.4.0.1's results in input order.

    What broke (a speculators defect, on every vLLM): ``generate()`` builds its results in
    ``sorted(request_ids)`` order, and the ids are ``req_{call}_{i}``: from 11 sequences on, the order is
    lexicographic (0, 1, 10, 11, 2, ...), so result ``k`` is not input ``k``. Each result is self-consistent,
    but a caller that pairs results with its inputs by position (loss masks, metadata) pairs the wrong ones.
    Where fixed: around ``generate()``: the permutation that sorting applied is known from the call counter and
    the batch size, and is undone.
    """

    id = "results-in-input-order"
    always = "a speculators 0.4.0.1 defect: results sorted by request-id string"
    speculators = "==0.4.*"
    target = GENERATOR_MODULE
    remove_when = "speculators 0.4.x is no longer served"

    def apply(self, module: ModuleType) -> None:
        def generate(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            call = instance._request_counter
            results = wrapped(*args, **kwargs)
            ids = [f"req_{call}_{i}" for i in range(len(results))]
            produced_order = sorted(range(len(results)), key=lambda i: ids[i])
            ordered: list[Any] = [None] * len(results)
            for position, index in enumerate(produced_order):
                ordered[index] = results[position]
            return ordered

        self.wrap(module, "VllmHiddenStatesGenerator.generate", generate)
