"""Typed errors: each says what happened and what to do."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_compat.findings import Finding

__all__ = ["AdapterError", "SourceError", "SpeculatorsLineUnknown", "UnhandledDrift", "VllmCompatError"]


class VllmCompatError(RuntimeError):
    """Base class of every error vllm-compat raises."""


class SourceError(VllmCompatError):
    """A vLLM to probe could not be found or read (a bad path, wheel or release name)."""


class AdapterError(VllmCompatError):
    """An adapter met a shape it does not know while it ran: fail closed rather than guess."""


class UnhandledDrift(VllmCompatError):
    """vLLM drifted in a way no adapter covers; running on would risk wrong hidden states."""

    def __init__(self, findings: Iterable[Finding], where: str | None = None) -> None:
        self.findings = tuple(findings)
        self.where = where
        super().__init__(self._message())

    def _message(self) -> str:
        head = "vLLM API drift that vllm-compat does not cover"
        if self.where:
            head += f" (stopped before {self.where})"
        lines = [head + ":"]
        for f in self.findings:
            lines.append(
                f"  - probe {f.probe} [{f.state}] {f.symbol}: expected {f.expected}; found {f.observed}"
                + (f" ({f.evidence})" if f.evidence else "")
            )
        lines.append(
            "What to do: run `vllm-compat probe` for the full report; pin a vLLM release that "
            "`vllm-compat probe --strict` accepts, or upgrade vllm-compat. Nothing was loaded."
        )
        return "\n".join(lines)


class SpeculatorsLineUnknown(UnhandledDrift):
    """The speculators code that runs matches neither line vllm-compat serves, so no set of adapters is known to fit.

    A subclass of :class:`UnhandledDrift`: code that stops on unhandled drift stops on this too.
    """

    def __init__(self, seen: str, where: str | None = None) -> None:
        self.seen = seen
        super().__init__((), where=where)

    def _message(self) -> str:
        head = "vllm-compat cannot tell which speculators line this code is"
        if self.where:
            head += f" (stopped before {self.where})"
        return (
            f"{head}: {self.seen}. vllm-compat adapts speculators 0.3.x (judged as 0.3.0) and 0.4.x (judged as "
            "0.4.0.1), recognised by what their generator and worker modules call. What to do: make sure Python "
            'imports one unmodified speculators 0.3.x or 0.4.x (check PYTHONPATH and `python -c "import '
            'speculators; print(speculators.__file__)"`), or report this message. Nothing was loaded.'
        )
