"""The process tree, read from /proc (no psutil needed): which vLLM worker processes a test left running."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROC = Path("/proc")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    session: int
    state: str  # R, S, D, Z (zombie: exited, not yet reaped), ...
    cmdline: str

    @property
    def running(self) -> bool:
        return self.state not in {"Z", "X"}

    @property
    def is_resource_tracker(self) -> bool:
        """multiprocessing's resource tracker: a helper of the parent, not a vLLM worker; exits with the parent."""
        return "resource_tracker" in self.cmdline


def read(pid: int) -> Proc | None:
    try:
        stat = (PROC / str(pid) / "stat").read_text()
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    cmdline = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return Proc(pid, int(fields[1]), int(fields[3]), fields[0], cmdline)


def processes() -> list[Proc]:
    found = []
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            proc = read(int(entry.name))
            if proc is not None:
                found.append(proc)
    return found


def descendants(pid: int) -> list[Proc]:
    """Every process below ``pid`` in the tree (children, grandchildren...)."""
    table = processes()
    by_parent: dict[int, list[Proc]] = {}
    for p in table:
        by_parent.setdefault(p.ppid, []).append(p)
    out: list[Proc] = []
    todo = [pid]
    while todo:
        for child in by_parent.get(todo.pop(), []):
            out.append(child)
            todo.append(child.pid)
    return out


def in_session(session: int, exclude: int | None = None) -> list[Proc]:
    """Every live process of a session, wherever it was reparented to (a test's driver leads its own session)."""
    return [p for p in processes() if p.session == session and p.pid != exclude and p.running]


def workers(pid: int | None = None) -> list[Proc]:
    """The running vLLM worker processes below ``pid`` (default: this process)."""
    return [p for p in descendants(pid or os.getpid()) if p.running and not p.is_resource_tracker]


def wait_gone(pid: int | None = None, timeout: float = 30.0) -> list[Proc]:
    """Wait until no worker runs below ``pid``; the ones still running after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = workers(pid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def kill_session(session: int) -> list[Proc]:
    """SIGKILL what is left of a session (a test's clean-up after a failure); the processes it found."""
    left = in_session(session)
    for p in left:
        with contextlib.suppress(OSError):
            os.kill(p.pid, signal.SIGKILL)
    return left


@dataclass
class Finished:
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    seconds: float
    left: list[Proc]  # processes of its session still running after it exited (killed since)


def run_in_session(cmd: list[str], env: dict[str, str], timeout: float) -> Finished:
    """Run ``cmd`` as the leader of a new session, at most ``timeout`` seconds; then find (and kill) whatever of its
    session still runs, wherever it was reparented to."""
    import subprocess

    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        out, err = proc.communicate()
        code = None
    seconds = time.monotonic() - start
    deadline = time.monotonic() + 10  # a worker may take a moment to notice its parent is gone
    while in_session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return Finished(code, out, err, seconds, kill_session(proc.pid))


def run_robustness(mode: str, model: Path, out: Path, extra: list[str] | None = None) -> dict[str, Any]:
    """Run tests/e2e/robustness.py ``mode`` in its own session; its record, with exit code, leftovers and stderr."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_COMPAT_DISABLE"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    script = Path(__file__).with_name("robustness.py")
    cmd = [sys.executable, str(script), mode, "--model", str(model), "--out", str(out), *(extra or [])]
    done = run_in_session(cmd, env, timeout=1500)
    assert out.exists(), f"no record (exit {done.returncode}):\n{done.stderr[-4000:]}"
    record = json.loads(out.read_text())
    record["exit"], record["left"], record["stderr"] = done.returncode, [p.cmdline for p in done.left], done.stderr
    return record


def case(run: dict[str, Any], name: str) -> dict[str, Any]:
    """One case of a robustness record; it must have run and not hung."""
    found = run["cases"].get(name)
    assert found is not None, f"{name} did not run: {sorted(run['cases'])} (stderr: {run['stderr'][-2000:]})"
    assert found["outcome"] != "hang", f"{name} hung for {found['seconds']} s"
    return found
