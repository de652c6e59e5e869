"""What a user sees when an adapter fails at hook time, and the generator-side checks that need no vLLM.

Hook-time failures use the throwaway target, adapter and probe of test_engine.py. The checks of ``generate()``'s
and the constructor's arguments (adapters/inputs.py) are pure functions; their tensor paths and their effect on a
real engine are tested in tests/e2e/test_bad_input.py.
"""

from __future__ import annotations

import sys
import types

import pytest
from vllm_compat.adapters import inputs

from tests.unit import test_engine as base
from vllm_compat.adapter import Adapter
from vllm_compat.errors import AdapterError

sandbox = base.sandbox


def add_adapter(apply) -> type[Adapter]:
    class Failing(Adapter):
        """Raises from apply() after patching half of what it meant to."""

        id = "test-failing"
        always = "test"
        target = base.TARGET

        def apply(self, module: types.ModuleType) -> None:
            apply(self, module)

    return Failing


def test_a_refusing_adapter_says_why_not_could_not_patch(sandbox) -> None:
    engine, _ = sandbox

    def refuse(self, module) -> None:
        self.set_attr(module, "extra", 1)
        raise AdapterError("SETTING=1 selects a mode this adapter cannot serve. Unset SETTING.")

    add_adapter(refuse)
    engine.install()
    with pytest.raises(AdapterError) as caught:
        import vc_test_target  # noqa: F401
    assert str(caught.value) == (
        f"vllm-compat adapter test-failing refused to patch {base.TARGET}: "
        "SETTING=1 selects a mode this adapter cannot serve. Unset SETTING."
    )
    assert base.TARGET not in sys.modules  # the import failed as a whole
    assert "test-failing" not in engine.applied


def test_an_adapter_that_breaks_names_the_error_and_reverts(sandbox) -> None:
    engine, _ = sandbox
    import vc_test_target

    def broken(self, module) -> None:
        self.set_attr(module, "extra", 1)
        raise KeyError("thing")

    add_adapter(broken)
    with pytest.raises(AdapterError) as caught:
        engine.install()  # the target is imported already: the hook runs now
    message = str(caught.value)
    assert message.startswith(f"vllm-compat adapter test-failing could not patch {base.TARGET}: KeyError: 'thing'.")
    assert "Run `vllm-compat probe` and report its output" in message
    assert not hasattr(vc_test_target, "extra"), "the half-applied patch was not reverted"


# -- generate()'s input, without torch -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("token_ids", "error", "text"),
    [
        ([], ValueError, "the batch is empty"),
        ((), ValueError, "the batch is empty"),
        ([[]], ValueError, "sequence 0 is empty"),
        ([[5, 6], []], ValueError, "sequence 1 is empty"),
        ([[5, 6, 512]], ValueError, "sequence 0 holds token id 512 at position 2, outside the model's vocabulary"),
        ([[5], [5, -3]], ValueError, "sequence 1 holds token id -3 at position 1"),
        ([[5, "6"]], TypeError, "sequence 0 holds '6' (str) at position 1; token ids must be ints"),
        ([[5, 6.0]], TypeError, "holds 6.0 (float) at position 1"),
        ([[5, True]], TypeError, "holds True (bool) at position 1"),
        ([5, 6, 7], TypeError, "item 0 is 5 (int), not a sequence (a single sequence must be wrapped in a list"),
        ("5 6 7", TypeError, "expected list[list[int]] or a 2-D tensor; got str"),
        (None, TypeError, "got NoneType"),
        ([{"ids": [1]}], TypeError, "item 0 is {'ids': [1]} (dict), not a sequence"),
    ],
)
def test_bad_token_ids(token_ids, error, text) -> None:
    with pytest.raises(error) as caught:
        inputs.check_token_ids(token_ids, 512)
    assert str(caught.value).startswith("VllmHiddenStatesGenerator.generate(token_ids): ")
    assert text in str(caught.value)


@pytest.mark.parametrize("token_ids", [[[0]], [[5, 6, 511], (7,)], [[10**6]]])
def test_good_token_ids(token_ids) -> None:
    inputs.check_token_ids(token_ids, None if token_ids == [[10**6]] else 512)  # no vocabulary known: no range check


