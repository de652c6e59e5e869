"""shutdown-at-exit on a stand-in generator module that fails at teardown as speculators' does: a generator alive at
interpreter exit is shut down before module teardown, once, with nothing printed (a real engine:
tests/e2e/test_exit.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

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
