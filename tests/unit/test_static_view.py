from __future__ import annotations

from pathlib import Path

import pytest

from vllm_compat.apiview.static import StaticSourceError, StaticView

from .fake_tree import write_tree, write_wheel


@pytest.fixture(params=["folder", "wheel"])
def view(request, tmp_path: Path) -> StaticView:
    root = write_tree(tmp_path / "src")
    if request.param == "wheel":
        return StaticView(write_wheel(root, tmp_path / "fakevllm-9.9.9-py3-none-any.whl"), package="fakevllm")
    return StaticView(root, package="fakevllm")


def names(params):
    return [p.name for p in params]


def test_version_from_metadata(view: StaticView) -> None:
    assert view.version() == "9.9.9"


def test_pydantic_config_dataclass_with_initvars(view: StaticView) -> None:
    params = {p.name: p for p in view.parameters("fakevllm.config.SchedulerConfig")}
    # InitVars come first and are required; init=False and ClassVar fields are not parameters
    assert list(params) == [
        "max_model_len",
        "is_encoder_decoder",
        "max_num_seqs",
        "cuda_graph_sizes",
        "async_scheduling",
    ]
    assert params["max_model_len"].required and params["is_encoder_decoder"].required
    assert not params["max_num_seqs"].required and params["max_num_seqs"].default == "128"
    assert params["cuda_graph_sizes"].default == "list()"
    assert params["async_scheduling"].default == "None"


def test_dataclass_inheritance_and_kw_only(view: StaticView) -> None:
    params = view.parameters("fakevllm.config.CacheConfig")
    assert names(params) == ["block_size", "gpu_memory_utilization", "enable_prefix_caching"]
    assert params[2].kind == "keyword_only" and params[0].kind == "positional_or_keyword"


def test_reexport_is_followed_to_the_defining_module(view: StaticView) -> None:
    loc = view.locate("fakevllm.config.SchedulerConfig")
    assert loc.module == "fakevllm.config.scheduler" and loc.kind == "class"
    assert loc.file == "fakevllm/config/scheduler.py" and loc.line == 5  # the decorator line
    assert view.locate("fakevllm.config.CacheConfig").module == "fakevllm.config.cache"


def test_type_checking_imports_are_not_exports(view: StaticView) -> None:
    assert view.locate("fakevllm.config.Engine") is None


def test_lazy_getattr_export_table(view: StaticView) -> None:
    assert view.locate("fakevllm.Engine").module == "fakevllm.engine"
    assert view.locate("fakevllm.Other").qualname == "Engine"


def test_moved_name_and_module_binding(view: StaticView) -> None:
    loc = view.locate("fakevllm.utils.planner")
    assert (loc.module, loc.kind) == ("fakevllm.moved", "function")
    assert view.locate("fakevllm.utils.engine").kind == "module"
    assert view.locate("fakevllm.utils.LIMIT").kind == "attribute"
    assert view.locate("fakevllm.utils.missing") is None
    assert view.locate("fakevllm.nowhere.X") is None


def test_inherited_init_and_methods(view: StaticView) -> None:
    params = view.parameters("fakevllm.engine.Engine")
    assert names(params) == ["vllm_config", "log_stats"] and params[1].kind == "keyword_only"
    assert names(view.parameters("fakevllm.engine.Engine.collective_rpc"))[0] == "method"
    assert names(view.parameters("fakevllm.engine.Engine.helper")) == ["x", "y"]  # staticmethod keeps x
    loc = view.locate("fakevllm.engine.Engine.collective_rpc")
    assert loc.qualname == "Base.collective_rpc"
    assert {"collective_rpc", "execute_model", "helper", "__init__"} <= view.members("fakevllm.engine.Engine")


def test_source_text(view: StaticView) -> None:
    src = view.source("fakevllm.engine.Engine.collective_rpc")
    assert "unique_reply_rank is not None" in src.text
    assert src.file == "fakevllm/engine.py" and src.line == 5


def test_has_module(view: StaticView) -> None:
    assert view.has_module("fakevllm.config.scheduler")
    assert view.has_module("fakevllm.config")
    assert not view.has_module("fakevllm.config.nothing")


def test_rejects_what_is_not_a_tree_or_wheel(tmp_path: Path) -> None:
    with pytest.raises(StaticSourceError):
        StaticView(tmp_path, package="fakevllm")
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(StaticSourceError):
        StaticView(bad, package="fakevllm")


def test_unparsable_module_reads_as_absent(tmp_path: Path) -> None:
    root = write_tree(tmp_path)
    (root / "fakevllm/engine.py").write_text("def broken(:\n")
    view = StaticView(root, package="fakevllm")
    assert view.locate("fakevllm.engine.Engine") is None
    assert view.parameters("fakevllm.engine.Engine") is None
