"""Which speculators line the code that runs belongs to, judged from that code rather than from metadata alone.

The installed distribution's metadata can disagree with the code Python imports: a speculators source tree first
on ``PYTHONPATH`` while another release is installed, a copied folder, a checkout. The adapters must fit the code that
runs (a 0.3.0 generator given 0.4.0.1's adapters dies with an unrelated pydantic error), so the line is judged from
what speculators' generator and worker modules call and define, read from their source: the module's own file once
it is imported, otherwise the file Python would import (found on ``sys.path`` the way the import system finds it,
without importing anything). The metadata decides only where no such code is found. Where the code matches neither
line, or its two modules disagree, the line is *unknown* and the generator's guard stops the run
(:class:`~vllm_compat.errors.SpeculatorsLineUnknown`).

Nothing here imports speculators, vLLM or torch: adapters need the line while those modules are being imported.
"""

from __future__ import annotations

import importlib.machinery
import logging
import os
import re
import sys
import threading
from dataclasses import dataclass
from types import ModuleType

from vllm_compat.versions import installed_version, native_line, speculators_line

__all__ = ["MARKERS", "LineVerdict", "judge_line", "judge_text"]

logger = logging.getLogger("vllm_compat")

GENERATOR = "speculators.data_generation.vllm_hidden_states_generator"
WORKER = "speculators.data_generation.custom_worker"

# module -> line -> (what it shows, pattern over the source with all whitespace removed). A module is judged to be
# a line when every marker of that line is present and no marker of the other line is. The markers are the calls the
# two lines' adapters differ on (block hashes, the encoder-decoder flag, per-request metadata, the capture layout).
MARKERS: dict[str, dict[str, tuple[tuple[str, str], ...]]] = {
    GENERATOR: {
        "0.3.0": (
            ("passes kv_cache_specs= to get_kv_cache_config_from_groups", r"kv_cache_specs="),
            ("aborts each scheduled request after its step", r"finish_requests\(\[req_id\]"),
        ),
        "0.4.0.1": (
            ("passes block_hasher= to Request", r"block_hasher="),
            ("passes is_encoder_decoder= to SchedulerConfig", r"is_encoder_decoder="),
            ("calls the workers' _set_request_metadata", r"['\"]_set_request_metadata['\"]"),
        ),
    },
    WORKER: {
        "0.3.0": (
            ("calls get_input_embeddings", r"\.get_input_embeddings\("),
            ("checks supports_eagle3", r"supports_eagle3\("),
        ),
        "0.4.0.1": (
            ("defines _set_request_metadata", r"def_set_request_metadata\("),
            ("calls embed_input_ids", r"\.embed_input_ids\("),
        ),
    },
}
_WHITESPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class LineVerdict:
    """The speculators line whose adapters apply in this process, and how it was judged.

    ``how`` is ``"code"`` (the modules' source), ``"metadata"`` (no speculators code found: the installed version),
    ``"absent"`` (neither: nothing to adapt) or ``"unknown"`` (code found that matches neither line, or whose modules
    disagree: ``line`` is None and the guard refuses to run).
    """

    line: str | None
    how: str
    metadata_version: str | None = None
    code: tuple[tuple[str, str, str | None, str], ...] = ()  # (module, file, line it shows or None, what it shows)

    @property
    def unknown(self) -> bool:
        return self.how == "unknown"

    @property
    def metadata_line(self) -> str | None:
        return speculators_line(self.metadata_version)

    @property
    def native(self) -> str | None:
        """The native line (speculators 0.5 to 0.9, extraction through ``vllm serve``) where no in-process generator
        code is found and the installed metadata names such a release; None otherwise."""
        return native_line(self.metadata_version) if self.how == "absent" else None

    def describe(self) -> str:
        """One phrase for logs and reports: the line and how it was judged."""
        meta = f"speculators {self.metadata_version} installed" if self.metadata_version else "no speculators metadata"
        if self.how == "code":
            where = ", ".join(_short(module) for module, *_ in self.code)
            agree = "agrees" if self.metadata_line == self.line else f"says {self.metadata_version or 'nothing'}"
            return f"line {self.line}, judged from its code ({where}); metadata {agree}"
        if self.how == "metadata":
            return f"line {self.line}, judged from the metadata ({meta}; no speculators code found to read)"
        if self.how == "absent":
            return f"no speculators line ({meta})"
        return f"line unknown ({self.seen()}; {meta})"

    def seen(self) -> str:
        return "; ".join(
            f"{module} ({path}) {'looks like ' + line if line else 'matches neither line'}: {shows}"
            for module, path, line, shows in self.code
        )


