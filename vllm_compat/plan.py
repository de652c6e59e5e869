"""Plan: run the probes on one vLLM and decide, per speculators line, what to adapt."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from vllm_compat import runners
from vllm_compat.adapter import Adapter, load_adapters
from vllm_compat.apiview import ApiView
from vllm_compat.findings import UNKNOWN, Finding, Observation, Probe, State, registered_probes
from vllm_compat.runners import RUNNER_PROBE, RunnerChoice, facts_hold

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
    # (probe id, line) of facts a capture path needs and that kept every path out: an unknown one among them fails
    # the plan without strict mode too (the runner choice, vllm_compat/runners.py)
    needed: set[tuple[str, str]] = field(default_factory=set)

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

    @property
    def needed_unknown(self) -> list[Finding]:
        """Unknown facts the plan cannot do without: no capture path could be chosen because of them."""
        return [f for f in self.unknown if (f.probe, f.speculators) in self.needed]

    def failing(self, strict: bool) -> list[Finding]:
        """What fails the plan: unhandled drift and needed unknown facts; with ``strict``, every unknown fact too."""
        if strict:
            return self.unhandled
        return [f for f in self.findings if f in self.unhandled_drift or f in self.needed_unknown]

    def passes(self, strict: bool) -> bool:
        """No unhandled drift and no needed unknown fact; with ``strict``, no unknown finding at all."""
        return not self.failing(strict)

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
            "needed_unknown": sorted({f.probe for f in self.needed_unknown}),
            "strict": strict,
            "ok": self.passes(strict),
        }


class _Observations(Mapping[str, Observation]):
    """Observations made on first use, at most once (through ``cache``): the facts an adapter relies on are observed
    only when that adapter is weighed for a drift. (Observing more, earlier, could import vLLM modules from a hook
    that runs while vLLM itself is still being imported.)"""

    def __init__(self, view: ApiView, probes: Mapping[str, Probe], cache: dict[str, Observation] | None) -> None:
        self.view, self.probes = view, probes
        self.cache = cache if cache is not None else {}

    def __getitem__(self, probe_id: str) -> Observation:
        if probe_id not in self.cache:
            if probe_id not in self.probes:
                raise KeyError(probe_id)
            self.cache[probe_id] = self.probes[probe_id].run(self.view)
        return self.cache[probe_id]

    def __iter__(self):
        return iter(self.cache)

    def __len__(self) -> int:
        return len(self.cache)


def judge(
    probe: Probe,
    obs: Observation,
    line: str,
    adapters: Iterable[type[Adapter]],
    observations: Mapping[str, Observation] | None = None,
    excluded: frozenset[str] = frozenset(),
) -> Finding:
    """One probe's observation, judged for one speculators line.

    A drift is covered by the first adapter (registry order) that serves the line, covers the variant, is not in
    ``excluded`` (a runner adapter the runner choice did not take) and whose ``relies_on`` facts hold in
    ``observations``. Where a covering adapter is passed over for a fact, the observed text says which.
    """
    state = probe.state_for(line, obs)
    adapter_id = None
    observed = obs.observed
    if state is State.DRIFTED:
        passed_over = []
        for adapter in adapters:
            if adapter.id in excluded or not adapter.serves(line):
                continue
            if not adapter.covers_variant(probe.id, obs.variant_for(line)):
                continue
            ok, failing = facts_hold(adapter.relies_on, observations if observations is not None else {}, line)
            if ok:
                adapter_id = adapter.id
                break
            passed_over.append(f"{adapter.id} relies on facts that do not hold: {', '.join(failing)}")
        if adapter_id is None and passed_over:
            observed = f"{observed} [{'; '.join(passed_over)}]"
    return Finding(
        probe=probe.id,
        symbol=probe.symbol,
        speculators=line,
        state=state,
        expected=probe.expected[line],
        observed=observed,
        variant=obs.variant_for(line),
        evidence="; ".join(obs.evidence),
        adapter=adapter_id,
        handled=state is State.BASELINE or adapter_id is not None,
    )


def judge_runner(probe: Probe, obs: Observation, line: str, choice: RunnerChoice) -> Finding:
    """The runner finding: which runner vLLM uses, and the capture path vllm-compat takes on it (runners.choose).

    Baseline where vLLM's own default runner is the one chosen and V1 (what speculators was written for); drifted and
    covered by the runner's adapter where vllm-compat pins a runner; unhandled (drifted, or unknown where the probe
    could not tell) where no runner's facts hold.
    """
    variant = obs.variant_for(line)
    if choice.runner is None:
        state = State.UNKNOWN if variant == UNKNOWN else State.DRIFTED
    elif choice.adapter is None:
        state = State.BASELINE
    else:
        state = State.DRIFTED
    return Finding(
        probe=probe.id,
        symbol=probe.symbol,
        speculators=line,
        state=state,
        expected=probe.expected[line],
        observed=f"{obs.observed}; {choice.why}",
        variant=variant,
        evidence="; ".join(obs.evidence),
        adapter=choice.adapter,
        handled=choice.runner is not None,
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
    named in ``probe_ids`` are judged whatever their family. The facts adapters rely on, and those the runner
    choice is made from (vllm_compat/runners.py), are observed too, and judged only where asked for.
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
    wanted = [pid for pid in wanted if any(probes[pid].applies_to(line) for line in lines)]
    plan = Plan(vllm_version=view.version(), source=view.kind, lines=tuple(lines), families=chosen)
    observations = _Observations(view, probes, cache)
    for line in lines:
        choice = None
        if RUNNER_PROBE in probes and probes[RUNNER_PROBE].applies_to(line) and set(wanted) & runners.RELATED:
            choice = runners.choose(observations, line)
        excluded = choice.excluded if choice is not None else frozenset()
        for probe_id in wanted:
            probe = probes[probe_id]
            if not probe.applies_to(line):
                continue
            if probe_id == RUNNER_PROBE and choice is not None:
                finding = judge_runner(probe, observations[probe_id], line, choice)
            else:
                finding = judge(probe, observations[probe_id], line, adapters, observations, excluded)
            plan.findings.append(finding)
        if choice is not None and choice.runner is None:
            plan.needed.update((probe_id, line) for probe_id in choice.blockers)
    # findings ordered as before: probe registration order, then line order
    order = {pid: i for i, pid in enumerate(wanted)}
    rank = {line: i for i, line in enumerate(lines)}
    plan.findings.sort(key=lambda f: (order[f.probe], rank[f.speculators]))
    return plan