def test_a_long_sequence_is_left_to_speculators() -> None:
    """speculators truncates to max_model_len - 1; the check does not second-guess it."""
    inputs.check_token_ids([list(range(5, 500)) * 100], 512)


@pytest.mark.parametrize(
    ("layer_ids", "error"),
    [
        (None, None),
        ([0, 2, 3], None),
        ((0, 2), None),
        ([2, 2], None),  # repeated and unsorted ids are served as asked (states-per-requested-layer)
        ([3, 0, 3], None),
        ([], r"layer_ids=\[\]\): no layer requested; pass at least one layer index, or None for the default layers"),
        ([1.5], r"layer_ids=\[1.5\]\): item 0 is 1.5 \(float\), not a layer index; layer ids must be ints"),
        ([0, True], r"item 1 is True \(bool\), not a layer index"),
        ([[1], [1]], r"item 0 is \[1\] \(list\), not a layer index"),
        ("12", r"layer_ids must be a list of ints \(layer indices\), not str"),
        (3, r"layer_ids must be a list of ints \(layer indices\), not int"),
    ],
)
def test_layer_ids(layer_ids, error) -> None:
    """Checked before anything loads; speculators checks the range against the model itself."""
    if error is None:
        inputs.check_layer_ids(layer_ids)
    else:
        with pytest.raises(ValueError, match=error):
            inputs.check_layer_ids(layer_ids)


class StandInGenerator:
    """speculators' generator as far as the input checks see it: its constructor takes the layer ids and its
    generate() hands each sequence to vLLM's Request, which needs a list (tuples failed with AttributeError)."""

    def __init__(self, model_path: str, layer_ids=None, max_model_len: int = 2048) -> None:
        self.layer_ids = layer_ids
        self.started = True  # stands for the model load and the workers

    def generate(self, token_ids):
        return [list(ids).copy() if isinstance(ids, list) else ids.copy() for ids in token_ids]


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch):
    from vllm_compat.adapters.inputs import ConstructorChecks, GenerateChecks

    module = types.ModuleType("stand_in_generator")
    monkeypatch.setattr(module, "VllmHiddenStatesGenerator", type("G", (StandInGenerator,), {}), raising=False)
    adapters = [GenerateChecks(), ConstructorChecks()]
    for adapter in adapters:
        adapter.apply(module)
    yield module.VllmHiddenStatesGenerator
    for adapter in adapters:
        adapter.revert()


@pytest.mark.parametrize("layer_ids", [[], [1.5]])
def test_bad_layer_ids_stop_the_stand_in_before_it_starts(stand_in, layer_ids) -> None:
    with pytest.raises(ValueError, match="layer_ids="):
        stand_in("/", layer_ids=layer_ids)
    with pytest.raises(ValueError, match="layer_ids="):
        stand_in("/", layer_ids)  # positional, as speculators' signature allows


