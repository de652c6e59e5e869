"""Print a Markdown table of what the probes find across vLLM releases.

    python scripts/drift_table.py [--cache DIR] [--drift-only] [VERSIONS...]

Rows are probe ids, columns are vLLM releases, and each cell reads ``<0.3.0> / <0.4.0.1>``: the variant
each speculators line meets, ``.`` where that line gets what it expects (baseline), ``?`` where the
probe could not tell, ``-`` where the probe does not concern that line. Without VERSIONS it runs over
every vLLM minor release from 0.11.0 to 0.33.0 that has a wheel on the package index (fetched once,
without dependencies, into the cache: ``--cache``, else ``$VLLM_COMPAT_CACHE``, else
``~/.cache/vllm-compat/wheels``). A timing line per wheel follows the table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from packaging.version import Version

from vllm_compat.apiview.static import StaticView
from vllm_compat.errors import SourceError
from vllm_compat.findings import State
from vllm_compat.plan import Plan, load_probes, make_plan
from vllm_compat.sources import cache_dir, fetch_release

LINES = ("0.3.0", "0.4.0.1")
DEFAULT_VERSIONS = [f"0.{minor}.0" for minor in range(11, 34)]


def cell(plan: Plan, probe: str) -> str:
    """``<0.3.0> / <0.4.0.1>`` for one probe in one release."""
    by_line = {f.speculators: f for f in plan.findings if f.probe == probe}
    parts = []
    for line in LINES:
        f = by_line.get(line)
        if f is None:
            parts.append("-")
        elif f.state is State.BASELINE:
            parts.append(".")
        elif f.state is State.UNKNOWN:
            parts.append("?")
        else:
            parts.append(f.variant)
    return " / ".join(parts)


def table(plans: dict[str, Plan], drift_only: bool) -> list[str]:
    releases = list(plans)
    probes = list(load_probes())
    rows = []
    for probe in probes:
        cells = [cell(plans[r], probe) for r in releases]
        if drift_only and all(c.replace("-", ".") == ". / ." for c in cells):
            continue
        rows.append(f"| `{probe}` | " + " | ".join(cells) + " |")
    head = "| probe | " + " | ".join(releases) + " |"
    rule = "|---|" + "---|" * len(releases)
    return [head, rule, *rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*", metavar="VERSION", help="vLLM releases (default: 0.11.0 .. 0.33.0)")
    parser.add_argument("--cache", type=Path, help="wheel cache folder (default: $VLLM_COMPAT_CACHE or ~/.cache)")
    parser.add_argument("--drift-only", action="store_true", help="leave out probes that are baseline everywhere")
    args = parser.parse_args(argv)
    cache = args.cache or cache_dir()
    versions = sorted(set(args.versions or DEFAULT_VERSIONS), key=Version)

    plans: dict[str, Plan] = {}
    timings: list[str] = []
    for version in versions:
        start = time.perf_counter()
        try:
            wheel = fetch_release(version, dest=cache)
        except SourceError as exc:
            timings.append(f"- vllm=={version}: skipped, {exc}")
            print(f"vllm=={version}: no wheel ({exc})", file=sys.stderr)
            continue
        fetched = time.perf_counter()
        plans[version] = make_plan(StaticView(wheel), LINES)
        done = time.perf_counter()
        drifted = sum(f.state is State.DRIFTED for f in plans[version].findings)
        unknown = sum(f.state is State.UNKNOWN for f in plans[version].findings)
        timings.append(
            f"- vllm=={version}: {wheel.name} ({wheel.stat().st_size / 2**20:.0f} MiB), "
            f"fetch {fetched - start:.2f}s, probes {done - fetched:.2f}s; "
            f"{len(plans[version].findings)} findings, {drifted} drifted, {unknown} unknown"
        )
        print(f"vllm=={version}: probes {done - fetched:.2f}s", file=sys.stderr)

    if not plans:
        print("no release could be probed", file=sys.stderr)
        return 2
    print(f"# What the probes find, vLLM {next(iter(plans))} to {list(plans)[-1]}")
    print()
    print("Cells: `<speculators 0.3.0> / <speculators 0.4.0.1>`; `.` baseline, `?` unknown, `-` not used by that line.")
    print()
    print("\n".join(table(plans, args.drift_only)))
    print()
    print("Timings (fetch from the cache or the index, then all probes over the wheel with StaticView):")
    print()
    print("\n".join(timings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
