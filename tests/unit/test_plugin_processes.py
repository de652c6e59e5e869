"""The worker plugin across processes: opt-in only, idempotent after fork, safe when the parent forks mid-hook.

vLLM loads ``vllm.general_plugins`` in every process it starts. Under the fork start method a worker inherits the
parent's state (vllm-compat installed, adapters applied, hooks registered) and then the plugin loads again; under
spawn it starts bare and only the inherited environment says whether the parent opted in. Uses the throwaway
target, adapter and probe of test_engine.py; the spawn cases use the real package in a fresh interpreter.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import subprocess
import sys
import threading
import time

import pytest

from tests.unit import test_engine as base
from vllm_compat import engine as engine_module
from vllm_compat import plugin

sandbox = base.sandbox  # the fixture: fresh engine, throwaway adapter "test-fake" on module vc_test_target
CHILD_TIMEOUT = 30

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def in_fork(fn) -> dict:
    """Run ``fn()`` in a forked child; its return value (a dict) comes back through a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 0
        try:
            os.close(read)
            payload = pickle.dumps(fn())
        except BaseException as exc:  # reported to the parent
            payload, code = pickle.dumps({"error": f"{type(exc).__name__}: {exc}"}), 1
        with os.fdopen(write, "wb") as f:
            f.write(payload)
        os._exit(code)
    os.close(write)
    deadline = time.monotonic() + CHILD_TIMEOUT
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child did not finish within {CHILD_TIMEOUT} s (deadlock?)")
        time.sleep(0.02)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    result = pickle.loads(data) if data else {"error": f"no result (exit status {status})"}
    assert "error" not in result, result["error"]
    return result


def child_state() -> dict:
    import vc_test_target

    engine = engine_module.engine
    return {
        "pid": os.getpid(),
        "installed": engine.status()["installed"],
        "plugin_loaded": plugin.loaded,
        "applied": sorted(engine.applied),
        "apply_calls": list(base.APPLY_CALLS),
        "thing": vc_test_target.thing(3),
        "active": os.environ.get(engine_module.ENV_ACTIVE),
    }


def test_fork_inherits_the_install_and_the_plugin_adds_nothing(sandbox) -> None:
    engine, _ = sandbox
    engine.install()
    import vc_test_target  # noqa: F401  (applies the adapter in the parent)

    assert base.APPLY_CALLS == ["test-fake"]

    def child() -> dict:
        plugin.register()  # vLLM's plugin loader in the forked worker
        plugin.register()  # and again (a second loader, a re-import): still one install
        return child_state()

    got = in_fork(child)
    assert got["pid"] != os.getpid()
    assert got["installed"] and got["plugin_loaded"]
    assert got["applied"] == ["test-fake"]
    assert got["apply_calls"] == ["test-fake"], "the child applied the adapter a second time"
    assert got["thing"] == 6, "wrapped twice (12) or not at all (3)"
    assert base.APPLY_CALLS == ["test-fake"]  # nothing leaked back into the parent


