"""How long ``import vllm_compat`` takes, what ``VLLM_COMPAT_AUTO=1`` adds to each interpreter start, and proof that
neither imports vLLM or torch.

Each sample is a fresh interpreter (imports are cached per process): it times ``import vllm_compat`` with
``time.perf_counter`` around the statement, beside a baseline interpreter that imports ``wrapt`` and ``packaging``
only (the two runtime dependencies), so the ratio shows what vllm-compat adds on top of them. Then it times whole
``python -c pass`` runs with ``VLLM_COMPAT_AUTO=1`` (and with ``VLLM_COMPAT_STRICT=1`` too) against runs without,
where the wheel's ``vllm_compat_auto.pth`` is installed (not in an editable install).

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
    return 0 if not heavy else 1


if __name__ == "__main__":
    sys.exit(main())
