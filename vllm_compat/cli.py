"""The ``vllm-compat`` command: ``probe`` reports drift; exit codes make it a CI guard."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from vllm_compat.errors import SourceError
from vllm_compat.versions import SPECULATORS_LINES, installed_version, speculators_line

__all__ = ["main"]

EXIT_OK, EXIT_DRIFT, EXIT_USAGE = 0, 1, 2


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
            "(with --strict: or some fact could not be established); 2 usage or environment error."
        ),
    )
    probe.add_argument(
        "--source",
        metavar="PATH|WHEEL|vllm==X",
        help="probe a vLLM source folder, a wheel, or a release fetched from the package index "
        "(default: the installed vLLM)",
    )
    probe.add_argument(
        "--speculators",
        choices=sorted(SPECULATORS_LINES),
        help="the speculators release to judge for (default: the installed one, or both)",
    )
    probe.add_argument("--json", action="store_true", help="print the JSON report (docs/json-report.md)")
    probe.add_argument("--strict", action="store_true", help="count unknown findings as unhandled")
    probe.add_argument("-v", "--verbose", action="store_true", help="show details of baseline facts too")
    return parser


def _probe(args: argparse.Namespace) -> int:
    from vllm_compat.plan import make_plan
    from vllm_compat.report import render_json, render_table
    from vllm_compat.sources import open_view

    installed = installed_version("speculators")
    if args.speculators:
        lines: tuple[str, ...] = (args.speculators,)
    elif speculators_line(installed):
        lines = (speculators_line(installed),)  # type: ignore[assignment]
    else:
        lines = tuple(SPECULATORS_LINES)
    view = open_view(args.source)
    plan = make_plan(view, lines)
    if args.json:
        print(render_json(plan, str(installed) if installed and not args.speculators else None, args.strict))
    else:
        origin = args.source or "installed"
        print(render_table(plan, origin, args.strict, args.verbose))
    return EXIT_OK if plan.passes(args.strict) else EXIT_DRIFT


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
    except SourceError as exc:
        print(f"vllm-compat: {exc}", file=sys.stderr)
        return EXIT_USAGE
    parser.print_usage(sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
