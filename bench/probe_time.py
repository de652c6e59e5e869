"""How long ``vllm-compat probe`` takes on the installed vLLM: read from its files (the default) against imported
(``--live``), and a release's cached wheel (``--source vllm==X``), side by side in one run.

Each sample is a whole ``python -m vllm_compat.cli probe --json`` process, timed from start to exit, the modes
interleaved so that a loaded machine slows them alike; the report on stdout must parse as one JSON object each time.
The first ``--source`` sample downloads the wheel unless it is cached; it is left out of the medians.

    python bench/probe_time.py [--samples 5] [--source-release 0.33.0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def sample(args: list[str], cwd: str) -> float:
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "vllm_compat.cli", "probe", "--json", *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
    )
    seconds = time.perf_counter() - began
    if done.returncode not in (0, 1):
        raise SystemExit(f"probe {' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}")
    json.loads(done.stdout)  # one JSON object, nothing else
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--source-release", default="0.33.0")
    args = parser.parse_args()
    modes = {"installed (files, default)": [], "installed --live": ["--live"]}
    modes[f"--source vllm=={args.source_release}"] = ["--source", f"vllm=={args.source_release}"]
    cwd = tempfile.mkdtemp(prefix="probe-time-")  # outside any checkout: the installed vllm_compat
    sample(modes[f"--source vllm=={args.source_release}"], cwd)  # fetches the wheel once if it is not cached
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(args.samples):
        for name, extra in modes.items():
            times[name].append(sample(extra, cwd))
    load = os.getloadavg()[0]
    print(f"vllm-compat probe --json, {args.samples} samples each, interleaved (load average {load:.1f}, "
          f"{os.cpu_count()} CPUs)")  # fmt: skip
    base = statistics.median(times["installed (files, default)"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:<34} median {median:6.2f} s  (min {min(values):.2f}, max {max(values):.2f})  "
              f"{median / base:5.1f}x the default")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
