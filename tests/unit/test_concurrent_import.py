"""Threads importing hooked modules at once must never hang (real interpreters, throwaway packages).

Each case runs in a fresh interpreter with a timeout: a hang there leaves import locks held for good, which would
wedge the test session itself. The packages are made so the dangerous interleaving happens every time (events,
not timing luck); tests/e2e/test_concurrent_import.py does the same with real vLLM and speculators.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# The engine with one adapter that applies always, on speculators 0.4.0.1 (as far as the engine can tell).
PRELUDE = """
import importlib, importlib._bootstrap as bootstrap, sys, threading, time, types
from packaging.version import Version
from vllm_compat import engine as engine_module
from vllm_compat.adapter import Adapter

engine_module.installed_version = lambda name: Version("0.4.0.1") if name == "speculators" else None
engine = engine_module._Engine()
events = {name: threading.Event() for name in ("in_body", "go_on", "applying")}
sys.modules["vc_events"] = types.SimpleNamespace(**events)
done = []

def blocked(thread, seconds=10.0):
    # whether ``thread`` waits on a module lock (it went as far as the import system lets it)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if thread.ident in bootstrap._blocking_on:
            return True
        time.sleep(0.01)
    return False

def run(name):
    importlib.import_module(name)
    done.append(name)

def finish(threads):
    for t in threads:
        t.join(15)
    print("HANG" if any(t.is_alive() for t in threads) else "OK " + ",".join(sorted(done)), flush=True)
    sys.stdout.flush()
    import os
    os._exit(0)
"""

# A package still executing its __init__ in one thread while another thread imports its hooked submodule: the
# hook finder must not import the parent package (it runs under the interpreter's global import lock).
PARENT_STILL_LOADING = """
class Hooked(Adapter):
    '''test'''
    id = "test-hooked-submodule"
    always = "test"
    target = "vc_pkg.sub"

    def apply(self, module):
        self.set_attr(module, "patched", True)

engine_module.load_adapters = lambda: {"test-hooked-submodule": Hooked}
engine.install()
first = threading.Thread(target=run, args=("vc_pkg",), daemon=True)
first.start()
events["in_body"].wait(10)
second = threading.Thread(target=run, args=("vc_pkg.sub",), daemon=True)
second.start()
blocked(second, 2.0)  # old finder: waits for vc_pkg while holding the global import lock
events["go_on"].set()  # vc_pkg's __init__ goes on, and imports a module
finish([first, second])
"""

# One thread applies an adapter (engine busy) and imports a module that another thread is importing; that import's
# own hook must not wait for the engine that waits for it.
HOOK_WHILE_ENGINE_BUSY = """
class Slow(Adapter):
    '''test'''
    id = "test-slow"
    always = "test"
    target = "vc_slow"

    def apply(self, module):
        self.set_attr(module, "patched", True)

class Busy(Adapter):
    '''test'''
    id = "test-busy"
    always = "test"
    target = "vc_busy"

    def apply(self, module):
        events["applying"].set()
        import vc_slow  # being imported by the other thread

        self.set_attr(module, "patched", vc_slow.patched)

engine_module.load_adapters = lambda: {"test-slow": Slow, "test-busy": Busy}
engine.install()
first = threading.Thread(target=run, args=("vc_slow",), daemon=True)
first.start()
events["in_body"].wait(10)
second = threading.Thread(target=run, args=("vc_busy",), daemon=True)
second.start()
events["applying"].wait(10)
blocked(second, 2.0)  # waits for vc_slow, inside the engine
events["go_on"].set()  # vc_slow finishes; its hook runs
finish([first, second])
"""

FILES = {
    "vc_pkg/__init__.py": "import vc_events\nvc_events.in_body.set()\nvc_events.go_on.wait(10)\nimport vc_pkg.other\n",
    "vc_pkg/sub.py": "value = 1\n",
    "vc_pkg/other.py": "value = 2\n",
    "vc_slow.py": "import vc_events\nvc_events.in_body.set()\nvc_events.go_on.wait(10)\n",
    "vc_busy.py": "value = 3\n",
}


def run_case(body: str, tmp_path: Path) -> str:
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    script = tmp_path / "case.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n" + PRELUDE + textwrap.dedent(body))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize(
    ("body", "expected"),
    [(PARENT_STILL_LOADING, "OK vc_pkg,vc_pkg.sub"), (HOOK_WHILE_ENGINE_BUSY, "OK vc_busy,vc_slow")],
    ids=["parent-still-loading", "hook-while-engine-busy"],
)
def test_concurrent_imports_do_not_hang(body: str, expected: str, tmp_path: Path) -> None:
    assert run_case(body, tmp_path) == expected
