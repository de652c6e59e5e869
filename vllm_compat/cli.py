"""The ``vllm-compat`` command: ``probe`` reports drift (exit codes make it a CI guard); ``run`` runs a command with
vllm-compat active in every Python process it starts; ``status`` says what vllm-compat is and would do here."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from vllm_compat.errors import SourceError
from vllm_compat.lines import judge_line
from vllm_compat.proof import proof_for, refusal
from vllm_compat.versions import NATIVE_LINES, SPECULATORS_LINES, native_line, speculators_line

__all__ = ["main"]

EXIT_OK, EXIT_DRIFT, EXIT_USAGE = 0, 1, 2
EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND = 126, 127  # as POSIX shells report a command they cannot start
BOOTSTRAP = Path(__file__).resolve().parent / "_bootstrap"  # holds the sitecustomize that `run` puts on PYTHONPATH


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-compat",
        description="Keep speculators' in-process hidden-state extraction running across vLLM releases.",
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default: WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    probe = sub.add_parser(
        "probe",
        help="report vLLM API drift that speculators would hit, without loading a model",
        description=(
            "Exit codes: 0 every drift is covered by an adapter; 1 some drift is unhandled "
            "(with --strict: or some fact could not be established, or the release was not proven end to end); "
            "1 too where an end-to-end run of the release failed (--allow-code-only accepts both); 2 usage or "
            "environment error."
        ),
    )
    probe.add_argument(
        "--source",
        metavar="PATH|WHEEL|vllm==X|vllm",
        help="probe a vLLM source folder, a wheel, a release fetched from the package index, or with plain `vllm` "
        "the newest release there (default: the installed vLLM, read from its files without importing it)",
    )
    probe.add_argument(
        "--live",
        action="store_true",
        help="probe the installed vLLM by importing it (tens of seconds; the same findings as the default reading "
        "of its files, and it also proves vLLM imports). vLLM's own output goes to stderr",
    )
    probe.add_argument(
        "--speculators",
        metavar="VERSION",
        type=_speculators_version,
        help="the speculators release to judge for: any 0.3.x or 0.4.x version, judged as its in-process line (0.3.0 "
        "or 0.4.0.1), or any 0.5.x to 0.9.x version, judged as its native line (native-0.5 .. native-0.9: `vllm "
        "serve` with extract_hidden_states) (default: the line of the speculators code Python imports; the native "
        "line of an installed speculators 0.5+; else both in-process lines)",
    )
    probe.add_argument(
        "--family",
        action="append",
        metavar="NAME",
        help="a model family whose model-side facts to judge (repeatable; 'all' for every family; "
        "default: llama, or --model's families)",
    )
    probe.add_argument(
        "--model",
        metavar="PATH|HUB_ID",
        help="judge the model families of this model (the architectures in its config.json)",
    )
    probe.add_argument("--json", action="store_true", help="print the JSON report (docs/json-report.md)")
    probe.add_argument(
        "--strict",
        action="store_true",
        help="count unknown findings as unhandled, and refuse a release not proven end to end (see --allow-code-only)",
    )
    probe.add_argument(
        "--allow-code-only",
        action="store_true",
        help="accept a release judged by its code only: with --strict, one never run end to end; and one whose "
        "end-to-end run on record failed (refused otherwise, with or without --strict)",
    )
    probe.add_argument(
        "--all", action="store_true", dest="show_all", help="list the baseline facts too (by default: left out)"
    )
    probe.add_argument("-v", "--verbose", action="store_true", help="with --all, show the baseline facts' details")
    run = sub.add_parser(
        "run",
        help="run a command with vllm-compat active in it and in every Python process it starts",
        usage="vllm-compat run [--strict] -- COMMAND [ARGS...]",
        description=(
            "Runs COMMAND (e.g. `python data_generation_offline.py ...`) unchanged, with vllm-compat installed at "
            "start-up of every Python interpreter it starts, children included: a bootstrap sitecustomize is put "
            "first on PYTHONPATH (an existing sitecustomize still runs). COMMAND replaces this process (exec), so "
            "signals, process id and exit status are COMMAND's own (126/127 if it cannot be started)."
        ),
    )
    run.add_argument("--strict", action="store_true", help="stop at start-up (exit 1) on drift no adapter covers")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND", help="the command to run, after --")
    status = sub.add_parser(
        "status",
        help="say what vllm-compat is and would do here: versions, speculators line, worker route, flags",
        description=(
            "Prints vllm_compat.status() of this process, in words: the installed vLLM and speculators, the line "
            "judged, the route a generator built now would take to vLLM's workers, and what each flag means. No "
            "adapter is applied in this command's own process (it imports neither vLLM nor speculators); call "
            "vllm_compat.status() inside your script for what was applied there."
        ),
    )
    status.add_argument("--json", action="store_true", help="print the mapping as one JSON object")
    return parser


def _speculators_version(text: str) -> str:
    """``--speculators``: a version of a line vllm-compat serves (argparse reports anything else as a usage error)."""
    try:
        speculators_choice(text)
    except SourceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def speculators_choice(speculators: str | None) -> tuple[tuple[str, ...], str | None, str]:
    """The speculators lines to judge, the version to report, and how the line was chosen.

    ``speculators`` (``--speculators``) is any 0.3.x or 0.4.x version, judged as its in-process line, or any 0.5.x to
    0.9.x version, judged as its native line (vllm_compat/versions.py NATIVE_LINES). Without it, the line of the
    speculators code Python would import, judged as the generator's guard judges it (vllm_compat/lines.py: from the
    code, the metadata only where no code is found; nothing is imported); where no generator code is found and the
    installed speculators is 0.5 or later, its native line; both in-process lines where none can be told.
    Raises SourceError for a version outside every line.
    """
    if speculators is not None:
        from packaging.version import InvalidVersion

        try:
            line = speculators_line(speculators) or native_line(speculators)
        except InvalidVersion:
            line = None
        if line is None:
            raise SourceError(
                f"unknown speculators line {speculators!r}: vllm-compat serves speculators 0.3.x and 0.4.x (judged "
                f"as {' and '.join(SPECULATORS_LINES)}, the in-process generator) and 0.5.x to 0.9.x (judged as "
                f"{', '.join(NATIVE_LINES)}, extraction through `vllm serve`); give one of those versions"
            )
        if speculators == line:
            how = f"line {line}, as given (--speculators)"
        else:
            how = f"line {line} (--speculators {speculators}, judged as the {line} line)"
        return (line,), speculators, how
    verdict = judge_line()
    native = verdict.native
    if native is not None:
        how = (
            f"line {native} (speculators {verdict.metadata_version} installed, which extracts through `vllm serve`; "
            "no in-process generator code found)"
        )
        return (native,), verdict.metadata_version, how
    lines = (verdict.line,) if verdict.line else tuple(SPECULATORS_LINES)
    if verdict.how == "absent":
        how = (
            f"none found here (no speculators code or metadata), so both lines are judged ({' and '.join(lines)}); "
            "--speculators VERSION judges one"
        )
        return lines, verdict.metadata_version, how
    return lines, verdict.metadata_version, verdict.describe()


def probe_plan(source: str | None, speculators: str | None = None, families=None, live: bool = False):
    """The plan ``vllm-compat probe`` reports: ``source`` (None: the installed vLLM, read from its files; imported
    with ``live``) judged for ``speculators`` (a 0.3.x/0.4.x version, or 0.5.x to 0.9.x for its native line; None:
    as ``speculators_choice`` decides) and the model ``families`` (None: the default, "all", or names). Raises
    SourceError when there is nothing to probe."""
    from vllm_compat.plan import make_plan
    from vllm_compat.sources import open_view

    lines, _version, _how = speculators_choice(speculators)
    try:
        return make_plan(open_view(source, live=live), lines, families=families)
    except ValueError as exc:  # an unknown family name
        raise SourceError(str(exc)) from exc


def _families(args: argparse.Namespace):
    """The model families ``--family`` and ``--model`` ask for (None: the plan's default)."""
    from vllm_compat.models import architectures_of, model_families

    names = list(args.family or [])
    if "all" in names:
        return "all"
    if args.model:
        if architectures_of(args.model) is None:
            raise SourceError(f"cannot read the architectures of {args.model} (its config.json)")
        names += model_families(args.model) or []
    return names or None


def _probe(args: argparse.Namespace) -> int:
    from vllm_compat.report import render_json, render_table

    if args.live and args.source:
        raise SourceError("--live imports the installed vLLM; it does not go with --source")
    _lines, version, how = speculators_choice(args.speculators)
    families = _families(args)
    # Importing vLLM prints to stdout (its logger's default stream, and some prints), and may again at exit: the
    # report goes to the real stdout, and everything else in this process to stderr, from here on.
    report_to = _stdout_for_report_only() if args.live else sys.stdout
    from vllm_compat.sources import resolve_source

    args.source, args.source_note = resolve_source(args.source)  # `vllm`: the newest release, named once
    plan = probe_plan(args.source, args.speculators, families, live=args.live)
    # the generator's guard refuses code of no known line; the probe's verdict agrees with it
    line_unknown = args.speculators is None and judge_line().unknown
    proofs = [proof_for(plan.vllm_version, line) for line in plan.lines]
    refused = refusal(proofs, args.strict, args.allow_code_only)
    if args.json:
        text = render_json(plan, version, args.strict, judged=how, line_unknown=line_unknown, proofs=proofs,
                           refused=refused)  # fmt: skip
    else:
        text = render_table(
            plan, _origin(args, plan), args.strict, args.verbose, judged=how, line_unknown=line_unknown,
            show_all=args.show_all, proofs=proofs, refused=refused,
        )  # fmt: skip
    print(text, file=report_to, flush=True)
    return EXIT_OK if plan.passes(args.strict) and not line_unknown and refused is None else EXIT_DRIFT


def _status(args: argparse.Namespace) -> int:
    import json

    import vllm_compat

    status = vllm_compat.status()
    print(json.dumps(status, indent=2) if args.json else str(status), flush=True)
    return EXIT_OK


def _origin(args: argparse.Namespace, plan) -> str:
    if args.source:
        note = getattr(args, "source_note", None)
        return f"{plan.source}: {args.source}" + (f", {note}" if note else "")
    if args.live:
        return "installed, imported"
    from vllm_compat.sources import installed_vllm_folder

    return f"installed, read from {installed_vllm_folder()} without importing it"


def _stdout_for_report_only():
    """A stream on the process's real stdout; file descriptor 1 itself goes to stderr for the rest of the process, so
    whatever else writes to stdout (vLLM's logger, prints, C code, exit handlers) lands on stderr."""
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    return os.fdopen(real, "w", encoding="utf-8", closefd=True)


def run_environment(environ: dict[str, str] | None = None, strict: bool = False) -> dict[str, str]:
    """The environment ``vllm-compat run`` gives its command: the bootstrap folder first on PYTHONPATH (once).

    The other entries stay as they were, in order, empty ones included: Python reads an empty entry as the
    current directory."""
    from vllm_compat.engine import ENV_STRICT

    env = dict(os.environ if environ is None else environ)
    folder = str(BOOTSTRAP)
    current = env.get("PYTHONPATH", "")
    entries = [e for e in current.split(os.pathsep) if not e or os.path.abspath(e) != folder] if current else []
    env["PYTHONPATH"] = os.pathsep.join([folder, *entries])
    if strict:
        env[ENV_STRICT] = "1"
    return env


def _run(args: argparse.Namespace) -> int:
    """Replace this process with the command (``exec``), in the environment ``run_environment`` makes.

    The command then is the process its caller started: a terminal's Ctrl-C reaches it once (a wrapper in between
    would pass on a second copy), killing that process kills the command (a wrapper killed outright would leave it
    running), and its exit status, a signal included, is the caller's to see as if there were no wrapper. Returns
    only when the command cannot be started (126/127, as shells report it).
    """
    command = list(args.argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("vllm-compat run: no command given; usage: vllm-compat run -- python script.py ARGS...", file=sys.stderr)
        return EXIT_USAGE
    env = run_environment(strict=args.strict)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        print(f"vllm-compat run: command not found: {command[0]}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except PermissionError:
        print(f"vllm-compat run: permission denied: {command[0]}", file=sys.stderr)
        return EXIT_NOT_EXECUTABLE
    except OSError as exc:  # e.g. not an executable format
        print(f"vllm-compat run: cannot run {command[0]}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_NOT_EXECUTABLE
    return EXIT_NOT_EXECUTABLE  # pragma: no cover  (execvpe returns only by raising)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "probe":
            return _probe(args)
        if args.command == "run":
            return _run(args)
        if args.command == "status":
            return _status(args)
    except SourceError as exc:
        print(f"vllm-compat: {exc}", file=sys.stderr)
        return EXIT_USAGE
    parser.print_usage(sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
