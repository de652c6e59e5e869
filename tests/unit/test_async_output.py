"""async-output-under-v2: the fact it relies on, on small vLLM-shaped trees, and its effect on SchedulerConfig.

The real releases (0.22.0: V2 reads the flag; 0.26.0 and 0.34.0: it does not) are in tests/drift/test_wheels.py;
what it is for, the GPU's idle time between steps, is measured on the H200 by bench/extraction_throughput.py (the
CPU platform turns async scheduling off whatever is asked, so no CPU run can show it).
"""

from __future__ import annotations

import dataclasses
import textwrap
import types
from pathlib import Path

import pytest
from vllm_compat.adapters.config import AsyncOutputUnderV2, AsyncSchedulingOff

from vllm_compat.apiview.static import StaticView
from vllm_compat.plan import load_probes

PROBE = "model_runner.v2_async_output"
RUNNER = """
class GPUModelRunner:
    def execute_model(self, scheduler_output):
        return self.sample(scheduler_output){reads}
"""
WORKER = """
class Worker:
    def sample_tokens(self, grammar_output):
        return self.model_runner.sample_tokens(grammar_output)
"""
PROC_THREADED = """
class WorkerProc:
    def __init__(self, vllm_config):
        self.use_async_scheduling = vllm_config.scheduler_config.async_scheduling

    def handle_output(self, output):
        if self.use_async_scheduling:
            self.async_output_queue.put(output)
        else:
            self.enqueue_output(output)

    def async_output_busy_loop(self):
        while True:
            self.enqueue_output(self.async_output_queue.get())
"""
PROC_PLAIN = """
class WorkerProc:
    def handle_output(self, output):
        self.enqueue_output(output)
"""


def tree(tmp_path: Path, v2: bool = True, runner_reads: bool = False, proc: str = PROC_THREADED) -> Path:
    reads = "\n\n    def _overlap(self):\n        return self.scheduler_config.async_scheduling" if runner_reads else ""
    files = {
        "vllm/__init__.py": "",
        "vllm/v1/__init__.py": "",
        "vllm/v1/worker/__init__.py": "",
        "vllm/v1/worker/gpu_worker.py": WORKER,
        "vllm/v1/executor/__init__.py": "",
        "vllm/v1/executor/multiproc_executor.py": proc,
    }
    if v2:
        files["vllm/v1/worker/gpu/__init__.py"] = ""
        files["vllm/v1/worker/gpu/model_runner.py"] = RUNNER.format(reads=reads)
    root = tmp_path / "vllm-tree"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


@pytest.mark.parametrize(
    ("shape", "variant"),
    [
        ({}, "baseline"),  # vLLM 0.26.0 to 0.34.0
        ({"runner_reads": True}, "changed"),  # vLLM 0.13.0 to 0.22.x: V2 reads the flag itself
        ({"proc": PROC_PLAIN}, "changed"),  # no output thread: the flag would gain nothing
        ({"v2": False}, "absent"),
    ],
)
def test_the_probe_tells_what_the_flag_changes_under_v2(tmp_path: Path, shape: dict, variant: str) -> None:
    observation = load_probes()[PROBE].observe(StaticView(tree(tmp_path, **shape)))
    assert observation.variant == variant, observation.observed


def generator_module(default: object) -> types.ModuleType:
    """A generator module whose SchedulerConfig is a dataclass with ``async_scheduling`` defaulting to ``default``."""
    module = types.ModuleType("stand_in_generator")

    @dataclasses.dataclass
    class SchedulerConfig:
        max_num_seqs: int = 8
        async_scheduling: object = default

    module.SchedulerConfig = SchedulerConfig
    return module


def apply_both(module: types.ModuleType) -> list:
    applied = []
    for cls in sorted((AsyncSchedulingOff, AsyncOutputUnderV2), key=lambda c: c.order):  # as the engine orders them
        adapter = cls()
        adapter.apply(module)
        applied.append(adapter)
    return applied


def test_under_v2_vllm_decides_as_for_its_own_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AsyncOutputUnderV2.SWITCH, raising=False)
    module = generator_module(None)
    adapters = apply_both(module)
    assert module.SchedulerConfig(max_num_seqs=4).async_scheduling is None  # VllmConfig turns it on for the GPU
    assert module.SchedulerConfig(async_scheduling=False).async_scheduling is False  # what speculators asks stays
    for adapter in reversed(adapters):
        adapter.revert()
    assert dataclasses.is_dataclass(module.SchedulerConfig) and module.SchedulerConfig().async_scheduling is None


def test_alone_async_scheduling_off_keeps_it_off() -> None:
    module = generator_module(None)
    AsyncSchedulingOff().apply(module)
    assert module.SchedulerConfig().async_scheduling is False


def test_a_release_whose_default_is_not_none_keeps_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AsyncOutputUnderV2.SWITCH, raising=False)
    module = generator_module(True)  # no "vLLM decides" value to pass
    apply_both(module)
    assert module.SchedulerConfig().async_scheduling is False


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AsyncOutputUnderV2.SWITCH, "0")
    module = generator_module(None)
    adapters = apply_both(module)
    assert not adapters[1].applied
    assert module.SchedulerConfig().async_scheduling is False
