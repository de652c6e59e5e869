"""states-per-requested-layer on a stand-in generator whose workers capture as speculators' do: each distinct
requested layer once, in layer order (the real engine on both lines: tests/e2e/test_layer_ids.py)."""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import pytest
from vllm_compat.adapters.batches import BatchesInWaves
from vllm_compat.adapters.results import ResultsInInputOrder, StatesPerRequestedLayer


@dataclass(eq=False)
class State:
    """A captured state that names its layer and sequence; ``clone()`` is a new object with its own rows."""

    layer: int
    rows: list[int] = field(default_factory=list)

    def clone(self) -> State:
        return State(self.layer, list(self.rows))

    def same(self, other: State) -> bool:
        return (self.layer, self.rows) == (other.layer, other.rows)


def layer_state(layer: int, ids: list[int]) -> State:
    return State(layer, list(ids))


def generator_module(limit: int = 4) -> types.ModuleType:
    module = types.ModuleType("stand_in_generator")
    module.MAX_NUM_SEQS = limit

    class VllmHiddenStatesGenerator:
        def __init__(self, model_path: str = "m", layer_ids=None) -> None:
            self.layer_ids = [2, 2, 1, 3] if layer_ids is None else layer_ids  # speculators' default on 4 layers
            scheduler = types.SimpleNamespace(max_num_seqs=limit)
            model = types.SimpleNamespace(get_vocab_size=lambda: 100)
            self.vllm_config = types.SimpleNamespace(scheduler_config=scheduler, model_config=model)
            self._request_counter = 0
            self._setup_capture()

        def _setup_capture(self) -> None:
            self.captured_layers = sorted(frozenset(self.layer_ids))  # the workers' _patched_forward

        def generate(self, token_ids):
            ids = {f"req_{self._request_counter}_{i}": i for i in range(len(token_ids))}
            self._request_counter += 1
            self.produced = [
                {
                    "input_ids": list(token_ids[ids[rid]]),
                    "hidden_states": [layer_state(layer, token_ids[ids[rid]]) for layer in self.captured_layers],
                    "loss_mask": None,
                }
                for rid in sorted(ids)
            ]
            return list(self.produced)

    module.VllmHiddenStatesGenerator = VllmHiddenStatesGenerator
    return module


@pytest.fixture()
def module():
    module = generator_module()
    adapters = [StatesPerRequestedLayer(), ResultsInInputOrder(), BatchesInWaves()]
    for adapter in reversed(adapters):
        adapter.apply(module)
    yield module
    for adapter in adapters:
        adapter.revert()


CALL = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14], [15], [16, 17]] * 2  # 12 sequences: waves, id ordering


@pytest.mark.parametrize("layer_ids", [None, [3, 1, 2], [2, 2, 1, 3], [0, 3, 0, 3], [1], [0, 1, 2, 3]])
def test_one_state_per_requested_id_in_the_requested_order(module, layer_ids) -> None:
    generator = module.VllmHiddenStatesGenerator(layer_ids=layer_ids)
    asked = generator.layer_ids
    results = generator.generate(CALL)
    assert [r["input_ids"] for r in results] == CALL
    for ids, result in zip(CALL, results, strict=True):
        states = result["hidden_states"]
        assert len(states) == len(asked)
        for layer, state in zip(asked, states, strict=True):
            assert state.same(layer_state(layer, ids)), (layer, state)
        assert len({id(s) for s in states}) == len(states), "two entries are one object"


def test_sorted_distinct_ids_come_back_untouched(module) -> None:
    generator = module.VllmHiddenStatesGenerator(layer_ids=[0, 2, 3])
    results = generator.generate([[5, 6]])
    assert results[0] is generator.produced[0]
    assert [s.layer for s in results[0]["hidden_states"]] == [0, 2, 3]


def test_a_repeated_state_is_a_copy(module) -> None:
    generator = module.VllmHiddenStatesGenerator()  # [2, 2, 1, 3]
    first, second, *_ = generator.generate([[5, 6]])[0]["hidden_states"]
    first.rows.append(100)
    assert second.rows == [5, 6] and first is not second


def test_the_ids_the_workers_were_given_decide(module) -> None:
    """A caller who changes layer_ids after construction does not change what the workers capture."""
    generator = module.VllmHiddenStatesGenerator(layer_ids=[3, 1])
    generator.layer_ids = [1, 3]
    states = generator.generate([[5]])[0]["hidden_states"]
    assert [s.layer for s in states] == [3, 1]


def test_a_reply_of_the_wrong_length_raises(module) -> None:
    generator = module.VllmHiddenStatesGenerator(layer_ids=[3, 1])
    generator.captured_layers = [1]  # one state for two distinct layers
    with pytest.raises(RuntimeError, match=r"layer_ids=\[3, 1\] should have come back as 2 states"):
        generator.generate([[5]])
