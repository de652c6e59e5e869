"""Slower fault cases on a real engine (tests/e2e/faults.py, each with generators of its own): in the full end-to-end
suite only (scripts/e2e_matrix.py), not in CI's subset."""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.test_faults import case, check_interrupted, run_faults

pytestmark = pytest.mark.e2e
GENERATIONS = 4  # generators made and shut down in turn: enough to show growth, at about 20 s each on 2 CPU cores


@pytest.fixture(scope="module")
def slow_faults(tmp_path_factory) -> dict[str, Any]:
    return run_faults(tmp_path_factory.mktemp("slow-faults"), "interrupted_one_step,generations")


def test_calls_after_ctrl_c_one_step_at_a_time(slow_faults) -> None:
    """Issue 33: the same as test_faults.py::test_calls_after_ctrl_c_in_generate with VLLM_COMPAT_STEPS_IN_FLIGHT=1
    (every later call failed there too)."""
    found = case(slow_faults, "interrupted_one_step")
    assert found["steps_in_flight"] == 1
    check_interrupted(found)


def test_generators_made_in_turn_leave_nothing_open(slow_faults) -> None:
    """Issue 33: each generator made and shut down left its workers' connection to the receiving socket open for
    good, and vLLM's shut-down executor its pipes (20 generators: 20 connections)."""
    found = case(slow_faults, "generations")
    assert found["count"] == GENERATIONS
    assert found["conns"][-1] == 0, f"connections left after each shutdown: {found['conns']}"
    assert found["fds"][-1] <= found["fds"][1], f"descriptors after each generator: {found['fds']}"