def judge_text(module: str, text: str) -> tuple[str | None, str]:
    """The line one module's source belongs to (or None), and the markers it shows."""
    flat = _WHITESPACE.sub("", text)
    matched: dict[str, list[str]] = {
        line: [label for label, pattern in markers if re.search(pattern, flat)]
        for line, markers in MARKERS[module].items()
    }
    complete = [line for line, found in matched.items() if len(found) == len(MARKERS[module][line])]
    partial = [line for line, found in matched.items() if found]
    shows = "; ".join(f"{line}: {', '.join(found)}" for line, found in matched.items() if found) or "no marker"
    if len(complete) == 1 and partial == complete:
        return complete[0], shows
    return None, shows


def _short(module: str) -> str:
    return module.rpartition(".")[2]


def _locate(name: str) -> str | None:
    """The file ``import name`` would load (its own file if imported), without importing anything."""
    module = sys.modules.get(name)
    if module is not None:
        return getattr(module, "__file__", None)
    parts = name.split(".")
    path: list[str] | None = None
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        loaded = sys.modules.get(prefix)
        if loaded is not None and depth < len(parts):
            path = list(getattr(loaded, "__path__", None) or [])
            if not path:
                return None
            continue
        try:
            spec = importlib.machinery.PathFinder.find_spec(prefix, path)
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        if depth == len(parts):
            return spec.origin if spec.has_location else None
        path = list(spec.submodule_search_locations or [])
        if not path:
            return None
    return None


def _object_evidence(module: ModuleType, name: str) -> tuple[str | None, str]:
    """For an imported module whose source cannot be read: what it defines."""
    if name == GENERATOR:
        if hasattr(module, "get_request_block_hasher"):
            return "0.4.0.1", "imports get_request_block_hasher"
        return None, "no readable source"
    ext = getattr(module, "HiddenStatesWorkerExtension", None)
    if ext is not None and hasattr(ext, "_set_request_metadata"):
        return "0.4.0.1", "defines _set_request_metadata"
    if hasattr(module, "supports_eagle3"):
        return "0.3.0", "imports supports_eagle3"
    return None, "no readable source"


_cache: dict[tuple, LineVerdict] = {}
_told: set[tuple] = set()
_lock = threading.Lock()


def judge_line() -> LineVerdict:
    """The speculators line of the code this process imports (or would import), judged as the module says."""
    found: list[tuple[str, str | None, float]] = []
    for name in MARKERS:
        path = _locate(name)
        loaded = sys.modules.get(name)
        if path is None and loaded is None:
            continue
        try:
            stamp = os.stat(path).st_mtime if path else 0.0
        except OSError:
            stamp = 0.0
        found.append((name, path, stamp))
    version = installed_version("speculators")
    key = (tuple(found), str(version) if version else None, tuple(n in sys.modules for n in MARKERS))
    with _lock:
        verdict = _cache.get(key)
        if verdict is None:
            verdict = _cache[key] = _judge(found, str(version) if version else None)
        if key not in _told:
            _told.add(key)
            _tell(verdict)
    return verdict


def _judge(found: list[tuple[str, str | None, float]], version: str | None) -> LineVerdict:
    code: list[tuple[str, str, str | None, str]] = []
    for name, path, _ in found:
        line, shows = None, "no readable source"
        text = None
        if path and path.endswith(".py"):
            try:
                with open(path, encoding="utf-8") as handle:
                    text = handle.read()
            except (OSError, UnicodeDecodeError):
                text = None
        if text is not None:
            line, shows = judge_text(name, text)
        elif name in sys.modules:
            line, shows = _object_evidence(sys.modules[name], name)
            if line is None:
                continue  # no source and nothing telling defined: no evidence either way
        else:
            continue  # compiled-only and not imported yet: nothing to read
        code.append((name, path or "?", line, shows))
    if not code:
        line = speculators_line(version)
        return LineVerdict(line, "metadata" if line else "absent", version)
    lines = {line for _, _, line, _ in code}
    if len(lines) == 1 and None not in lines:
        return LineVerdict(lines.pop(), "code", version, tuple(code))
    return LineVerdict(None, "unknown", version, tuple(code))


def _tell(verdict: LineVerdict) -> None:
    if verdict.how == "code" and verdict.metadata_version and verdict.metadata_line != verdict.line:
        logger.warning(
            "vllm-compat: the speculators code Python imports is the %s line (%s), but the installed metadata says "
            "speculators %s; the code wins: applying the %s line's adapters",
            verdict.line,
            ", ".join(path for _, path, _, _ in verdict.code),
            verdict.metadata_version,
            verdict.line,
        )
    elif verdict.unknown:
        logger.error("vllm-compat: cannot tell which speculators line this code is: %s", verdict.seen())
