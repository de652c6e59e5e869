"""``vllm-compat run`` and ``VLLM_COMPAT_AUTO``: vllm-compat active in an unchanged script and its Python children.

Every test starts real interpreters: ``python -m vllm_compat.cli run -- python script.py``, as a user would.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import vllm_compat.cli as cli

ROOT = Path(__file__).resolve().parents[2]
PTH = ROOT / "vllm_compat" / "_bootstrap" / "vllm_compat_auto.pth"

# A user's script that knows nothing of vllm-compat: it reports whether vllm-compat is active in itself and in a
# Python child it starts, and how often each process ran the environment's own sitecustomize.
SCRIPT = """
import json, os, subprocess, sys

CHILD = (
    "import json, os, sys; m = sys.modules.get('vllm_compat'); "
    "print(json.dumps({'active': bool(m and m.status()['installed']), 'pid': os.getpid(), "
    "'user_site': os.environ.get('USER_SITE_RUNS', '0')}))"
)

def me():
    m = sys.modules.get("vllm_compat")
    return {"active": bool(m and m.status()["installed"]), "pid": os.getpid(),
            "user_site": os.environ.get("USER_SITE_RUNS", "0"), "strict": os.environ.get("VLLM_COMPAT_STRICT"),
            "heavy": sorted(name for name in ("vllm", "torch") if name in sys.modules)}

child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
print(json.dumps({"script": me(), "child": json.loads(child.stdout)}))
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""

# An environment's own sitecustomize: counts its runs per process in an environment variable.
USER_SITECUSTOMIZE = """
import os
os.environ["USER_SITE_RUNS"] = str(int(os.environ.get("USER_SITE_RUNS_SELF", "0")) + 1)
os.environ["USER_SITE_RUNS_SELF"] = os.environ["USER_SITE_RUNS"]
"""


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_COMPAT_", "USER_SITE_RUNS"))}
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


def vllm_compat_run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "vllm_compat.cli", "run", *args]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def report(done: subprocess.CompletedProcess[str]) -> dict:
    import json

    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no report; rc={done.returncode}\nstdout={done.stdout}\nstderr={done.stderr}"
    return json.loads(lines[-1])


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "user_script.py"
    path.write_text(SCRIPT)
    return path


@pytest.fixture
def user_site(tmp_path: Path) -> Path:
    folder = tmp_path / "user_site"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(USER_SITECUSTOMIZE)
    return folder


def test_script_and_its_python_child_are_active(script: Path, tmp_path: Path) -> None:
    done = vllm_compat_run(["--", sys.executable, str(script)], clean_env(), tmp_path)
    assert done.returncode == 0, done.stderr
    got = report(done)
    assert got["script"]["active"] and got["child"]["active"]
    assert got["script"]["pid"] != got["child"]["pid"]
    assert got["script"]["strict"] is None
    assert "vllm-compat bootstrap" not in done.stderr


def test_without_run_nothing_is_active(script: Path, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(script)], env=clean_env(), capture_output=True, text=True, check=False)
    got = report(done)
    assert not got["script"]["active"] and not got["child"]["active"]


