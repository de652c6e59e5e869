"""Observations, probes and findings: the facts a plan is made from."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from vllm_compat.apiview import ApiView

__all__ = ["BASELINE", "UNKNOWN", "Finding", "Observation", "Probe", "State", "probe"]

logger = logging.getLogger("vllm_compat")

BASELINE = "baseline"  # the variant a probe reports when vLLM has what the speculators line expects
UNKNOWN = "unknown"


class State(str, Enum):
    BASELINE = "baseline"
    DRIFTED = "drifted"
    UNKNOWN = "unknown"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Observation:
    """What a probe saw in one vLLM: a short variant name, a sentence, and where it saw it."""

    variant: str
    observed: str
    evidence: tuple[str, ...] = ()
    per_line: Mapping[str, str] = field(default_factory=dict)  # a variant that differs by line

    def variant_for(self, line: str) -> str:
        return self.per_line.get(line, self.variant)

    @classmethod
    def unknown(cls, why: str, *evidence: str) -> Observation:
        return cls(UNKNOWN, f"could not tell: {why}", tuple(evidence))


@dataclass(frozen=True)
class Probe:
    """One API fact that speculators relies on.

    ``expected`` maps each speculators line that touches this fact to what it expects;
    ``accepts`` maps it to the variants that line runs with unchanged (default: ``baseline``).
    ``observe`` is a pure function of an ApiView.
    """

    id: str
    symbol: str
    summary: str
    expected: Mapping[str, str]
    observe: Callable[[ApiView], Observation]
    accepts: Mapping[str, frozenset[str]] = field(default_factory=dict)
    surface: str = ""  # the vLLM surface (module of probes/) this fact belongs to
    family: str = ""  # the model family a model-side fact is about ("" for facts every model meets)

    def applies_to(self, line: str) -> bool:
        return line in self.expected

    def state_for(self, line: str, obs: Observation) -> State:
        variant = obs.variant_for(line)
        if variant == UNKNOWN:
            return State.UNKNOWN
        accepted = self.accepts.get(line, frozenset({BASELINE}))
        return State.BASELINE if variant in accepted else State.DRIFTED

    def run(self, view: ApiView) -> Observation:
        """Observe, turning a probe's own failure into an ``unknown`` observation (never a crash)."""
        try:
            return self.observe(view)
        except Exception as exc:  # a probe must never take the report down with it
            logger.debug("probe %s failed", self.id, exc_info=True)
            return Observation.unknown(f"the probe failed on this source ({type(exc).__name__}: {exc})")


@dataclass(frozen=True)
class Finding:
    """A probe's verdict for one speculators line, and the adapter that covers it, if any."""

    probe: str
    symbol: str
    speculators: str
    state: State
    expected: str
    observed: str
    variant: str
    evidence: str
    adapter: str | None
    handled: bool

    def to_json(self) -> dict[str, object]:
        return {
            "probe": self.probe,
            "symbol": self.symbol,
            "speculators": self.speculators,
            "state": str(self.state),
            "variant": self.variant,
            "expected": self.expected,
            "observed": self.observed,
            "evidence": self.evidence,
            "adapter": self.adapter,
            "handled": self.handled,
        }


_REGISTRY: dict[str, Probe] = {}


def probe(
    id: str,
    *,
    symbol: str,
    summary: str,
    expected: Mapping[str, str],
    accepts: Mapping[str, set[str] | frozenset[str]] | None = None,
    family: str = "",
) -> Callable[[Callable[[ApiView], Observation]], Probe]:
    """Register ``fn(view) -> Observation`` as a probe. Used as a decorator in ``probes/``.

    ``family`` names the model family (probes/model.py) a model-side fact is about; a plan judges a family's
    facts only when that family is asked for (see ``make_plan``).
    """

    def register(fn: Callable[[ApiView], Observation]) -> Probe:
        if id in _REGISTRY:
            raise ValueError(f"duplicate probe id {id!r}")
        surface = fn.__module__.rsplit(".", 1)[-1]
        made = Probe(
            id=id,
            symbol=symbol,
            summary=summary,
            expected=dict(expected),
            observe=fn,
            accepts={k: frozenset(v) for k, v in (accepts or {}).items()},
            surface=surface,
            family=family,
        )
        _REGISTRY[id] = made
        return made

    return register


def registered_probes() -> dict[str, Probe]:
    return _REGISTRY
