"""vllm-compat's log lines reach the user in processes that configure no logging (vLLM's workers), exactly once where
the application configures logging, and nothing is printed on import. Real interpreters, as a user's script runs."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

# A script that knows nothing of logging, as vLLM's worker processes: it installs vllm-compat (directly, or through
# the plugin as a worker does) and logs one line per level on vllm-compat's logger.
SCRIPT = """
import logging, os, sys
route = sys.argv[1]
{setup}
if route == "plugin":
    from vllm_compat import plugin
    plugin.register()
else:
    import vllm_compat
    vllm_compat.install()
log = logging.getLogger("vllm_compat")
log.debug("debug-line")
log.info("info-line")
log.warning("warning-line")
"""


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_COMPAT_")}
    env.update({"VLLM_COMPAT_DISABLE": "1", **extra})  # install() is called by the script itself
    return env


def run(tmp_path: Path, route: str = "install", setup: str = "", **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(setup=setup))
    return subprocess.run(
        [sys.executable, str(script), route],
        env=clean_env(**env),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.endswith("-line")]


@pytest.mark.parametrize("route", ["install", "plugin"])
def test_warnings_and_info_reach_stderr_without_logging_configured(tmp_path: Path, route: str) -> None:
    done = run(tmp_path, route, VLLM_COMPAT_ACTIVE="1")
    assert done.returncode == 0, done.stderr
    found = lines(done.stderr)
    assert [ln.split()[-1] for ln in found] == ["info-line", "warning-line"], done.stderr
    assert found[1].startswith("WARNING ") and "[vllm_compat pid " in found[1]
    assert done.stdout == ""


def test_level_and_opt_out(tmp_path: Path) -> None:
    quiet = run(tmp_path, VLLM_COMPAT_LOGGING_LEVEL="warning")
    assert [ln.split()[-1] for ln in lines(quiet.stderr)] == ["warning-line"]
    verbose = run(tmp_path, VLLM_COMPAT_LOGGING_LEVEL="DEBUG")
    assert [ln.split()[-1] for ln in lines(verbose.stderr)] == ["debug-line", "info-line", "warning-line"]
    off = run(tmp_path, VLLM_COMPAT_CONFIGURE_LOGGING="0")
    assert lines(off.stderr) == [], "opted out, yet vllm-compat configured logging"


def test_an_application_that_configures_logging_gets_each_line_once(tmp_path: Path) -> None:
    setup = "logging.basicConfig(stream=sys.stdout, level=logging.INFO, format='APP %(levelname)s %(message)s')"
    done = run(tmp_path, setup=setup)
    assert done.returncode == 0, done.stderr
    assert lines(done.stdout) == ["APP INFO info-line", "APP WARNING warning-line"]
    assert lines(done.stderr) == [], "printed twice: by the application's handler and by vllm-compat's"


def test_an_application_level_on_the_logger_is_kept(tmp_path: Path) -> None:
    done = run(tmp_path, setup="logging.getLogger('vllm_compat').setLevel(logging.ERROR)")
    assert lines(done.stderr) == []


def test_nothing_is_printed_on_import(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_COMPAT_")}  # import installs
    done = subprocess.run(
        [sys.executable, "-c", "import vllm_compat; assert vllm_compat.status()['installed']"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_caplog_still_sees_the_records(caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_compat import log

    logger = logging.getLogger("vllm_compat")
    handlers, level = list(logger.handlers), logger.level
    try:
        log.configure()
        with caplog.at_level(logging.INFO, logger="vllm_compat"):
            logger.warning("seen-by-caplog")
        assert [r.getMessage() for r in caplog.records] == ["seen-by-caplog"]
        assert "seen-by-caplog" not in capsys.readouterr().err
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
