"""Where a probe run reads vLLM from: the installed package, a folder, a wheel, or a release."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

from vllm_compat.errors import SourceError

__all__ = ["NEWEST", "cache_dir", "fetch_release", "newest_release", "open_view", "resolve_source"]

logger = logging.getLogger("vllm_compat")
_RELEASE = re.compile(r"^vllm(?:-cpu)?==(?P<version>[0-9][0-9A-Za-z.+-]*)$")
NEWEST = "vllm"  # `--source vllm`: the newest vLLM release on the package index
_INDEX_LINE = re.compile(r"^vllm \((?P<version>[0-9][0-9A-Za-z.+!-]*)\)", re.MULTILINE)  # `pip index versions`
_WHEEL_NAME = re.compile(r"vllm-(?P<version>[0-9][0-9A-Za-z.+!]*)-[^\s/\\]*\.whl")


def cache_dir() -> Path:
    """Where fetched wheels are kept: ``$VLLM_COMPAT_CACHE`` or the user cache folder."""
    if os.environ.get("VLLM_COMPAT_CACHE"):
        return Path(os.environ["VLLM_COMPAT_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "vllm-compat" / "wheels"


def fetch_release(version: str, dest: Path | None = None) -> Path:
    """The wheel of ``vllm==version``, downloaded once (no dependencies) into the cache."""
    dest = dest or cache_dir()
    dest.mkdir(parents=True, exist_ok=True)
    cached = _find_wheel(dest, version)
    if cached:
        return cached
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *_target(), "--dest", str(dest)]
    cmd.append(f"vllm=={version}")
    logger.info("fetching vllm==%s into %s", version, dest)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheel = _find_wheel(dest, version)
    if done.returncode != 0 or wheel is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SourceError(
            f"could not fetch vllm=={version} from the package index ({tail[0]}). "
            "Pass a wheel or a source folder with --source instead."
        )
    return wheel


def _target() -> list[str]:
    """pip's options for the wheels the probes read: CPython 3.12 on x86_64 Linux, binaries only. pip matches
    --platform tags exactly, so every glibc a vLLM wheel may be tagged for is named (vllm 0.21.0 is manylinux_2_24
    only, 0.20.0 manylinux_2_35)."""
    platforms: list[str] = []
    for tag in ("manylinux1", "manylinux2010", "manylinux2014", *(f"manylinux_2_{n}" for n in range(5, 40))):
        platforms += ["--platform", f"{tag}_x86_64"]
    return ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", *platforms]


def newest_release(run=None, dest: Path | None = None) -> str:
    """The version of the newest vLLM release on the package index (pip's index and settings; no pre-releases).

    Asks ``pip index versions vllm``; where this pip has no ``index`` command, ``pip download --no-deps vllm`` into
    the wheel cache (``dest``), and the version is read from the wheel's name (the probe reads that wheel next).
    ``run`` stands in for ``subprocess.run`` (tests). Raises SourceError when the index cannot be reached.
    """
    run = run or subprocess.run

    def pip(*args: str):
        return run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False)

    done = pip("index", "versions", "vllm", *_target())
    found = _INDEX_LINE.search(done.stdout or "")
    if done.returncode == 0 and found:
        return found["version"]
    said = _pip_said(done)
    if "unknown command" in said or "no such command" in said.lower():
        dest = dest or cache_dir()
        dest.mkdir(parents=True, exist_ok=True)
        done = pip("download", "--no-deps", *_target(), "--dest", str(dest), "vllm")
        found = _WHEEL_NAME.search(done.stdout or "")
        if done.returncode == 0 and found:
            return found["version"]
        said = _pip_said(done)
    raise SourceError(
        f"could not find the newest vLLM release on the package index (pip: {said}). Check the network and pip's "
        "index settings (PIP_INDEX_URL), or name a release: --source vllm==0.33.0."
    )


def _pip_said(done) -> str:
    """pip's last line of output (its error), or a word that it said nothing."""
    tail = ((done.stderr or "").strip() or (done.stdout or "").strip()).splitlines()[-1:]
    return tail[0].strip() if tail else f"exit {done.returncode}, no output"


def resolve_source(source: str | None, newest=None) -> tuple[str | None, str | None]:
    """``source`` as ``open_view`` reads it, and a note for the report's origin: ``vllm`` (the newest release on the
    package index) becomes ``vllm==X`` and the note says so; anything else is returned as it is, with no note."""
    if source is not None and source.strip() == NEWEST:
        version = (newest or newest_release)()
        return f"vllm=={version}", "chosen as the newest vLLM release on the package index"
    return source, None


def _find_wheel(folder: Path, version: str) -> Path | None:
    found = sorted(folder.glob(f"vllm-{version}-*.whl")) + sorted(folder.glob(f"vllm-{version}-*-*.whl"))
    return found[0] if found else None


def installed_vllm_folder() -> Path | None:
    """The folder holding the ``vllm`` package Python would import, found without importing it (a top-level name's
    spec comes from the path finders alone)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]).parent if locations else None


def _refuse_older_release(version: str) -> None:
    """A release older than those served is refused before its wheel is downloaded (hundreds of MB for nothing)."""
    from vllm_compat.versions import VLLM_SERVED, served_range

    if served_range(version) == "older":
        raise SourceError(
            f"vLLM {version} is older than the releases vllm-compat serves ({VLLM_SERVED[0]} to {VLLM_SERVED[1]}): "
            "nothing downloaded. speculators 0.3.0 was built for vLLM 0.11.0 and 0.4.0.1 for 0.12 to 0.16; probe one "
            f"of those or a later release. To probe {version} anyway, download its wheel "
            f"(`pip download --no-deps vllm=={version}`) and pass the file to --source."
        )


def open_view(source: str | None, live: bool = False):
    """An ApiView for ``source``: None (the installed vLLM), a folder, a wheel, ``vllm==X``, or ``vllm`` (the newest
    release on the package index).

    The installed vLLM is read from its files with ``ast`` (seconds; nothing imported, nothing printed), or with
    ``live`` imported and inspected (importing vLLM and torch takes tens of seconds, and vLLM logs as it imports).
    Both give the same findings (tests/e2e/test_probe_cli.py).
    """
    from vllm_compat.apiview.static import StaticSourceError, StaticView

    if source is None:
        from vllm_compat.versions import installed_version

        if installed_version("vllm") is None:
            raise SourceError(
                "no vLLM is installed here. Probe a release without installing it: "
                "`vllm-compat probe --source vllm==0.33.0` (or a wheel file or source folder)."
            )
        if live:
            from vllm_compat.apiview.live import LiveView

            return LiveView()
        folder = installed_vllm_folder()
        if folder is None:
            raise SourceError("cannot find the installed vllm package's files; `vllm-compat probe --live` imports it")
        try:
            return StaticView(folder)
        except StaticSourceError as exc:
            raise SourceError(f"{exc}; `vllm-compat probe --live` imports the installed vLLM instead") from exc
    source, _note = resolve_source(source)
    match = _RELEASE.match(source.strip())
    if match:
        _refuse_older_release(match["version"])
    path = fetch_release(match["version"]) if match else Path(source)
    if not path.exists():
        raise SourceError(
            f"{source}: no such file or folder, and not of the form vllm==X (or vllm: the newest release)"
        )
    try:
        return StaticView(path)
    except StaticSourceError as exc:
        raise SourceError(str(exc)) from exc
