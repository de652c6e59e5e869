"""Rendering a plan for people (a table) and machines (JSON, schema in docs/json-report.md)."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence

from vllm_compat.findings import Finding, State
from vllm_compat.plan import Plan
from vllm_compat.proof import Proof
from vllm_compat.versions import VLLM_SERVED, line_kind, served_range

__all__ = ["render_json", "render_table"]

SERVED = f"{VLLM_SERVED[0].rsplit('.', 1)[0]} to {VLLM_SERVED[1].rsplit('.', 1)[0]}"  # "0.11 to 0.34"


def render_json(
    plan: Plan,
    speculators_installed: str | None,
    strict: bool,
    judged: str | None = None,
    line_unknown: bool = False,
    proofs: Sequence[Proof] = (),
    refused: str | None = None,
) -> str:
    """The JSON report; ``judged`` says how the speculators line was chosen; with ``line_unknown`` (the speculators
    code matches neither line, so the generator's guard would stop) or ``refused`` (why the proof is refused:
    vllm_compat.proof.refusal) it is not ok."""
    data = plan.to_json(speculators_installed, strict)
    if judged is not None:
        data["speculators_judged"] = judged
    data["vllm_range"] = served_range(plan.vllm_version)
    data["proof"] = [p.to_json() for p in proofs]
    data["refused_unproven"] = refused is not None
    data["ok"] = bool(data["ok"]) and not line_unknown and refused is None
    return json.dumps(data, indent=2, sort_keys=False)


def render_table(
    plan: Plan,
    origin: str,
    strict: bool,
    verbose: bool = False,
    judged: str | None = None,
    line_unknown: bool = False,
    show_all: bool = False,
    proofs: Sequence[Proof] = (),
    refused: str | None = None,
) -> str:
    """The report for people: the verdict first, then the rows that need a look (drifted, unknown); ``show_all``
    adds the baseline rows, ``verbose`` their details too."""
    passes = plan.passes(strict) and not line_unknown and not refused
    out = [f"vllm-compat probe: vLLM {plan.vllm_version or '?'} ({origin})"]
    out += _verdict(plan, strict, passes, line_unknown, refused)
    out += [
        textwrap.fill(f"proof, speculators {p.line}: {p.detail}", width=118, subsequent_indent="    ") for p in proofs
    ]
    if judged is not None:
        out.append(f"speculators: {judged}")
    out.append(f"model families judged: {', '.join(plan.families)}{_families_hint(plan)}")
    rows = [f for f in plan.findings if show_all or f.state is not State.BASELINE]
    width = max([len(f.probe) for f in rows] + [len("PROBE")]) + 1  # the longest name shown, whole
    for line in plan.lines:
        findings = [f for f in plan.findings if f.speculators == line]
        shown = [f for f in findings if show_all or f.state is not State.BASELINE]
        baseline = sum(f.state is State.BASELINE for f in findings)
        drifted = [f for f in findings if f.state is State.DRIFTED]
        unknown = sum(f.state is State.UNKNOWN for f in findings)
        out.append("")
        out.append(
            f"speculators {line}: {len(findings)} facts: {baseline} as speculators expects, {len(drifted)} drifted "
            f"({sum(f.handled for f in drifted)} covered by an adapter), {unknown} unknown"
        )
        if not shown:
            continue
        out.append(f"  {'PROBE':<{width}} {'STATE':<9} COVERED BY")
        for f in shown:
            out.append(f"  {f.probe:<{width}} {f.state!s:<9} {_cover(f)}")
            if verbose or f.state is not State.BASELINE:
                out += _details(f)
    if not show_all and any(f.state is State.BASELINE for f in plan.findings):
        out.append("")
        out.append("baseline rows (vLLM has what speculators expects) are left out: --all lists them, -v with details")
    return "\n".join(out)


def _verdict(plan: Plan, strict: bool, passes: bool, line_unknown: bool, refused: str | None = None) -> list[str]:
    """The verdict and, where it fails, what is not covered and what to do."""
    drift = [f for f in plan.findings if f.state is State.DRIFTED]
    covered = [f for f in drift if f.handled]
    counts = (
        f"{len(_probes(drift))} drifted ({len(_probes(covered))} covered by adapters, "
        f"{len(_probes(plan.unhandled_drift))} unhandled), {len(_probes(plan.unknown))} unknown"
    )
    strictly = " (strict: unknown counts as unhandled)" if strict else ""
    if refused:
        strictly += "; failed end to end" if refused == "failed" else "; not proven end to end"
    lines = [f"verdict: {'OK' if passes else 'FAIL'}: {counts}{strictly}"]
    where = served_range(plan.vllm_version)
    notes = []
    if where == "older":
        notes.append(
            f"vLLM {plan.vllm_version} is older than the releases vllm-compat serves ({SERVED}): speculators 0.3.0 was "
            "built for vLLM 0.11.0 and 0.4.0.1 for 0.12 to 0.16; use one of those or a later release"
        )
    elif where == "newer":
        notes.append(
            f"vLLM {plan.vllm_version} is newer than the releases the probes were checked against ({SERVED}): "
            "judged on its code by the same probes"
        )
    if refused == "failed":
        notes.append(
            "refused: an end-to-end run of this release failed (see 'proof' below; docs/compatibility.md has what "
            "failed): pin a release that passed, or, to accept the judgement of its code alone, --allow-code-only"
        )
    elif refused:
        notes.append(
            "refused: --strict accepts only what was proven end to end, and this release was not (see 'proof' below). "
            "Prove it: run speculators' own data_generation_offline.py through `vllm-compat run` on a small model and "
            "judge the states (from a checkout of vllm-compat: `python scripts/e2e_matrix.py --cells LINE@VERSION` "
            "where vLLM has a CPU build; docs/ci.md says how), or accept the judgement of its code with "
            "--allow-code-only"
        )
    if line_unknown:
        notes.append(
            "the speculators code matches neither line vllm-compat serves (see 'speculators:' below): the "
            "generator's guard would stop the run"
        )
    if not plan.passes(strict):
        failing = plan.failing(strict)
        notes.append(f"not covered: {', '.join(sorted({f'{f.probe} ({f.symbol})' for f in failing}))}")
        notes.append(
            "what to do: each row below says what speculators expects and what this vLLM has (observed, with "
            "file:line). Pin a vLLM release this report passes, or upgrade vllm-compat; a new adapter must cover "
            "the observed variant."
        )
        native = [line for line in plan.lines if line_kind(line) == "native"]
        if native and any(f.speculators in native for f in failing):
            notes.append(
                f"{', '.join(native)}: speculators extracts through `vllm serve` (extract_hidden_states and a "
                "hidden-states KV connector), and vllm-compat adapts only one thing there (the connector's CUDA-only "
                "copy on vLLM's CPU platform, native-connector-on-cpu): pin a vLLM release this report passes for the "
                "line (docs/compatibility.md, 'speculators 0.5 to 0.9')."
            )
    for note in notes:
        if note.startswith("not covered: "):  # one line, whole: names to search for, not prose
            lines.append(f"  {note}")
        else:
            lines.append(textwrap.fill(note, width=116, initial_indent="  ", subsequent_indent="    "))
    return lines


def _probes(findings: list[Finding]) -> set[str]:
    return {f.probe for f in findings}


def _families_hint(plan: Plan) -> str:
    from vllm_compat.plan import load_probes

    known = {p.family for p in load_probes().values() if p.family}
    return "" if known <= set(plan.families) else " (others: --model PATH, --family NAME or --family all)"


def _cover(f: Finding) -> str:
    if f.state is State.BASELINE:
        return "-"
    if f.adapter:
        return f.adapter
    return "UNKNOWN" if f.state is State.UNKNOWN else "UNHANDLED"


def _details(f: Finding) -> list[str]:
    out = []
    for label, text in (("expected", f.expected), ("observed", f.observed), ("evidence", f.evidence)):
        if text:
            out.append(textwrap.fill(text, width=110, initial_indent=f"      {label}: ", subsequent_indent=" " * 16))
    return out
