"""The drift watch: probe the newest vLLM release for every speculators line, keep the reports, fail on drift that no
adapter covers.

    python scripts/drift_watch.py [--source vllm] [--speculators 0.4.0.1 0.3.0] [--out drift-reports]

For each speculators line it runs ``vllm-compat probe --source SOURCE --speculators LINE --strict --json`` (the
first probe resolves ``vllm``, the newest release on the package index; the others probe that same release by its
version, so a release published mid-run does not split the verdict), writes each JSON report to ``--out`` with a
``summary.md``, prints the summary (and appends it to ``$GITHUB_STEP_SUMMARY`` in GitHub Actions), and exits

- 0: every drift is covered by an adapter, for every line;
- 1: some line has drift no adapter covers (the report's ``unhandled``), or a fact the probes could not establish
  (``unknown``, counted as unhandled as ``--strict`` does, and ``needed_unknown``);
- 2: a probe could not run (no network, no such release): nothing was judged.

A release without an end-to-end record is reported, not failed: the watch asks whether the code drifted. Where
``vllm-compat probe`` has an opt-in for judging such a release by its code alone (``--allow-code-only``), the watch
passes it. The verdict is taken from the report's keys, not from the probe's exit code (schema: docs/json-report.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

LINES = ("0.4.0.1", "0.3.0")
CODE_ONLY_FLAGS = ("--allow-code-only",)  # probe's opt-in for a release with no end-to-end record, where it exists
EXIT_OK, EXIT_DRIFT, EXIT_ERROR = 0, 1, 2


@dataclass
class LineResult:
    """One probe run: the speculators line, the probe's exit code, its report (None if it printed none)."""

    line: str
    returncode: int
    report: dict | None
    error: str = ""
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def judge(report: dict) -> tuple[list[str], list[str]]:
    """(failures, notes) of one JSON report: failures are drift no adapter covers and facts that could not be
    established; notes say what is worth knowing but fails nothing (no end-to-end record, a newer release)."""
    failures = []
    findings = report.get("findings") or []
    for probe in report.get("unhandled") or []:
        seen = [f for f in findings if f.get("probe") == probe and f.get("state") == "drifted" and not f.get("handled")]
        detail = f": {seen[0].get('observed')} ({seen[0].get('evidence')})" if seen else ""
        failures.append(f"UNHANDLED drift {probe}{detail}")
    needed = set(report.get("needed_unknown") or [])
    for probe in sorted(needed | set(report.get("unknown") or [])):
        why = "needed by the capture path" if probe in needed else "counted as unhandled (--strict)"
        failures.append(f"UNKNOWN {probe} ({why})")
    notes = []
    for proof in report.get("proof") or []:  # the end-to-end record, where the report carries one
        if isinstance(proof, dict):
            state = "proven end to end" if proof.get("proven") else f"NOT proven end to end ({proof.get('level')})"
            notes.append(f"{state}: {proof.get('detail')}")
        else:
            notes.append(f"end-to-end record: {json.dumps(proof)}")
    if report.get("refused_unproven"):
        notes.append("probe --strict refused the release for want of an end-to-end record; the watch judges its code")
    if report.get("vllm_range") == "newer" and not notes:
        notes.append(
            f"vLLM {report.get('vllm_version')} has no end-to-end record (newer than the releases tested end to "
            "end): judged on its code only"
        )
    covered = sorted(
        {f.get("adapter") for f in findings if f.get("state") == "drifted" and f.get("handled") and f.get("adapter")}
    )
    if covered:
        notes.append(f"drift covered by: {', '.join(covered)}")
    return failures, notes


def exit_code(results: list[LineResult]) -> int:
    if any(r.report is None for r in results):
        return EXIT_ERROR
    return EXIT_DRIFT if any(r.failures for r in results) else EXIT_OK


def summary(results: list[LineResult]) -> str:
    versions = sorted({str(r.report.get("vllm_version")) for r in results if r.report})
    code = exit_code(results)
    verdict = {EXIT_OK: "OK", EXIT_DRIFT: "FAIL: drift no adapter covers", EXIT_ERROR: "ERROR: not judged"}[code]
    out = [f"# vllm-compat drift watch: vLLM {', '.join(versions) or '?'}: {verdict}", ""]
    for r in results:
        if r.report is None:
            out.append(f"- speculators {r.line}: probe failed (exit {r.returncode}): {r.error}")
            continue
        state = "FAIL" if r.failures else "OK"
        out.append(f"- speculators {r.line}: {state} (probe exit {r.returncode})")
        out += [f"  - {text}" for text in r.failures]
        out += [f"  - note: {text}" for text in r.notes]
    return "\n".join(out) + "\n"


def probe_command(probe: list[str], source: str, line: str, extra: list[str]) -> list[str]:
    return [*probe, "probe", "--source", source, "--speculators", line, "--strict", "--json", *extra]


def code_only_flags(probe: list[str], run=None) -> list[str]:
    """The opt-in flags ``vllm-compat probe --help`` offers for judging a release by its code alone."""
    done = (run or subprocess.run)([*probe, "probe", "--help"], capture_output=True, text=True, check=False)
    return [flag for flag in CODE_ONLY_FLAGS if flag in (done.stdout or "")]


def watch(source: str, lines: list[str], out: Path, probe: list[str], run=None) -> list[LineResult]:
    """Run the probes (``run`` stands in for ``subprocess.run`` in tests) and write the reports into ``out``."""
    run = run or subprocess.run
    out.mkdir(parents=True, exist_ok=True)
    extra = code_only_flags(probe, run)
    results = []
    for line in lines:
        done = run(probe_command(probe, source, line, extra), capture_output=True, text=True, check=False)
        try:
            report = json.loads(done.stdout)
        except (json.JSONDecodeError, TypeError):
            report = None
        error = ((done.stderr or "").strip().splitlines() or [f"no report (exit {done.returncode})"])[-1]
        result = LineResult(line, done.returncode, report if isinstance(report, dict) else None, error)
        if result.report is not None:
            result.failures, result.notes = judge(result.report)
            version = result.report.get("vllm_version")
            name = f"drift-vllm-{version or 'unknown'}-speculators-{line}.json"
            (out / name).write_text(json.dumps(result.report, indent=2) + "\n")
            if source.strip() == "vllm" and version:
                source = f"vllm=={version}"  # every line judges the release the first probe chose
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="vllm", help="what to probe (default: vllm, the newest release)")
    parser.add_argument("--speculators", nargs="+", default=list(LINES), metavar="LINE")
    parser.add_argument("--out", type=Path, default=Path("drift-reports"), help="folder for the JSON reports")
    parser.add_argument(
        "--probe", default=f"{sys.executable} -m vllm_compat.cli", help="the vllm-compat command (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    results = watch(args.source, args.speculators, args.out, args.probe.split())
    text = summary(results)
    (args.out / "summary.md").write_text(text)
    print(text, end="")
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a", encoding="utf-8") as fh:
            fh.write(text)
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
