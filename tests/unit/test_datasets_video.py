"""datasets-videoreader-name on a stand-in torchvision.io without VideoReader and stand-in datasets packages on disk
(on the real packages, speculators' own data-generation script: see the CHANGELOG entry and docs/limits.md)."""

from __future__ import annotations

import importlib
import sys
import textwrap
import types
from pathlib import Path

import pytest
from vllm_compat.adapters.datasets_video import VideoReader, VideoReaderName, imports_unguarded

from vllm_compat.errors import AdapterError

# datasets 4.6.0's TorchFormatter._tensorize, where it matters: the import runs on every value once torchvision is in
# sys.modules; datasets 4.8.4 and later wrap it in try/except ImportError.
UNGUARDED = """
import sys

def tensorize(value):
    if "torchvision" in sys.modules:
        from torchvision.io import VideoReader

        if isinstance(value, VideoReader):
            return "video"
    return "tensor"
"""
GUARDED = """
import sys

def tensorize(value):
    if "torchvision" in sys.modules:
        try:
            from torchvision.io import VideoReader

            if isinstance(value, VideoReader):
                return "video"
        except ImportError:
            pass
    return "tensor"
"""


@pytest.fixture
def torchvision_io(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """torchvision >= 0.26 where it matters: a ``torchvision.io`` without VideoReader."""
    package = types.ModuleType("torchvision")
    package.__path__ = []  # type: ignore[attr-defined]
    io = types.ModuleType("torchvision.io")
    io.decode_image = lambda *a: None  # type: ignore[attr-defined]
    package.io = io  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchvision", package)
    monkeypatch.setitem(sys.modules, "torchvision.io", io)
    return io


def fake_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, formatter: str) -> None:
    root = tmp_path / "site"
    (root / "datasets" / "formatting").mkdir(parents=True)
    (root / "datasets" / "__init__.py").write_text("")
    (root / "datasets" / "formatting" / "__init__.py").write_text("")
    (root / "datasets" / "formatting" / "torch_formatter.py").write_text(textwrap.dedent(formatter))
    monkeypatch.syspath_prepend(str(root))
    for name in [n for n in sys.modules if n == "datasets" or n.startswith("datasets.")]:
        monkeypatch.delitem(sys.modules, name)
    importlib.invalidate_caches()


def test_old_datasets_meets_torchvision_without_videoreader(tmp_path, monkeypatch, torchvision_io) -> None:
    fake_datasets(tmp_path, monkeypatch, UNGUARDED)
    from datasets.formatting import torch_formatter

    with pytest.raises(ImportError, match="VideoReader"):  # the failure speculators' script met
        torch_formatter.tensorize([1, 2])
    adapter = VideoReaderName()
    adapter.apply(torchvision_io)
    try:
        assert adapter.applied
        assert torch_formatter.tensorize([1, 2]) == "tensor"  # as datasets 4.8.4 answers where the import fails
        with pytest.raises(AdapterError, match=r"removed in torchvision 0\.26"):
            torchvision_io.VideoReader("clip.mp4")
        adapter.apply(torchvision_io)  # idempotent: the name is there now
        assert len(adapter._patches) == 1
    finally:
        adapter.revert()
    assert "VideoReader" not in torchvision_io.__dict__
    with pytest.raises(ImportError, match="VideoReader"):
        torch_formatter.tensorize([1, 2])


def test_a_datasets_that_guards_the_import_is_left_alone(tmp_path, monkeypatch, torchvision_io) -> None:
    fake_datasets(tmp_path, monkeypatch, GUARDED)
    adapter = VideoReaderName()
    adapter.apply(torchvision_io)
    assert not adapter.applied and "VideoReader" not in torchvision_io.__dict__


def test_a_torchvision_with_videoreader_is_left_alone(tmp_path, monkeypatch, torchvision_io) -> None:
    fake_datasets(tmp_path, monkeypatch, UNGUARDED)
    own = type("VideoReader", (), {})
    torchvision_io.VideoReader = own  # type: ignore[attr-defined]
    adapter = VideoReaderName()
    adapter.apply(torchvision_io)
    assert not adapter.applied and torchvision_io.VideoReader is own


def test_without_datasets_nothing_is_patched(monkeypatch, torchvision_io) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a))
    adapter = VideoReaderName()
    adapter.apply(torchvision_io)
    assert not adapter.applied


def test_the_placeholder_matches_nothing() -> None:
    assert not isinstance(object(), VideoReader)
    with pytest.raises(AdapterError, match="datasets-videoreader-name"):
        VideoReader()


@pytest.mark.parametrize(
    ("source", "unguarded"),
    [
        (UNGUARDED, True),
        (GUARDED, False),
        ("try:\n    from torchvision.io import VideoReader\nexcept Exception:\n    pass\n", False),
        ("try:\n    from torchvision.io import VideoReader\nexcept:\n    pass\n", False),
        ("try:\n    from torchvision.io import VideoReader\nexcept (ValueError, ImportError):\n    pass\n", False),
        ("try:\n    from torchvision.io import VideoReader\nexcept ValueError:\n    pass\n", True),
        ("try:\n    pass\nexcept ImportError:\n    from torchvision.io import VideoReader\n", True),
        ("try:\n    pass\nfinally:\n    from torchvision.io import VideoReader\n", True),
        ("from torchvision.io import read_video\n", False),
        ("from torchvision import io\n", False),
        ("this is not python", False),
    ],
)
def test_which_sources_need_the_name(source: str, unguarded: bool) -> None:
    assert imports_unguarded(source) is unguarded


def test_metadata() -> None:
    assert VideoReaderName.target == "torchvision.io" and VideoReaderName.always
    assert VideoReaderName.serves("0.3.0") and VideoReaderName.serves("0.4.0.1")
