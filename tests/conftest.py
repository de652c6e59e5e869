"""Shared fixtures. Tests run against the installed package (``pip install -e .``)."""

from __future__ import annotations

import itertools
import os
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

# The unit tests drive install()/uninstall() themselves: keep the import-time auto-install out.
os.environ.setdefault("VLLM_COMPAT_DISABLE", "1")


@pytest.fixture
def vllm_tree(tmp_path: Path) -> Callable[[str], Path]:
    """``vllm_tree("0.16.0")`` -> a fresh folder holding a real vLLM release as a source tree.

    The folder holds every ``vllm/**.py`` of the release's wheel and its dist-info METADATA (so the
    version is kept). The wheel comes from ``vllm_compat.sources.fetch_release`` (cached in
    ``$VLLM_COMPAT_CACHE``); the test is skipped when it can be neither found nor fetched.
    """
    from vllm_compat.errors import SourceError
    from vllm_compat.sources import fetch_release

    counter = itertools.count()

    def make(release: str) -> Path:
        try:
            wheel = fetch_release(release)
        except SourceError as exc:
            pytest.skip(f"vllm=={release} is not cached and cannot be fetched: {exc}")
        dest = tmp_path / f"vllm-{release}-{next(counter)}"
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if (name.startswith("vllm/") and name.endswith(".py")) or name.endswith(".dist-info/METADATA"):
                    zf.extract(name, dest)
        return dest

    return make