class ShallowGenerator(StandInGenerator):
    """speculators' constructor on a 2-layer model: its default layers, then its own range check."""

    def __init__(self, model_path: str, layer_ids=None, max_model_len: int = 2048) -> None:
        num_layers = 2
        self.layer_ids = [2, num_layers // 2, num_layers - 3, num_layers - 1] if layer_ids is None else layer_ids
        for layer_id in self.layer_ids:
            if layer_id < 0 or layer_id >= num_layers:
                raise ValueError(f"Layer index {layer_id} out of bounds [0, {num_layers - 1}]")
        self.started = True


def test_a_default_that_does_not_fit_the_model_says_so() -> None:
    """speculators' default [2, n // 2, n - 3, n - 1] on a 2-layer model: the error names the default, not layer 2."""
    from vllm_compat.adapters.inputs import ConstructorChecks

    module = types.ModuleType("stand_in_generator")
    module.VllmHiddenStatesGenerator = type("G", (ShallowGenerator,), {})
    adapter = ConstructorChecks()
    adapter.apply(module)
    try:
        with pytest.raises(ValueError) as caught:
            module.VllmHiddenStatesGenerator("/")
        assert str(caught.value) == (
            "VllmHiddenStatesGenerator(layer_ids=None): speculators' default layers [2, n // 2, n - 3, n - 1] are "
            "[2, 1, -1, 1] for this 2-layer model, and need a model of at least 3 layers (Layer index 2 out of "
            "bounds [0, 1]). Pass layer_ids, e.g. layer_ids=[0, 1]."
        )
        with pytest.raises(ValueError, match=r"^Layer index 5 out of bounds \[0, 1\]$"):  # asked for: speculators' own
            module.VllmHiddenStatesGenerator("/", layer_ids=[5])
        assert module.VllmHiddenStatesGenerator("/", layer_ids=[1, 0, 1]).layer_ids == [1, 0, 1]
    finally:
        adapter.revert()


def test_the_cpu_thread_binding_assertion_names_the_variable(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.20.0 on asserts in the generator's process when its CPU ranks outnumber the NUMA nodes allowed: the
    error the caller gets names VLLM_CPU_OMP_THREADS_BIND first, and vLLM's frame, with vLLM's assertion chained."""
    from vllm_compat.adapters.inputs import ConstructorChecks

    source = tmp_path / "site" / "vllm" / "utils" / "ompmultiprocessing.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "def _get_autobind_cpu_ids(local_world_size, allowed_numa_nodes):\n"
        "    assert len(allowed_numa_nodes) >= local_world_size, (\n"
        '        f"Not enough allowed NUMA nodes to bind threads of {local_world_size} local CPUWorkers. "\n'
        '        f"Allowed NUMA nodes are {allowed_numa_nodes}. Please try to bind threads manually."\n'
        "    )\n"
    )
    namespace: dict = {}
    exec(compile(source.read_text(), str(source), "exec"), namespace)  # a frame whose file is vLLM's module

    class TwoRanksOnOneNode(StandInGenerator):
        def __init__(self, model_path: str, layer_ids=None) -> None:
            namespace["_get_autobind_cpu_ids"](2, [0])

    module = types.ModuleType("stand_in_generator")
    module.VllmHiddenStatesGenerator = TwoRanksOnOneNode
    adapter = ConstructorChecks()
    adapter.apply(module)
    try:
        with pytest.raises(RuntimeError) as caught:
            module.VllmHiddenStatesGenerator("/")
    finally:
        adapter.revert()
    message = str(caught.value)
    assert message.startswith("Set VLLM_CPU_OMP_THREADS_BIND:")
    assert "vllm/utils/ompmultiprocessing.py:2 (_get_autobind_cpu_ids)" in message
    assert "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers" in message
    assert isinstance(caught.value.__cause__, AssertionError)
    with pytest.raises(AssertionError):  # without vllm-compat: vLLM's own assertion, nothing else
        TwoRanksOnOneNode("/")


def test_tuples_are_taken_as_lists_are(stand_in) -> None:
    generator = stand_in("/", layer_ids=(0, 2))
    assert generator.layer_ids == [0, 2]
    assert stand_in("/", (1, 3)).layer_ids == [1, 3]
    assert generator.generate(((5, 6), (7,))) == [[5, 6], [7]]
    assert generator.generate(token_ids=[[5, 6], (7,)]) == [[5, 6], [7]]
    batch = [[5, 6], [7]]
    assert generator.generate(batch) == batch
    assert inputs.tuples_as_lists(batch) is batch  # lists are passed on as they are, not copied


def test_model_path(tmp_path) -> None:
    inputs.check_model_path(str(tmp_path))
    inputs.check_model_path("meta-llama/Llama-3.1-8B")  # a hub id: left to transformers
    with pytest.raises(FileNotFoundError, match=r"model_path='/no/such/model'\): no such file or folder"):
        inputs.check_model_path("/no/such/model")
    with pytest.raises(FileNotFoundError):
        inputs.check_model_path("./no-such-model-here")


class _Executor:
    def __init__(self) -> None:
        self.shut = 0
        self.is_failed = False

    def shutdown(self) -> None:
        self.shut += 1


def test_executor_gone_and_shutdown_after_a_failed_constructor() -> None:
    generator = types.SimpleNamespace(executor=_Executor())
    assert not inputs.executor_gone(generator)
    generator.executor.is_failed = True
    assert inputs.executor_gone(generator)
    inputs.shut_down_executor(generator)
    assert generator.executor.shut == 1
    inputs.shut_down_executor(types.SimpleNamespace())  # no executor yet: nothing to do