def test_exit_code_is_the_commands(script: Path, tmp_path: Path) -> None:
    assert vllm_compat_run(["--", sys.executable, str(script), "7"], clean_env(), tmp_path).returncode == 7
    killed = vllm_compat_run(
        ["--", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"], clean_env(), tmp_path
    )
    assert killed.returncode == -signal.SIGTERM  # killed by the signal, exactly as the command run directly


# A command that reports its pid, then counts the SIGINTs it gets for a while (a Ctrl-C must arrive once).
COUNT_SIGINTS = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGINT, lambda *_: got.append(time.monotonic()))
print(os.getpid(), flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end and not (got and time.monotonic() > got[0] + 1.5):
    time.sleep(0.02)
print(len(got), flush=True)
"""


def start_run(args: list[str], tmp_path: Path, **popen: object) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "vllm_compat.cli", "run", *args]
    return subprocess.Popen(cmd, env=clean_env(), cwd=tmp_path, stdout=subprocess.PIPE, text=True, **popen)


def test_one_ctrl_c_reaches_the_command_once(tmp_path: Path) -> None:
    """A terminal sends Ctrl-C's SIGINT to the whole foreground process group; a wrapper that forwards it too made
    the command see two."""
    (tmp_path / "count.py").write_text(COUNT_SIGINTS)
    proc = start_run(["--", sys.executable, str(tmp_path / "count.py"), "20"], tmp_path, start_new_session=True)
    try:
        int(proc.stdout.readline())  # the command runs (and has its handler)
        os.killpg(proc.pid, signal.SIGINT)  # as the terminal does
        out, _ = proc.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert out.split() == ["1"], f"the command got {out.split()} SIGINTs for one Ctrl-C"


def test_killing_the_run_process_kills_the_command(tmp_path: Path) -> None:
    """SIGKILL cannot be passed on: a wrapper process killed outright left the command running, orphaned."""
    proc = start_run(
        ["--", sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],
        tmp_path,
        start_new_session=True,
    )
    try:
        command_pid = int(proc.stdout.readline())
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(command_pid):
            time.sleep(0.05)
        assert not _alive(command_pid), "the command outlived the vllm-compat run process that was killed"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in {"Z", "X"}


def test_empty_pythonpath_entries_keep_meaning_the_current_directory(tmp_path: Path) -> None:
    """An empty PYTHONPATH entry is the current directory; dropping it broke imports of the user's own modules."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (work / "users_module.py").write_text("VALUE = 42\n")
    (elsewhere / "main.py").write_text("import users_module; print(users_module.VALUE)\n")
    env = clean_env(PYTHONPATH=os.pathsep.join([str(elsewhere), ""]))  # a trailing empty entry: the current directory
    direct = subprocess.run(
        [sys.executable, str(elsewhere / "main.py")], env=env, cwd=work, capture_output=True, text=True, check=False
    )
    assert direct.stdout.strip() == "42", direct.stderr  # what Python does without vllm-compat
    done = vllm_compat_run(["--", sys.executable, str(elsewhere / "main.py")], env, work)
    assert (done.returncode, done.stdout.strip()) == (0, "42"), done.stderr
    assert cli.run_environment({"PYTHONPATH": f"{os.pathsep}/x"})["PYTHONPATH"] == os.pathsep.join(
        [str(cli.BOOTSTRAP), "", "/x"]
    )
    assert cli.run_environment({})["PYTHONPATH"] == str(cli.BOOTSTRAP)


def test_the_environments_sitecustomize_still_runs_once(script: Path, user_site: Path, tmp_path: Path) -> None:
    env = clean_env(PYTHONPATH=str(user_site))
    got = report(vllm_compat_run(["--", sys.executable, str(script)], env, tmp_path))
    assert got["script"]["active"] and got["child"]["active"]
    # each process adds its own run to the count it inherited: the vllm-compat process 1, the script 2, its child 3
    assert (got["script"]["user_site"], got["child"]["user_site"]) == ("2", "3")


def test_no_recursion_when_nested_or_listed_twice(script: Path, user_site: Path, tmp_path: Path) -> None:
    bootstrap = str(cli.BOOTSTRAP)
    env = clean_env(PYTHONPATH=os.pathsep.join([bootstrap, str(user_site), bootstrap]))
    nested = ["--", sys.executable, "-m", "vllm_compat.cli", "run", "--", sys.executable, str(script)]
    done = vllm_compat_run(nested, env, tmp_path)
    assert done.returncode == 0, done.stderr
    got = report(done)
    assert got["script"]["active"] and got["child"]["active"]
    # one run per process: the outer and the inner vllm-compat process, the script, its child
    assert (got["script"]["user_site"], got["child"]["user_site"]) == ("3", "4")
    assert cli.run_environment(env)["PYTHONPATH"].split(os.pathsep).count(bootstrap) == 1


def test_a_failing_sitecustomize_is_reported_and_the_script_runs(script: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken_site"
    broken.mkdir()
    (broken / "sitecustomize.py").write_text("raise RuntimeError('broken on purpose')\n")
    done = vllm_compat_run(["--", sys.executable, str(script)], clean_env(PYTHONPATH=str(broken)), tmp_path)
    assert done.returncode == 0, done.stderr
    assert "broken on purpose" in done.stderr
    assert report(done)["script"]["active"]


def test_disable_and_strict_are_passed_on(script: Path, tmp_path: Path) -> None:
    got = report(vllm_compat_run(["--", sys.executable, str(script)], clean_env(VLLM_COMPAT_DISABLE="1"), tmp_path))
    assert not got["script"]["active"] and not got["child"]["active"]
    strict = vllm_compat_run(["--strict", "--", sys.executable, str(script)], clean_env(), tmp_path)
    got = report(strict)
    assert got["script"]["strict"] == "1" and got["script"]["active"] and got["child"]["active"]
    # strict mode probes when speculators' generator is imported, never at start-up (it imported vLLM and torch:
    # seconds in every Python process, including those that never use vLLM)
    assert got["script"]["heavy"] == [] and strict.returncode == 0, strict.stderr


def test_usage_errors(tmp_path: Path, capsys) -> None:
    assert cli.main(["run"]) == cli.EXIT_USAGE
    assert cli.main(["run", "--"]) == cli.EXIT_USAGE
    assert cli.main(["run", "--", str(tmp_path / "no-such-command")]) == cli.EXIT_NOT_FOUND
    not_executable = tmp_path / "plain.txt"
    not_executable.write_text("")
    assert cli.main(["run", "--", str(not_executable)]) == cli.EXIT_NOT_EXECUTABLE
    assert "command not found" in capsys.readouterr().err


# -- VLLM_COMPAT_AUTO: the .pth start-up hook --------------------------------------------------------------------
AUTO_CHECK = """
import json, site, sys
site.addsitedir(sys.argv[1])  # processes the .pth exactly as start-up does for site-packages
m = sys.modules.get("vllm_compat")
print(json.dumps({"imported": m is not None, "active": bool(m and m.status()["installed"])}))
"""


@pytest.mark.parametrize(("value", "active"), [("1", True), ("", False), ("0", False)])
def test_auto_pth_acts_only_when_asked(tmp_path: Path, value: str, active: bool) -> None:
    site_dir = tmp_path / "site-packages"
    site_dir.mkdir()
    shutil.copy(PTH, site_dir)
    env = clean_env(VLLM_COMPAT_AUTO=value)
    done = subprocess.run(
        [sys.executable, "-c", AUTO_CHECK, str(site_dir)], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert report(done) == {"imported": active, "active": active}


def test_auto_with_strict_probes_nothing_at_start_up(tmp_path: Path) -> None:
    """VLLM_COMPAT_AUTO=1 VLLM_COMPAT_STRICT=1 in an environment: every interpreter start imported vLLM and torch for
    the strict check (about 12 s each); the check now waits for speculators' generator."""
    site_dir = tmp_path / "site-packages"
    site_dir.mkdir()
    shutil.copy(PTH, site_dir)
    check = AUTO_CHECK.replace('"active": bool(m and m.status()["installed"])', '"heavy": "vllm" in sys.modules')
    done = subprocess.run(
        [sys.executable, "-c", check, str(site_dir)],
        env=clean_env(VLLM_COMPAT_AUTO="1", VLLM_COMPAT_STRICT="1"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert report(done) == {"imported": True, "heavy": False}


def test_auto_pth_reports_a_failed_import(tmp_path: Path) -> None:
    site_dir = tmp_path / "site-packages"
    site_dir.mkdir()
    (site_dir / PTH.name).write_text(PTH.read_text().replace("import vllm_compat", "import vllm_compat_missing"))
    done = subprocess.run(
        [sys.executable, "-c", AUTO_CHECK, str(site_dir)],
        env=clean_env(VLLM_COMPAT_AUTO="1"),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0
    assert "VLLM_COMPAT_AUTO is set but vllm_compat could not be imported" in done.stderr


def test_the_build_puts_the_pth_at_the_top_of_site_packages(tmp_path: Path) -> None:
    """setup.py's build_py copies the .pth to the build root, which becomes the wheel's (site-packages') top."""
    pytest.importorskip("setuptools")
    build = tmp_path / "lib"
    done = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(build)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (build / PTH.name).read_text() == PTH.read_text()
    assert (build / "vllm_compat" / "_bootstrap" / "sitecustomize.py").exists()


def test_the_pth_line_is_one_import_statement() -> None:
    """site.py executes only lines that start with ``import``; anything else would be taken for a path."""
    lines = [ln for ln in PTH.read_text().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("import ")
