"""How long ``import vllm_compat`` takes, and proof that it imports neither vLLM nor torch.

Each sample is a fresh interpreter (imports are cached per process): it times ``import vllm_compat`` with
``time.perf_counter`` around the statement, beside a baseline interpreter that imports ``wrapt`` and ``packaging``
only (the two runtime dependencies), so the ratio shows what vllm-compat adds on top of them.

    python bench/import_time.py [--samples 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

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
    return 0 if not heavy else 1


if __name__ == "__main__":
    sys.exit(main())
