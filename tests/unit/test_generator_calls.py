"""batches-in-waves and cpu-tensor-parallel-zero on a stand-in generator (their effect on a real engine, both
speculators lines: tests/e2e/test_extraction.py::test_any_batch_size, tests/e2e/test_training.py)."""

from __future__ import annotations

import logging
import types

import pytest
from vllm_compat.adapters import parallel
from vllm_compat.adapters.batches import BatchesInWaves
from vllm_compat.adapters.parallel import TensorParallelZeroOnCpu
from vllm_compat.adapters.results import ResultsInInputOrder

LIMIT = 4


def generator_module() -> types.ModuleType:
    """A generator shaped like 0.4.0.1's where it matters: ``max_num_seqs`` running slots that a call never frees,
    results in ``sorted(request id)`` order, and a call counter in the ids."""
    module = types.ModuleType("stand_in_generator")
    module.MAX_NUM_SEQS = LIMIT

    class VllmHiddenStatesGenerator:
        def __init__(self, model_path: str = "m", layer_ids=None, max_model_len: int = 2048,
                     gpu_memory_utilization: float = 0.8, tensor_parallel_size: int = 1) -> None:  # fmt: skip
            if tensor_parallel_size < 1:
                raise ValueError("tensor_parallel_size: Input should be greater than or equal to 1")
            self.tensor_parallel_size = tensor_parallel_size
            scheduler = types.SimpleNamespace(max_num_seqs=LIMIT)
            model = types.SimpleNamespace(get_vocab_size=lambda: 100)
            self.vllm_config = types.SimpleNamespace(scheduler_config=scheduler, model_config=model)
            self._request_counter = 0
            self.calls: list[int] = []

        def generate(self, token_ids):
            ids = {f"req_{self._request_counter}_{i}": i for i in range(len(token_ids))}
            self._request_counter += 1
            self.calls.append(len(token_ids))
            if len(token_ids) > LIMIT:
                raise RuntimeError(f"Request req_{self._request_counter - 1}_{LIMIT} not found in captured states")
            return [{"input_ids": list(token_ids[ids[rid]])} for rid in sorted(ids)]

    module.VllmHiddenStatesGenerator = VllmHiddenStatesGenerator
    return module


@pytest.fixture()
def module():
    module = generator_module()
    adapters = [ResultsInInputOrder(), BatchesInWaves()]  # the engine's order: batches-in-waves is applied first
    for adapter in reversed(adapters):
        adapter.apply(module)
    yield module
    for adapter in adapters:
        adapter.revert()


@pytest.mark.parametrize("size", [1, LIMIT, LIMIT + 1, 2 * LIMIT + 3, 12])
def test_every_sequence_comes_back_in_input_order(module, size: int) -> None:
    generator = module.VllmHiddenStatesGenerator()
    calls = [[[i, j] for i in range(size)] for j in range(2)]  # two calls: ids carry the call counter
    for call in calls:
        assert [r["input_ids"] for r in generator.generate(call)] == call
    waves = [LIMIT] * (size // LIMIT) + ([size % LIMIT] if size % LIMIT else [])
    assert generator.calls == waves * 2, "a call of at most max_num_seqs is one call; a larger one, full waves"


def test_without_the_adapter_a_large_call_fails() -> None:
    module = generator_module()
    with pytest.raises(RuntimeError, match="not found in captured states"):
        module.VllmHiddenStatesGenerator().generate([[1]] * (LIMIT + 1))


def test_a_bad_sequence_is_named_by_its_place_in_the_whole_call(module) -> None:
    generator = module.VllmHiddenStatesGenerator()
    batch = [[1, 2]] * (2 * LIMIT) + [[1, 200]]
    with pytest.raises(ValueError, match=f"sequence {2 * LIMIT} holds token id 200"):
        generator.generate(batch)
    assert generator.calls == [], "nothing ran"


def test_a_failing_wave_says_which() -> None:
    module = generator_module()
    cls = module.VllmHiddenStatesGenerator
    original = cls.generate

    def generate(self, token_ids):
        if self._request_counter == 1:
            raise RuntimeError("worker died")
        return original(self, token_ids)

    cls.generate = generate
    adapter = BatchesInWaves()
    adapter.apply(module)
    try:
        with pytest.raises(RuntimeError, match="worker died") as caught:
            cls().generate([[1]] * (LIMIT + 2))
        assert any("wave 2 of 2 (sequences 4 to 5 of this call of 6" in note for note in caught.value.__notes__)
    finally:
        adapter.revert()


def test_reverted_generators_pass_calls_through() -> None:
    module = generator_module()
    adapter = BatchesInWaves()
    adapter.apply(module)
    generator = module.VllmHiddenStatesGenerator()
    adapter.revert()
    with pytest.raises(RuntimeError, match="not found in captured states"):
        generator.generate([[1]] * (LIMIT + 1))
    assert "generate" not in vars(module.VllmHiddenStatesGenerator()), "new generators are not wrapped"


# -- tensor_parallel_size=0 on vLLM's CPU platform ----------------------------------------------------------------
@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_zero_workers_means_one_on_cpu(how: str, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    module = generator_module()
    monkeypatch.setattr(parallel, "on_cpu", lambda: True)
    adapter = TensorParallelZeroOnCpu()
    adapter.apply(module)
    try:
        with caplog.at_level(logging.INFO, logger="vllm_compat"):
            if how == "keyword":
                generator = module.VllmHiddenStatesGenerator(model_path="m", tensor_parallel_size=0)
            else:
                generator = module.VllmHiddenStatesGenerator("m", None, 2048, 0.8, 0)
        assert generator.tensor_parallel_size == 1
        told = [r for r in caplog.records if "tensor_parallel_size=0" in r.getMessage()]
        assert len(told) == 1 and told[0].levelno == logging.INFO
        assert module.VllmHiddenStatesGenerator(tensor_parallel_size=2).tensor_parallel_size == 2
    finally:
        adapter.revert()
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        module.VllmHiddenStatesGenerator(tensor_parallel_size=0)


def test_zero_workers_is_left_to_vllm_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU host that sees no device, 0 is an error vLLM should report."""
    module = generator_module()
    monkeypatch.setattr(parallel, "on_cpu", lambda: False)
    adapter = TensorParallelZeroOnCpu()
    adapter.apply(module)
    try:
        with pytest.raises(ValueError, match="greater than or equal to 1"):
            module.VllmHiddenStatesGenerator(tensor_parallel_size=0)
    finally:
        adapter.revert()
