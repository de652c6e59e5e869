"""``native-connector-on-cpu`` on a throwaway connector module: what it changes on vLLM's CPU platform, and what not.

The module here is written for the test (the real connector needs vLLM; tests/e2e/test_native.py runs it): a class
that copies a request's states the way ExampleHiddenStatesConnector does from vLLM 0.22.0, through a stand-in
``torch`` that fails as a CPU-only torch does (no CUDA stream or event, no pinned memory). Not a mock of the adapter's
subject: the adapter rebinds the module's ``torch`` name, and that is exactly what is checked here.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from vllm_compat.adapters import native_connector
from vllm_compat.adapters.native_connector import HostTorch, NativeConnectorOnCpu

from vllm_compat.adapter import load_adapters
from vllm_compat.errors import AdapterError

MODULE = "vc_test_connector"
CONNECTOR_SOURCE = '''
import torch


class ExampleHiddenStatesConnector:
    def __init__(self):
        self._copy_stream: torch.cuda.Stream | None = None
        self._events: dict[str, torch.cuda.Event] = {}

    def copy(self, req_id, states):
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        ready = torch.cuda.Event()
        ready.record()
        self._copy_stream.wait_event(ready)
        with torch.cuda.stream(self._copy_stream):
            host = torch.empty_like(states, device="cpu", pin_memory=True)
            host.copy_(states, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self._copy_stream)
        self._events[req_id] = done
        return host

    def finished(self, req_id):
        return self._events[req_id].query()

    @staticmethod
    def write(host, event, out):
        event.synchronize()
        out.extend(host.data)
'''


class _Buffer:
    def __init__(self, data: list[float] | None = None) -> None:
        self.data = list(data or [])

    def copy_(self, other: _Buffer, non_blocking: bool = False) -> None:
        self.data = list(other.data)


def _cpu_only_torch() -> types.ModuleType:
    """A torch as a CPU-only build behaves for these calls: CUDA streams, events and pinned memory fail."""

    def no_cuda(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA driver version is insufficient for CUDA runtime version")

    def empty_like(like: _Buffer, device: str = "cpu", pin_memory: bool = False) -> _Buffer:
        if pin_memory:
            raise RuntimeError("pin_memory=True requires a CUDA or other accelerator backend")
        return _Buffer([0.0] * len(like.data))

    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        Stream=type("Stream", (), {"__init__": no_cuda}),
        Event=type("Event", (), {"__init__": no_cuda}),
        stream=no_cuda,
        is_available=lambda: False,
    )
    torch.empty_like = empty_like  # type: ignore[attr-defined]
    for name in ("empty", "zeros", "zeros_like"):
        setattr(torch, name, no_cuda)
    torch.float32 = "float32"  # type: ignore[attr-defined]
    return torch


@pytest.fixture()
def connector(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "torch", _cpu_only_torch())
    (tmp_path / f"{MODULE}.py").write_text(CONNECTOR_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    module = importlib.import_module(MODULE)
    yield module
    sys.modules.pop(MODULE, None)


def _on(monkeypatch: pytest.MonkeyPatch, cpu: bool) -> None:
    monkeypatch.setattr(native_connector, "on_cpu", lambda: cpu)


def test_without_it_the_copy_fails_on_a_cpu_only_torch(connector) -> None:
    with pytest.raises(RuntimeError, match="CUDA driver"):
        connector.ExampleHiddenStatesConnector().copy("r", _Buffer([1.0]))


def test_on_the_cpu_platform_the_copy_is_synchronous_and_done(connector, monkeypatch: pytest.MonkeyPatch) -> None:
    _on(monkeypatch, cpu=True)
    real = connector.torch
    adapter = NativeConnectorOnCpu()
    adapter.apply(connector)
    assert adapter.applied and isinstance(connector.torch, HostTorch)
    conn = connector.ExampleHiddenStatesConnector()
    states = _Buffer([1.5, -2.0, 3.25])
    host = conn.copy("r", states)
    assert host.data == states.data and host is not states  # copied, before the event that marks it
    states.data[0] = 99.0  # the cache is reused: what was copied stays
    assert host.data == [1.5, -2.0, 3.25]
    assert conn.finished("r") is True  # get_finished's poll: complete at once
    out: list[float] = []
    conn.write(host, conn._events["r"], out)  # the writer thread's wait returns at once
    assert out == [1.5, -2.0, 3.25]
    assert connector.torch.float32 == "float32" and connector.torch.cuda.is_available() is False  # the rest is torch's
    adapter.revert()
    assert connector.torch is real and not adapter.applied
    with pytest.raises(RuntimeError, match="CUDA driver"):
        connector.ExampleHiddenStatesConnector().copy("r", _Buffer([1.0]))


def test_applied_once(connector, monkeypatch: pytest.MonkeyPatch) -> None:
    _on(monkeypatch, cpu=True)
    first, second = NativeConnectorOnCpu(), NativeConnectorOnCpu()
    first.apply(connector)
    view = connector.torch
    second.apply(connector)
    assert not second.applied and connector.torch is view  # no view of a view
    first.revert()
    assert isinstance(connector.torch, types.ModuleType)


def test_on_a_gpu_nothing_changes(connector, monkeypatch: pytest.MonkeyPatch) -> None:
    _on(monkeypatch, cpu=False)
    real = connector.torch
    adapter = NativeConnectorOnCpu()
    adapter.apply(connector)
    assert not adapter.applied and connector.torch is real


def test_a_copy_path_it_does_not_know_fails_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, connector
) -> None:
    _on(monkeypatch, cpu=True)
    (tmp_path / "vc_test_connector_other.py").write_text(
        CONNECTOR_SOURCE.replace("ready.record()", "ready.record()\n        torch.cuda.synchronize()")
    )
    import importlib

    other = importlib.import_module("vc_test_connector_other")
    try:
        adapter = NativeConnectorOnCpu()
        with pytest.raises(AdapterError, match=r"torch\.cuda\.synchronize"):
            adapter.apply(other)
        assert not adapter.applied and isinstance(other.torch, types.ModuleType)
    finally:
        sys.modules.pop("vc_test_connector_other", None)


def test_a_connector_with_nothing_cuda_only_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.17 to 0.21: the states are copied with .cpu(); nothing to patch."""
    _on(monkeypatch, cpu=True)
    monkeypatch.setitem(sys.modules, "torch", _cpu_only_torch())
    (tmp_path / "vc_test_connector_plain.py").write_text(
        "import torch\n\n\nclass ExampleHiddenStatesConnector:\n    def save(self, states):\n"
        "        return states.detach().cpu()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    plain = importlib.import_module("vc_test_connector_plain")
    try:
        adapter = NativeConnectorOnCpu()
        adapter.apply(plain)
        assert not adapter.applied
    finally:
        sys.modules.pop("vc_test_connector_plain", None)


def test_it_serves_the_native_lines_only() -> None:
    """The native lines (``native-0.X`` stand for speculators 0.X) and only them; no in-process adapter serves them."""
    assert all(NativeConnectorOnCpu.serves(f"native-0.{m}") for m in range(5, 10))
    assert not NativeConnectorOnCpu.serves("0.3.0") and not NativeConnectorOnCpu.serves("0.4.0.1")
    serving = [cls.id for cls in load_adapters().values() if cls.serves("native-0.9")]
    assert serving == [NativeConnectorOnCpu.id]
