"""shutdown-at-exit on a stand-in generator module that fails at teardown as speculators' does: a generator alive at
interpreter exit is shut down before module teardown, once, with nothing printed (a real engine:
tests/e2e/test_exit.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_compat import plugin

STAND_IN = """
import logging

log = logging.getLogger(__name__)


class Executor:
    def __init__(self, marker):
        self.marker = marker

    def shutdown(self):
        log.debug("shutting down")  # fails once module teardown has set the globals to None
        with open(self.marker, "a") as f:
            f.write("shut\\n")


class VllmHiddenStatesGenerator:
    def __init__(self, marker):
        self.executor = Executor(marker)

    def __del__(self):  # speculators' own
        if hasattr(self, "executor"):
            try:
                self.executor.shutdown()
            except Exception:
                log.warning("Exception during executor shutdown")
"""

# Module teardown, made deterministic: a hook registered before anything else (so it runs after every other exit
# hook, as teardown does) sets the stand-in's globals to None, then drops the generator the script still holds.
SCRIPT = """
import atexit, sys
sys.path.insert(0, sys.argv[1])
import stand_in_generator as module

def teardown():
    module.log = None
    globals().pop("generator")

atexit.register(teardown)
if sys.argv[3] == "adapted":
    from vllm_compat.adapters.lifecycle import ShutdownAtExit
    ShutdownAtExit().apply(module)
generator = module.VllmHiddenStatesGenerator(sys.argv[2])  # alive until the interpreter exits
"""


def run(tmp_path: Path, how: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    (tmp_path / "stand_in_generator.py").write_text(textwrap.dedent(STAND_IN))
    marker = tmp_path / f"shut-{how}.txt"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), str(marker), how],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done, marker.read_text().splitlines() if marker.exists() else []


def test_without_the_adapter_teardown_prints_a_traceback(tmp_path: Path) -> None:
    """What a user saw after a run that succeeded (speculators 0.3.0): the stand-in reproduces it."""
    done, _shut = run(tmp_path, "bare")
    assert done.returncode == 0
    assert "Exception ignored in" in done.stderr and "'NoneType' object has no attribute 'warning'" in done.stderr


def test_live_generators_are_shut_down_before_teardown(tmp_path: Path) -> None:
    done, shut = run(tmp_path, "adapted")
    assert done.returncode == 0
    assert done.stderr == ""
    assert shut == ["shut"], "the live generator's executor, once"


def test_a_collected_generator_is_shut_down_by_its_own_finalizer(tmp_path: Path) -> None:
    import importlib

    (tmp_path / "stand_in_generator.py").write_text(textwrap.dedent(STAND_IN))
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module("stand_in_generator")
        from vllm_compat.adapters import lifecycle

        adapter = lifecycle.ShutdownAtExit()
        adapter.apply(module)
        marker = tmp_path / "shut.txt"
        generator = module.VllmHiddenStatesGenerator(str(marker))
        assert generator in lifecycle._live
        del generator  # refcount: __del__ runs now, and shuts down
        assert marker.read_text().splitlines() == ["shut"]
        assert len(lifecycle._live) == 0
        lifecycle.shut_down_live_generators()  # the exit hook then has nothing to do
        assert marker.read_text().splitlines() == ["shut"]
        adapter.revert()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("stand_in_generator", None)


FREEZE = """
import atexit, gc, os, sys
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count()))  # first registered: runs last
from vllm_compat import plugin
plugin.register()  # vLLM's plugin loader in a worker it spawned
"""


def run_worker(active: bool) -> int:
    import os

    env = {k: v for k, v in os.environ.items() if k != "VLLM_COMPAT_ACTIVE"}
    env["VLLM_COMPAT_DISABLE"] = "1"  # only the plugin may install
    if active:
        env["VLLM_COMPAT_ACTIVE"] = "1"
    done = subprocess.run([sys.executable, "-c", FREEZE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().splitlines()[-1].split()[-1])


def test_a_worker_skips_the_full_collection_at_exit() -> None:
    """A vLLM worker with vllm-compat active freezes its heap once its exit handlers ran (vLLM sends SIGTERM to a worker
    that takes more than 5 s to exit; the collection took 5 to 6 s on 2 loaded cores); any other process does not."""
    assert run_worker(active=True) > 0
    assert run_worker(active=False) == 0


# A vLLM worker as multiprocessing spawns it: vllm-compat activated by the plugin, then run() ends as asked. The
# stand-in for a C-level exit hook that reports leaks (Triton's nanobind) is an object in a reference cycle whose
# finaliser prints once the interpreter tears the modules down; a handler registered before the activation checks
# that every atexit handler still runs.
SPAWNED_WORKER = """
import atexit, multiprocessing, os, sys


