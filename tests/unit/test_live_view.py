"""LiveView over an importable copy of the fake tree must agree with StaticView over the same files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vllm_compat.apiview.live import ImportBroken, LiveView
from vllm_compat.apiview.static import StaticView
from vllm_compat.findings import UNKNOWN, Observation, Probe

from .fake_tree import write_tree

QUESTIONS = [
    "fakevllm.config.SchedulerConfig",
    "fakevllm.config.CacheConfig",
    "fakevllm.engine.Engine",
    "fakevllm.engine.Engine.collective_rpc",
    "fakevllm.engine.Engine.helper",
    "fakevllm.engine.Engine.required_layout",  # a classmethod: cls is not a parameter a caller passes
    "fakevllm.engine.Engine.renamed_self",  # a method whose first parameter is not named self
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


def test_a_module_that_does_not_import_is_unknown_not_missing(tmp_path: Path, monkeypatch) -> None:
    """A new user's environment on vLLM's CPU build 0.29.0 with PyPI's torchvision beside the +cpu torch: every vLLM
    module that imports transformers' models failed to import, and ``probe --live`` reported 38 facts drifted
    ("module vllm.config does not exist") and told the user to pin another vLLM. A module that exists but does not
    import is the environment's fault: the view says so, and the fact is unknown with that cause."""
    pkg = tmp_path / "brokenpkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    (pkg / "needs.py").write_text("import a_package_nobody_installed\n")
    (pkg / "sub" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    view = LiveView(package="brokenpkg")
    with pytest.raises(ImportBroken, match="torchvision::nms") as caught:
        view.locate("brokenpkg.config.CacheConfig")
    assert "environment" in str(caught.value) and "does not import here" in str(caught.value)
    assert "torchvision::nms" in view.import_error("brokenpkg.config")
    with pytest.raises(ImportBroken, match="a_package_nobody_installed"):
        view.has_module("brokenpkg.needs")
    assert view.locate("brokenpkg.gone.Thing") is None, "a module this package does not have is absent"
    assert view.locate("brokenpkg.sub.gone") is None
    assert not view.has_module("brokenpkg.sub.gone")

    probe = Probe("x.cache_config", "brokenpkg.config.CacheConfig", "a class speculators builds",
                  expected={"0.4.0.1": "baseline"},
                  observe=lambda v: Observation("baseline" if v.locate("brokenpkg.config.CacheConfig") else "missing",
                                                "found or not"))  # fmt: skip
    observed = probe.run(view)
    assert observed.variant_for("0.4.0.1") == UNKNOWN and "torchvision::nms" in observed.observed
    assert probe.state_for("0.4.0.1", observed).name == "UNKNOWN"
