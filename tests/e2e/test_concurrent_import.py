"""Three threads importing vLLM, ``vllm.config`` and speculators' generator at once, with the real wheels.

With wrapt's post-import hook finder every such start hung (the finder imported the parent package under the
interpreter's global import lock). Each run is a fresh interpreter with a timeout; with vllm-compat, the threads
must finish and leave exactly the adapters that a one-thread import applies.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import child_env

pytestmark = pytest.mark.e2e
GENERATOR = "speculators.data_generation.vllm_hidden_states_generator"
SCRIPT = """
import importlib, json, os, sys, threading, time
if sys.argv[1] == "1":
    import vllm_compat
errors = {}

def load(name):
    try:
        importlib.import_module(name)
    except Exception as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"

names = sys.argv[2].split(",")
threads = [threading.Thread(target=load, args=(name,), daemon=True) for name in names]
start = time.monotonic()
for t in threads:
    t.start()
for t in threads:
    t.join(max(0.0, 90 - (time.monotonic() - start)))  # ~10 s when nothing hangs
hung = [n for n, t in zip(names, threads) if t.is_alive()]
if hung:  # a hung thread holds import locks (and maybe the engine's): report and leave at once
    print(json.dumps({"hung": hung}), flush=True)
    os._exit(0)
compat = sys.modules.get("vllm_compat")
status = compat.status() if compat else {}
print(json.dumps({"hung": [], "errors": errors, "applied": sorted(status.get("applied", ())),
                  "guarded": status.get("guarded")}), flush=True)
"""


def imports(names: list[str], compat: bool, cwd: Path) -> dict:
    env = child_env({"VLLM_COMPAT_DISABLE": "0"} if compat else {"VLLM_COMPAT_DISABLE": "1"})
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, "1" if compat else "0", ",".join(names)],
        env=env,
        cwd=cwd,  # not the checkout: its source folder must not shadow the installed package
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, f"rc={done.returncode}\n{done.stderr[-3000:]}"
    return json.loads(lines[-1])


def test_concurrent_imports_finish_and_apply_what_one_thread_applies(tmp_path: Path) -> None:
    alone = imports([GENERATOR], compat=True, cwd=tmp_path)
    assert alone["errors"] == {} and alone["applied"] and alone["guarded"]
    for _ in range(2):  # wrapt's finder hung every time; two runs leave no room for luck
        together = imports(["vllm", "vllm.config", GENERATOR], compat=True, cwd=tmp_path)
        assert together["hung"] == []
        assert together["errors"] == {}
        assert (together["applied"], together["guarded"]) == (alone["applied"], True)


def test_concurrent_imports_without_vllm_compat_finish(tmp_path: Path) -> None:
    """The baseline: vLLM itself imports fine from three threads (the generator may fail to import without
    vllm-compat, e.g. under transformers 5, but it must not hang)."""
    assert imports(["vllm", "vllm.config", GENERATOR], compat=False, cwd=tmp_path)["hung"] == []
