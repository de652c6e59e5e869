"""Adapters for what the generator returns to its caller."""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import GENERATOR_MODULE

from vllm_compat.adapter import Adapter

logger = logging.getLogger("vllm_compat")


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


LAYER_REQUEST = "_vllm_compat_layer_ids"  # on the generator: the ids its workers were set up with, as requested


class StatesPerRequestedLayer(Adapter):
    """Return one state per requested layer id, in the order requested (a repeated id included), on both lines.

    What broke (a speculators defect, on every vLLM): the workers capture ``frozenset(layer_ids)`` while they walk
    the model's layers, so each call returns each distinct layer once, in ascending layer order, whatever order
    ``layer_ids`` asked for. The generator keeps ``layer_ids`` as given, and speculators' data-generation script
    writes ``generator.layer_ids`` to ``data_config.json`` as the labels of the saved states. So unsorted ids
    (``[3, 1, 2]``) were saved in ascending order under the given labels, and repeated ids came back short: the
    scripts' default ``[2, n // 2, n - 3, n - 1]`` repeats a layer on models of 6 layers or fewer (``[2, 2, 1, 3]``
    on 4 layers), so each sample held 3 states under 4 labels and a state sat under another layer's label. A
    training run on such data learns from the wrong layers, with no error anywhere.
    Where fixed: around ``generate()``. The ids the workers were set up with are recorded when the generator's
    ``_setup_capture`` sends them; each result's ``hidden_states`` then holds, for each requested id in the
    requested order, the state of that layer, and a repeated id gets its own copy (``.clone()``), so no two
    entries share storage. Sorted distinct ids, the usual request, are returned untouched (no work). A call whose
    states are not one per distinct layer raises rather than guess which is which.
    Why a repeated id keeps its place (rather than the ids being made distinct): the labels in ``data_config.json``
    are ``generator.layer_ids``, and speculators' EAGLE-3 training reads a sample as ``len(layer_ids) - 1`` auxiliary
    states and the verifier's last state; one state per label keeps labels and states one for one and the number of
    states the draft model is built for, whatever layers speculators' default picked.
    """

    id = "states-per-requested-layer"
    always = "a speculators defect: each distinct layer is captured once, in layer order, whatever layer_ids asks"
    target = GENERATOR_MODULE
    remove_when = "speculators returns one state per requested layer id, in order (or >= 0.5)"

    def apply(self, module: ModuleType) -> None:
        def setup(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            requested = getattr(instance, "layer_ids", None)
            result = wrapped(*args, **kwargs)
            if isinstance(requested, list | tuple):
                instance.__dict__[LAYER_REQUEST] = list(requested)  # what the workers were told, whatever comes later
                if list(requested) != sorted(set(requested)):
                    repeated = len(set(requested)) < len(requested)
                    logger.info(
                        "vllm-compat: layer_ids %s %s: each sample holds one state per id, in this order%s",
                        list(requested),
                        "repeat a layer" if repeated else "are not in ascending order",
                        " (a repeated layer's state is a copy)" if repeated else "",
                    )
            return result

        def generate(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            results = wrapped(*args, **kwargs)
            requested = getattr(instance, "__dict__", {}).get(LAYER_REQUEST)
            if requested is None or requested == sorted(set(requested)):
                return results
            return [states_as_requested(result, requested) for result in results]

        self.wrap(module, "VllmHiddenStatesGenerator._setup_capture", setup)
        self.wrap(module, "VllmHiddenStatesGenerator.generate", generate)


def states_as_requested(result: Any, requested: list[int]) -> Any:
    """``result`` (one sequence's dict) with ``hidden_states`` as one tensor per id of ``requested``, in its order.

    The workers return the distinct requested layers in ascending order; a repeated id's later entries are copies.
    """
    captured = sorted(set(requested))
    states = result.get("hidden_states") if isinstance(result, dict) else None
    if not isinstance(states, list | tuple) or len(states) != len(captured):
        got = len(states) if isinstance(states, list | tuple) else type(states).__name__
        raise RuntimeError(
            f"vllm-compat states-per-requested-layer: layer_ids={requested} should have come back as "
            f"{len(captured)} states (layers {captured}, one per distinct layer, in layer order); got {got}. "
            "Run `vllm-compat probe` and report its output with this message."
        )
    index = {layer: i for i, layer in enumerate(captured)}
    placed: set[int] = set()
    ordered = []
    for layer in requested:
        state = states[index[layer]]
        ordered.append(state.clone() if layer in placed else state)
        placed.add(layer)
    return {**result, "hidden_states": ordered}
