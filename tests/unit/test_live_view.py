"""LiveView over an importable copy of the fake tree must agree with StaticView over the same files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vllm_compat.apiview.live import LiveView
from vllm_compat.apiview.static import StaticView

from .fake_tree import write_tree

QUESTIONS = [
    "fakevllm.config.SchedulerConfig",
    "fakevllm.config.CacheConfig",
    "fakevllm.engine.Engine",
    "fakevllm.engine.Engine.collective_rpc",
    "fakevllm.engine.Engine.helper",
    "fakevllm.utils.planner",
    "fakevllm.utils.engine",
    "fakevllm.utils.missing",
]


@pytest.fixture()
def views(tmp_path: Path, monkeypatch):
    pytest.importorskip("pydantic")
    root = write_tree(tmp_path)
    monkeypatch.syspath_prepend(str(root))
    yield LiveView(package="fakevllm"), StaticView(root, package="fakevllm")
    for name in [m for m in sys.modules if m == "fakevllm" or m.startswith("fakevllm.")]:
        del sys.modules[name]


@pytest.mark.parametrize("dotted", QUESTIONS)
def test_live_and_static_agree(views, dotted: str) -> None:
    live, static = views
    a, b = live.locate(dotted), static.locate(dotted)
    assert (a is None) == (b is None)
    if a is None:
        return
    assert (a.module, a.qualname, a.kind, a.file) == (b.module, b.qualname, b.kind, b.file)
    if a.kind != "module":
        assert a.line == b.line
    pa, pb = live.parameters(dotted), static.parameters(dotted)
    if a.kind in {"class", "function"}:
        assert [(p.name, p.kind, p.required) for p in pa] == [(p.name, p.kind, p.required) for p in pb]


def test_members_and_source_agree(views) -> None:
    live, static = views
    wanted = {"collective_rpc", "execute_model", "helper", "__init__"}
    assert wanted <= live.members("fakevllm.engine.Engine")
    assert wanted <= static.members("fakevllm.engine.Engine")
    assert (
        live.source("fakevllm.engine.Engine.execute_model").text
        == static.source("fakevllm.engine.Engine.execute_model").text
    )


def test_import_failure_is_reported_not_raised(tmp_path: Path, monkeypatch) -> None:
    pkg = tmp_path / "brokenpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('needs a GPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    view = LiveView(package="brokenpkg")
    assert view.locate("brokenpkg.X") is None
    assert "needs a GPU" in view.import_error("brokenpkg")
