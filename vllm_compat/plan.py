"""Plan: run the probes on one vLLM and decide, per speculators line, what to adapt."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from vllm_compat.adapter import Adapter, load_adapters
from vllm_compat.apiview import ApiView
from vllm_compat.findings import Finding, Observation, Probe, State, registered_probes

__all__ = ["ALL_FAMILIES", "DEFAULT_FAMILIES", "Plan", "judge", "load_probes", "make_plan"]

SCHEMA_VERSION = 1
# Model-side facts come per model family (probes/model.py). A plan judges the families it is asked for; without a
# model to go by, the Llama family: the decoder speculators' worker extension was written against.
DEFAULT_FAMILIES: tuple[str, ...] = ("llama",)
ALL_FAMILIES = "all"


def load_probes() -> dict[str, Probe]:
    """Import every module of ``vllm_compat.probes`` (none imports vLLM or torch)."""
    package = importlib.import_module("vllm_compat.probes")
    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{info.name}")
    return registered_probes()


@dataclass
class Plan:
    """Findings for some speculators lines on one vLLM, and the adapters they call for."""

    vllm_version: str | None
    source: str  # "live" | "static"
    lines: tuple[str, ...]
    findings: list[Finding] = field(default_factory=list)
    families: tuple[str, ...] = DEFAULT_FAMILIES  # the model families whose facts were judged

    @property
    def unhandled(self) -> list[Finding]:
        """Drift no adapter covers, and facts the probes could not establish (fail closed)."""
        return [f for f in self.findings if f.state is not State.BASELINE and not f.handled]

    @property
    def unhandled_drift(self) -> list[Finding]:
        return [f for f in self.findings if f.state is State.DRIFTED and not f.handled]

    @property
    def unknown(self) -> list[Finding]:
        return [f for f in self.findings if f.state is State.UNKNOWN]

    def passes(self, strict: bool) -> bool:
        """No unhandled drift; with ``strict``, no unknown finding either."""
        return not (self.unhandled if strict else self.unhandled_drift)

    @property
    def adapters(self) -> list[str]:
        seen: dict[str, None] = {}
        for f in self.findings:
            if f.adapter and f.handled:
                seen.setdefault(f.adapter, None)
        return list(seen)

    @property
    def ok(self) -> bool:
        return not self.unhandled

    def to_json(self, speculators_installed: str | None = None, strict: bool = False) -> dict[str, object]:
        return {
            "schema_version": SCHEMA_VERSION,
            "vllm_version": self.vllm_version,
            "speculators_version": speculators_installed or (self.lines[0] if len(self.lines) == 1 else None),
            "speculators_lines": list(self.lines),
            "source": self.source,
            "families": list(self.families),
            "findings": [f.to_json() for f in self.findings],
            "adapters": self.adapters,
            "unhandled": sorted({f.probe for f in self.unhandled_drift}),
            "unknown": sorted({f.probe for f in self.unknown}),
            "strict": strict,
            "ok": self.passes(strict),
        }


def judge(probe: Probe, obs: Observation, line: str, adapters: Iterable[type[Adapter]]) -> Finding:
    """One probe's observation, judged for one speculators line."""
    state = probe.state_for(line, obs)
    adapter_id = None
    if state is State.DRIFTED:
        for adapter in adapters:
            if adapter.serves(line) and adapter.covers_variant(probe.id, obs.variant_for(line)):
                adapter_id = adapter.id
                break
    return Finding(
        probe=probe.id,
        symbol=probe.symbol,
        speculators=line,
        state=state,
        expected=probe.expected[line],
        observed=obs.observed,
        variant=obs.variant_for(line),
        evidence="; ".join(obs.evidence),
        adapter=adapter_id,
        handled=state is State.BASELINE or adapter_id is not None,
    )


def make_plan(
    view: ApiView,
    lines: Sequence[str],
    probe_ids: Iterable[str] | None = None,
    cache: dict[str, Observation] | None = None,
    families: Iterable[str] | str | None = None,
) -> Plan:
    """Run the probes (all, or ``probe_ids``) once and judge them for every line in ``lines``.

    ``cache`` (probe id -> observation) lets a process observe each fact at most once. ``families`` picks the
    model families whose facts are judged (default ``DEFAULT_FAMILIES``; ``"all"`` for every family); probes
    named in ``probe_ids`` are judged whatever their family.
    """
    probes = load_probes()
    adapters = list(load_adapters().values())
    known = list(dict.fromkeys(p.family for p in probes.values() if p.family))
    if families == ALL_FAMILIES:
        chosen = tuple(known)
    else:
        chosen = tuple(dict.fromkeys(DEFAULT_FAMILIES if families is None else families))
        strangers = [f for f in chosen if f not in known]
        if strangers and families is not None and probe_ids is None:
            raise ValueError(f"unknown model families {strangers}; known: {', '.join(known)}")
    if probe_ids is not None:
        wanted = list(probe_ids)
    else:
        wanted = [pid for pid, p in probes.items() if not p.family or p.family in chosen]
    plan = Plan(vllm_version=view.version(), source=view.kind, lines=tuple(lines), families=chosen)
    for probe_id in wanted:
        probe = probes[probe_id]
        if not any(probe.applies_to(line) for line in lines):
            continue
        obs = cache.get(probe_id) if cache is not None else None
        if obs is None:
            obs = probe.run(view)
            if cache is not None:
                cache[probe_id] = obs
        for line in lines:
            if probe.applies_to(line):
                plan.findings.append(judge(probe, obs, line, adapters))
    return plan