class Leak:
    def __del__(self, write=os.write):  # bound now: the teardown sets module globals to None
        write(2, b"leaked at teardown\\n")


def target(how):
    import ctypes

    from vllm_compat import plugin

    # A C-level exit hook, as Triton's nanobind leak report is one: were it run, the process would die of SIGABRT.
    libc = ctypes.CDLL(None)
    libc.__cxa_atexit.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]  # what atexit() calls
    libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)

    def late():  # runs after vllm-compat's freeze (registered before it): only a teardown would finalise it
        leak = Leak()
        leak.cycle = leak
        sys.modules["__mp_main__"].leak = leak

    atexit.register(lambda: os.write(1, b"handler registered before ran\\n"))
    atexit.register(late)
    plugin.activated_in_worker(plugin.PLUGIN_ROUTE)
    atexit.register(lambda: os.write(1, b"handler registered after ran\\n"))
    if how == "exit 3":
        raise SystemExit(3)
    if how == "raise":
        raise ValueError("boom")


if __name__ == "__main__":
    process = multiprocessing.get_context("spawn").Process(target=target, args=(sys.argv[1],))
    process.start()
    process.join()
    print("exit code", process.exitcode)
"""


def run_spawned_worker(tmp_path: Path, how: str, gc_enabled: bool = True) -> subprocess.CompletedProcess[str]:
    import os

    script = tmp_path / "spawned_worker.py"
    source = (
        SPAWNED_WORKER
        if gc_enabled
        else SPAWNED_WORKER.replace("def target(how):", "def target(how):\n    import gc\n    gc.disable()")
    )
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_COMPAT_ACTIVE"}
    env["VLLM_COMPAT_DISABLE"] = "1"
    return subprocess.run(
        [sys.executable, str(script), how], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(("how", "code"), [("return", 0), ("exit 3", 3), ("raise", 1)])
@pytest.mark.parametrize("gc_enabled", [True, False], ids=["gc-enabled", "gc-disabled"])
def test_a_spawned_worker_ends_after_its_exit_handlers_with_its_exit_code(
    tmp_path: Path, how: str, code: int, gc_enabled: bool
) -> None:
    """Where gc is enabled the worker ends at the collection that starts the teardown (nothing is finalised there);
    where it is not, after the teardown (the audit event), before the C-level exit hooks: the exit code is the one
    multiprocessing gives the ending of run(), and every atexit handler ran."""
    done = run_spawned_worker(tmp_path, how, gc_enabled)
    assert f"exit code {code}" in done.stdout, done.stdout + done.stderr
    assert "handler registered before ran" in done.stdout and "handler registered after ran" in done.stdout
    assert ("ValueError: boom" in done.stderr) == (how == "raise")
    if gc_enabled:
        assert "leaked at teardown" not in done.stderr
    else:  # after the teardown: its finalisers ran as they always did
        assert "leaked at teardown" in done.stderr


def test_the_exit_code_multiprocessing_gives() -> None:
    assert plugin._code_of(None) == 0
    assert plugin._code_of(SystemExit()) == 0
    assert plugin._code_of(SystemExit(0)) == 0
    assert plugin._code_of(SystemExit(4)) == 4
    assert plugin._code_of(SystemExit("bye")) == 1
    assert plugin._code_of(ValueError()) == 1
