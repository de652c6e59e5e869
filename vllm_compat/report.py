"""Rendering a plan for people (a table) and machines (JSON, schema in docs/json-report.md)."""

from __future__ import annotations

import json
import textwrap

from vllm_compat.findings import State
from vllm_compat.plan import Plan

__all__ = ["render_json", "render_table"]


def render_json(
    plan: Plan, speculators_installed: str | None, strict: bool, judged: str | None = None, line_unknown: bool = False
) -> str:
    """The JSON report; ``judged`` says how the speculators line was chosen; with ``line_unknown`` (the speculators
    code matches neither line, so the generator's guard would stop) it is not ok."""
    data = plan.to_json(speculators_installed, strict)
    if judged is not None:
        data["speculators_judged"] = judged
    data["ok"] = bool(data["ok"]) and not line_unknown
    return json.dumps(data, indent=2, sort_keys=False)


def render_table(
    plan: Plan,
    origin: str,
    strict: bool,
    verbose: bool = False,
    judged: str | None = None,
    line_unknown: bool = False,
) -> str:
    out = [f"vllm-compat probe: vLLM {plan.vllm_version or '?'} ({plan.source}: {origin})"]
    out.append(f"model families judged: {', '.join(plan.families)} (--model or --family all for others)")
    if judged is not None:
        out.append(f"speculators: {judged}")
    for line in plan.lines:
        findings = [f for f in plan.findings if f.speculators == line]
        out.append("")
        out.append(f"speculators {line}: {len(findings)} facts")
        out.append(f"  {'PROBE':<44} {'STATE':<9} COVERED BY")
        for f in findings:
            if f.state is State.BASELINE:
                cover = "-"
            elif f.adapter:
                cover = f.adapter
            else:
                cover = "UNKNOWN" if f.state is State.UNKNOWN else "UNHANDLED"
            out.append(f"  {f.probe:<44} {f.state!s:<9} {cover}")
            if verbose or f.state is not State.BASELINE:
                for label, text in (
                    ("expected", f.expected),
                    ("observed", f.observed),
                    ("evidence", f.evidence),
                ):
                    if text:
                        out.append(
                            textwrap.fill(
                                text,
                                width=110,
                                initial_indent=f"      {label}: ",
                                subsequent_indent=" " * 16,
                            )
                        )
    drift = [f for f in plan.findings if f.state is State.DRIFTED]
    covered = [f for f in drift if f.handled]
    out.append("")
    passes = plan.passes(strict) and not line_unknown
    if line_unknown:
        out.append(
            "not covered: the speculators code matches neither line vllm-compat serves (see 'speculators:' above); "
            "the generator's guard would stop the run"
        )
    if not plan.passes(strict):
        failing = plan.failing(strict)
        out.append(f"not covered: {', '.join(sorted({f'{f.probe} ({f.symbol})' for f in failing}))}")
        out.append(
            "what to do: each row above says what speculators expects and what this vLLM has (observed, with "
            "file:line). Pin a vLLM release this report passes, or upgrade vllm-compat; a new adapter must cover "
            "the observed variant."
        )
    verdict = (
        f"verdict: {len(drift)} drifted ({len(covered)} covered, {len(plan.unhandled_drift)} unhandled), "
        f"{len(plan.unknown)} unknown -> {'OK' if passes else 'FAIL'}"
    )
    out.append(verdict + (" (strict: unknown counts as unhandled)" if strict else ""))
    return "\n".join(out)
