"""How long ``import vllm_compat`` takes, what ``VLLM_COMPAT_AUTO=1`` adds to each interpreter start, and proof that
neither imports vLLM or torch.

Each sample is a fresh interpreter (imports are cached per process): it times ``import vllm_compat`` with
``time.perf_counter`` around the statement, beside a baseline interpreter that imports ``wrapt`` and ``packaging``
only (the two runtime dependencies), so the ratio shows what vllm-compat adds on top of them. Then it times whole
``python -c pass`` runs with ``VLLM_COMPAT_AUTO=1`` (and with ``VLLM_COMPAT_STRICT=1`` too) against runs without,
where the wheel's ``vllm_compat_auto.pth`` is installed (not in an editable install). Last, what that ``.pth``
costs every interpreter when VLLM_COMPAT_AUTO is not set (it then only sets the forgotten-runner hint's
``sys.excepthook``): whole starts that process a site folder holding this checkout's ``.pth`` against starts that
process an empty one, side by side, and the ``.pth`` line alone timed inside the interpreter.

    python bench/import_time.py [--samples 30]
"""

from __future__ import annotations

import argparse
import json
import os
import site
import statistics
import subprocess
import sys
import time

PROBE = """
import sys, time, json
t = time.perf_counter()
import {module}
ms = (time.perf_counter() - t) * 1000
print(json.dumps({{"ms": ms, "vllm": "vllm" in sys.modules, "torch": "torch" in sys.modules}}))
"""


def sample(module: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


START = "import sys, json; print(json.dumps({'heavy': 'vllm' in sys.modules or 'torch' in sys.modules}))"


def start(env: dict[str, str]) -> tuple[float, bool]:
    """Wall time of one interpreter start that runs nothing, in ms; whether vLLM or torch got imported."""
    began = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True, text=True, check=True)
    return (time.perf_counter() - began) * 1000, json.loads(out.stdout.splitlines()[-1])["heavy"]


def auto_pth_installed() -> bool:
    return any(os.path.exists(os.path.join(d, "vllm_compat_auto.pth")) for d in site.getsitepackages())


def auto_cost(samples: int) -> bool:
    """Print what VLLM_COMPAT_AUTO=1 (and with VLLM_COMPAT_STRICT=1) adds to an interpreter start; True if heavy."""
    if not auto_pth_installed():
        print("VLLM_COMPAT_AUTO: vllm_compat_auto.pth is not in this interpreter's site-packages; not measured")
        return False
    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_COMPAT_")}
    modes = {"without": base, "AUTO": {**base, "VLLM_COMPAT_AUTO": "1"}}
    modes["AUTO+STRICT"] = {**modes["AUTO"], "VLLM_COMPAT_STRICT": "1"}
    times: dict[str, list[float]] = {m: [] for m in modes}
    heavy = False
    for _ in range(samples):  # interleaved
        for mode, env in modes.items():
            ms, loaded = start(env)
            times[mode].append(ms)
            heavy |= loaded
    off = statistics.median(times["without"])
    for mode in ("AUTO", "AUTO+STRICT"):
        med = statistics.median(times[mode])
        print(
            f"python -c pass with VLLM_COMPAT_{mode.replace('+', ' + VLLM_COMPAT_')}=1: median {med:.0f} ms, "
            f"{med - off:+.0f} ms over {off:.0f} ms without ({samples} starts each)"
        )
    print(f"interpreter start-up imports vLLM or torch: {'YES' if heavy else 'no'}")
    return heavy


PTH = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "vllm_compat", "_bootstrap", "vllm_compat_auto.pth"
)
SITE = (
    "import site, sys, time; t = time.perf_counter(); site.addsitedir(sys.argv[1]); "
    "print((time.perf_counter() - t) * 1e6)"
)


def pth_cost(samples: int) -> None:
    """Print interpreter start-up with and without the .pth hook (VLLM_COMPAT_AUTO unset), side by side."""
    import shutil
    import tempfile

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_COMPAT_")}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"without the hook": os.path.join(tmp, "empty"), "with the hook": os.path.join(tmp, "pth")}
        for folder in dirs.values():
            os.mkdir(folder)
        shutil.copy(PTH, dirs["with the hook"])
        wall: dict[str, list[float]] = {k: [] for k in dirs}
        inside: dict[str, list[float]] = {k: [] for k in dirs}
        for _ in range(samples):  # interleaved
            for mode, folder in dirs.items():
                began = time.perf_counter()
                out = subprocess.run(
                    [sys.executable, "-c", SITE, folder], env=env, capture_output=True, text=True, check=True
                )
                wall[mode].append((time.perf_counter() - began) * 1000)
                inside[mode].append(float(out.stdout))
    print(f"start-up, VLLM_COMPAT_AUTO unset ({samples} starts each, medians):")
    for mode in dirs:
        print(
            f"  {mode:<17} python -c (site folder processed): {statistics.median(wall[mode]):.1f} ms; "
            f"processing the folder: {statistics.median(inside[mode]):.0f} us"
        )
    added = statistics.median(inside["with the hook"]) - statistics.median(inside["without the hook"])
    print(f"  the .pth adds {added:.0f} us to each interpreter start (measured inside it)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=30)
    args = parser.parse_args()
    ours, deps = [], []
    heavy = False
    for _ in range(args.samples):  # interleaved, so load on the machine hits both alike
        got = sample("vllm_compat")
        ours.append(got["ms"])
        heavy |= got["vllm"] or got["torch"]
        deps.append(sample("wrapt, packaging.version")["ms"])
    med, dep = statistics.median(ours), statistics.median(deps)
    print(
        f"import vllm_compat: median {med:.1f} ms, p90 {sorted(ours)[int(0.9 * len(ours))]:.1f} ms "
        f"over {args.samples} fresh interpreters (target < 50 ms)"
    )
    print(f"import wrapt, packaging.version (the dependencies alone): median {dep:.1f} ms")
    print(f"ratio vllm_compat / dependencies: {med / dep:.2f}x")
    print(f"imports vLLM or torch: {'YES' if heavy else 'no'}")
    heavy |= auto_cost(args.samples)
    pth_cost(args.samples)
    return 0 if not heavy else 1


if __name__ == "__main__":
    sys.exit(main())
