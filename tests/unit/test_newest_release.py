"""``vllm-compat probe --source vllm``: the newest vLLM release on the package index, resolved through pip.

pip is never run here: ``newest_release`` takes a stand-in for ``subprocess.run`` that answers as pip would
(online, offline, or a pip without the ``index`` command).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import vllm_compat.cli as cli
import vllm_compat.sources as sources
from tests.unit.test_cli import new_field_tree  # noqa: F401  (fixture)
from vllm_compat.errors import SourceError

INDEX_OUT = "vllm (0.34.0)\nAvailable versions: 0.34.0, 0.33.0, 0.32.0\n"
OFFLINE_ERR = (
    "WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after connection broken "
    "by 'NewConnectionError(...: Failed to establish a new connection: [Errno -3] Temporary failure in name "
    "resolution')': /simple/vllm/\nERROR: No matching distribution found for vllm\n"
)


class FakePip:
    """Answers each pip command by its sub-command; records the commands."""

    def __init__(self, **answers: tuple[int, str, str]) -> None:
        self.answers = answers
        self.calls: list[list[str]] = []

    def __call__(self, cmd, **kwargs):
        self.calls.append(list(cmd))
        assert cmd[1:3] == ["-m", "pip"] and kwargs.get("check") is False
        rc, out, err = self.answers[cmd[3]]
        return subprocess.CompletedProcess(cmd, rc, out, err)


def test_newest_is_read_from_pip_index_versions() -> None:
    pip = FakePip(index=(0, INDEX_OUT, ""))
    assert sources.newest_release(run=pip) == "0.34.0"
    assert len(pip.calls) == 1
    cmd = pip.calls[0]
    assert cmd[3:6] == ["index", "versions", "vllm"]
    # the same target as the wheel the probe then fetches (CPython 3.12, x86_64 Linux, binaries only)
    assert "--only-binary=:all:" in cmd and cmd[cmd.index("--python-version") + 1] == "3.12"
    assert "manylinux_2_28_x86_64" in cmd


@pytest.mark.parametrize(
    "said",
    [
        "Saved /cache/vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl\nSuccessfully downloaded vllm\n",
        "File was already downloaded /cache/vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl\n",
    ],
)
def test_a_pip_without_index_falls_back_to_downloading_the_newest_wheel(tmp_path: Path, said: str) -> None:
    pip = FakePip(index=(1, "", 'ERROR: unknown command "index"\n'), download=(0, "Collecting vllm\n" + said, ""))
    assert sources.newest_release(run=pip, dest=tmp_path) == "0.34.0"
    download = pip.calls[1]
    assert download[3] == "download" and "--no-deps" in download and download[-1] == "vllm"
    assert download[download.index("--dest") + 1] == str(tmp_path)


def test_no_network_is_a_clear_source_error_without_a_second_try() -> None:
    pip = FakePip(index=(1, "", OFFLINE_ERR))
    with pytest.raises(SourceError) as caught:
        sources.newest_release(run=pip)
    message = str(caught.value)
    assert "could not find the newest vLLM release on the package index" in message
    assert "No matching distribution found for vllm" in message and "--source vllm==" in message
    assert len(pip.calls) == 1, "an unreachable index is not asked twice"


def test_index_output_without_a_version_is_an_error() -> None:
    with pytest.raises(SourceError, match="newest vLLM release"):
        sources.newest_release(run=FakePip(index=(0, "nothing useful\n", "")))


def test_resolve_source_names_the_release_it_chose() -> None:
    source, note = sources.resolve_source(" vllm ", newest=lambda: "0.34.0")
    assert source == "vllm==0.34.0" and "newest" in note
    for other in (None, "vllm==0.33.0", "/some/folder", "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"):
        assert sources.resolve_source(other, newest=lambda: pytest.fail("looked up")) == (other, None)


def test_probe_source_vllm_probes_the_newest_and_says_so(
    new_field_tree: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fetched = []
    monkeypatch.setattr(sources, "newest_release", lambda: "9.9.9")
    monkeypatch.setattr(sources, "fetch_release", lambda version, dest=None: fetched.append(version) or new_field_tree)
    rc = cli.main(["probe", "--source", "vllm", "--speculators", "0.4.0.1"])
    out = capsys.readouterr().out
    assert rc == cli.EXIT_DRIFT  # the tiny tree's Request drifted in a way no adapter covers
    assert fetched == ["9.9.9"]
    assert out.splitlines()[0] == (
        "vllm-compat probe: vLLM 9.9.9 (static: vllm==9.9.9, chosen as the newest vLLM release on the package index)"
    )


def test_probe_source_vllm_offline_exits_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(subprocess, "run", FakePip(index=(1, "", OFFLINE_ERR)))
    rc = cli.main(["probe", "--source", "vllm", "--json"])
    captured = capsys.readouterr()
    assert rc == cli.EXIT_USAGE and captured.out == ""
    assert captured.err.startswith("vllm-compat: could not find the newest vLLM release on the package index")
