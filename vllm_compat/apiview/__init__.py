"""Read-only views of one vLLM: the installed one (LiveView) or a source tree or wheel (StaticView).

Probes are written once against :class:`ApiView`; both implementations answer the same questions
with the same value types, so a finding computed from a wheel equals the finding computed from the
same release once it is installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["ApiView", "Location", "Param", "Source", "split_dotted"]


@dataclass(frozen=True)
class Location:
    """Where a symbol is defined: the defining module (after following re-exports) and file:line."""

    module: str
    qualname: str
    kind: str  # "class" | "function" | "attribute" | "module"
    file: str | None  # path relative to the folder holding the top-level package, e.g. vllm/config/x.py
    line: int | None

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.qualname}" if self.qualname else self.module

    def evidence(self) -> str:
        where = f"{self.file}:{self.line}" if self.file and self.line else (self.file or "?")
        return f"{self.dotted} ({where})"


@dataclass(frozen=True)
class Param:
    """One parameter of a callable; for a class, of its constructor (``self`` left out)."""

    name: str
    kind: str  # "positional_only" | "positional_or_keyword" | "var_positional" | "keyword_only" | "var_keyword"
    required: bool
    default: str | None = None  # source text (static) or repr (live); display only
    annotation: str | None = None


@dataclass(frozen=True)
class Source:
    """The text of a def or class, and where it starts."""

    text: str
    file: str | None
    line: int | None


class ApiView(Protocol):
    """The questions a probe may ask of one vLLM."""

    kind: str  # "live" | "static"

    def version(self) -> str | None:
        """The vLLM version this view shows, if it can tell."""

    def has_module(self, module: str) -> bool:
        """Whether ``module`` exists (importable, or present in the tree)."""

    def locate(self, dotted: str) -> Location | None:
        """Where ``dotted`` (``pkg.module.Name[.attr]``) is defined, following re-exports; None if absent."""

    def parameters(self, dotted: str) -> tuple[Param, ...] | None:
        """Call parameters of a function or class constructor; None if absent or not callable."""

    def source(self, dotted: str) -> Source | None:
        """Source text of a function or class; None if absent or unreadable."""

    def members(self, dotted: str) -> frozenset[str] | None:
        """Attribute names a class defines or inherits from classes the view can resolve."""


def split_dotted(dotted: str, is_module) -> tuple[str, list[str]] | None:
    """Split ``a.b.C.m`` into the longest module prefix accepted by ``is_module`` and the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if is_module(module):
            return module, parts[cut:]
    return None
