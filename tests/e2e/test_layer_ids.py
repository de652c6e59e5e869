"""Layer ids on a real engine, both speculators lines: one state per requested id, in the requested order, each equal
to transformers' state of the layer it is labelled with.

speculators' workers capture each distinct requested layer once, in layer order; the generator keeps ``layer_ids``
as given, and its data-generation script saves them as the labels of the states (``data_config.json``). Without
``states-per-requested-layer``, the scripts' default on this 4-layer model ([2, 2, 1, 3]) gave 3 states under 4
labels, and unsorted ids came back in ascending order under the given labels.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import TOLERANCE, run_extract, transformers_states

pytestmark = pytest.mark.e2e

DEFAULT_ON_4_LAYERS = [2, 2, 1, 3]  # speculators' [2, n // 2, n - 3, n - 1]


def judged_under_labels(outputs: list, calls: list, labels: list[int], model) -> dict[int, float]:
    """Per label position: the largest |vLLM - transformers| of the state under that label, over every sequence."""
    reference = transformers_states(model, calls, tuple(labels))
    worst = dict.fromkeys(range(len(labels)), 0.0)
    for call, results in zip(calls, outputs, strict=True):
        assert len(results) == len(call)
        for ids, result in zip(call, results, strict=True):
            assert result["input_ids"].tolist() == ids, "results are not in input order"
            states = result["hidden_states"]
            assert len(states) == len(labels), f"{len(states)} states for the {len(labels)} labels {labels}"
            for position, (got, want) in enumerate(zip(states, reference[tuple(ids)], strict=True)):
                assert tuple(got.shape) == tuple(want.shape)
                worst[position] = max(worst[position], (got.float() - want.float()).abs().max().item())
            pointers = [s.untyped_storage().data_ptr() for s in states]
            assert len(set(pointers)) == len(pointers), "two states of one sample share storage"
    return worst


@pytest.mark.parametrize(
    ("layers", "labels"),
    [("default", DEFAULT_ON_4_LAYERS), ("3,1,2", [3, 1, 2]), ("3,0,3,1", [3, 0, 3, 1])],
    ids=["scripts-default", "unsorted", "unsorted-repeated"],
)
def test_each_state_is_the_layer_it_is_labelled_with(tiny_model, calls, tmp_path, layers, labels) -> None:
    run = run_extract(tiny_model, calls[:3], tmp_path, layers=layers)
    assert run.returncode == 0, run.stderr
    assert run.data["layer_ids"] == labels, "the labels speculators' script would save"
    worst = judged_under_labels(run.data["outputs"], calls[:3], labels, tiny_model)
    assert max(worst.values()) < TOLERANCE, worst