def test_fork_without_opt_in_stays_inert(sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(engine_module.ENV_ACTIVE, raising=False)

    def child() -> dict:
        plugin.register()
        return child_state()

    got = in_fork(child)
    assert got["plugin_loaded"] and not got["installed"]
    assert got["apply_calls"] == [] and got["thing"] == 3 and got["active"] is None


def test_fork_then_install_in_the_child_only(sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent opted in (the variable is set) but imported nothing: the child's plugin installs and patches there."""
    monkeypatch.setenv(engine_module.ENV_ACTIVE, "1")

    def child() -> dict:
        plugin.register()
        return child_state()

    got = in_fork(child)
    assert got["installed"] and got["apply_calls"] == ["test-fake"] and got["thing"] == 6
    assert base.APPLY_CALLS == [] and not engine_module.engine.status()["installed"]


def _mp_child(queue) -> None:
    plugin.register()
    plugin.register()
    queue.put(child_state())


def test_multiprocessing_fork_context(sandbox) -> None:
    engine, _ = sandbox
    engine.install()
    import vc_test_target  # noqa: F401

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_mp_child, args=(queue,))
    proc.start()
    try:
        got = queue.get(timeout=CHILD_TIMEOUT)
    finally:
        proc.join(CHILD_TIMEOUT)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
    assert got["installed"] and got["apply_calls"] == ["test-fake"] and got["thing"] == 6


def test_fork_while_another_thread_holds_the_engine_lock(sandbox) -> None:
    """A worker forked while a thread of the parent is inside a hook must not inherit a lock nobody will release."""
    engine, _ = sandbox
    engine.install()
    inside, release = threading.Event(), threading.Event()

    def busy() -> None:
        with engine.lock:  # as _on_import holds it while it applies adapters
            inside.set()
            release.wait(CHILD_TIMEOUT)

    holder = threading.Thread(target=busy)
    holder.start()
    inside.wait(CHILD_TIMEOUT)
    try:

        def child() -> dict:
            plugin.register()  # install() takes the lock: deadlock unless the child got a fresh one
            return child_state()

        got = in_fork(child)
    finally:
        release.set()
        holder.join()
    assert got["installed"] and got["thing"] == 6


def test_plugin_from_two_threads_installs_once(sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(engine_module.ENV_ACTIVE, "1")
    import vc_test_target

    barrier = threading.Barrier(4)

    def go() -> None:
        barrier.wait()
        plugin.register()

    threads = [threading.Thread(target=go) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert base.APPLY_CALLS == ["test-fake"] and vc_test_target.thing(3) == 6


# -- a fresh interpreter, as under the spawn start method: the real package, only the environment is inherited --------
SPAWNED = """
import importlib.metadata as md, json, sys
(point,) = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "vllm_compat"]
register = point.load()  # as vLLM's load_general_plugins() does, in every process it starts
register()
register()
imported = "vllm_compat" in sys.modules
import vllm_compat  # (VLLM_COMPAT_DISABLE=1: this import, to read the status, installs nothing itself)
print(json.dumps({**vllm_compat.status(), "imported_by_the_plugin": imported}))
"""


def spawned_status(active: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != engine_module.ENV_ACTIVE}
    env[engine_module.ENV_DISABLE] = "1"  # only the plugin may install
    if active is not None:
        env[engine_module.ENV_ACTIVE] = active
    done = subprocess.run(
        [sys.executable, "-c", SPAWNED], env=env, capture_output=True, text=True, timeout=120, check=False, cwd="/"
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("active", [None, "", "0", "true"])
def test_spawned_worker_without_opt_in_stays_inert(active: str | None) -> None:
    """Only the exact value install() sets counts as opting in. The entry point does not even import vllm_compat:
    importing it installs it, which put vllm-compat into every process of a ``vllm serve`` no one had asked it into
    (a new user's run on vLLM CPU 0.29.0: native-connector-on-cpu applied in all three of the server's processes)."""
    status = spawned_status(active)
    assert status["imported_by_the_plugin"] is False
    assert status["plugin_loaded"] is True and status["installed"] is False and status["hooks"] == []


def test_a_vllm_compat_that_does_not_import_does_not_stop_the_process(tmp_path) -> None:
    """vLLM calls the entry point outside its own guard (it guards only loading it): an import failure inside
    ``register`` would end the process. vLLM 0.17.0's model inspection (``python -m`` in the caller's folder, a
    checkout's source tree shadowing the installed package) failed that way; it is logged and the process goes on."""
    broken = tmp_path / "vllm_compat"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('a source tree without vllm_compat.adapters')\n")
    code = (
        "import importlib.metadata as md\n"
        "(point,) = [e for e in md.entry_points(group='vllm.general_plugins') if e.name == 'vllm_compat']\n"
        "point.load()()\n"
        "print('went on')\n"
    )
    env = {**os.environ, engine_module.ENV_ACTIVE: "1", "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd="/")
    assert done.returncode == 0 and done.stdout.strip() == "went on", done.stderr
    assert "could not import vllm_compat" in done.stderr and "a source tree without" in done.stderr


def test_spawned_worker_with_opt_in_installs_once() -> None:
    status = spawned_status("1")
    assert status["imported_by_the_plugin"] is True
    assert status["plugin_loaded"] is True and status["installed"] is True
    assert engine_module.GUARD_MODULE in status["hooks"] and status["applied"] == {}
