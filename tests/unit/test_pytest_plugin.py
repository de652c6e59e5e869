"""The pytest drift guard (``pytest_vllm_compat``, entry point group ``pytest11``): off unless asked; when asked, a
session on a vLLM with drift no adapter covers ends before any test runs, with the probe report.

The drifted vLLM is the real 0.16.0 source tree with one change no adapter can know about in advance: ``Request``
gains a required parameter ``totally_new_field``. Each session runs in a fresh interpreter (``runpytest_subprocess``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

NEW_FIELD = "totally_new_field"
# installed (pip install -e .): pytest loads it through the entry point; otherwise name the module
INSTALLED = any(ep.value == "pytest_vllm_compat" for ep in importlib.metadata.entry_points(group="pytest11"))
PLUGIN = () if INSTALLED else ("-p", "pytest_vllm_compat")
A_TEST = """
import sys

def test_runs():
    assert True

def test_plugin_imported_nothing_of_vllm_compat():
    assert ("vllm_compat" in sys.modules) == {guarded}
"""


@pytest.fixture
def drifted_tree(vllm_tree) -> Path:
    tree = vllm_tree("0.16.0")
    request = tree / "vllm/v1/request.py"
    text = request.read_text()
    anchor = "        eos_token_id: int | None,\n"  # vllm/v1/request.py:65 in 0.16.0
    assert text.count(anchor) == 1
    request.write_text(text.replace(anchor, anchor + f"        {NEW_FIELD}: int,\n"))
    return tree


def run(pytester: pytest.Pytester, *args: str, guarded: bool = True) -> pytest.RunResult:
    pytester.makepyfile(test_a=A_TEST.format(guarded=guarded))
    return pytester.runpytest_subprocess(*PLUGIN, "-p", "no:cacheprovider", *args)


def test_off_unless_asked(pytester: pytest.Pytester) -> None:
    result = run(pytester, guarded=False)
    result.assert_outcomes(passed=2)
    assert "vllm-compat guard" not in result.stdout.str() + result.stderr.str()


def test_the_options_are_listed(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess(*PLUGIN, "--help")
    for option in ("--vllm-compat-guard", "--vllm-compat-source", "--vllm-compat-strict", "vllm_compat_guard"):
        result.stdout.fnmatch_lines([f"*{option}*"])


@pytest.mark.wheels
def test_unhandled_drift_ends_the_session_before_any_test(pytester: pytest.Pytester, drifted_tree: Path) -> None:
    result = run(pytester, "--vllm-compat-source", str(drifted_tree))
    assert result.ret == 1
    out = result.stdout.str()
    assert "vllm-compat probe: vLLM 0.16.0" in out  # the probe report, as `vllm-compat probe` prints it
    assert "request.request_kwargs" in out and "UNHANDLED" in out and NEW_FIELD in out
    assert "verdict: FAIL" in out
    assert "has drift that no adapter covers: request.request_kwargs" in out
    assert "passed" not in out and "test_a.py" not in out  # nothing was collected or run


@pytest.mark.wheels
def test_ini_options(pytester: pytest.Pytester, drifted_tree: Path) -> None:
    pytester.makeini(f"[pytest]\nvllm_compat_guard = true\nvllm_compat_source = {drifted_tree}\n")
    assert run(pytester).ret == 1
    pytester.makeini(f"[pytest]\nvllm_compat_guard = false\nvllm_compat_source = {drifted_tree}\n")
    assert run(pytester).ret == 1  # a source alone asks for the guard
    pytester.makeini(f"[pytest]\nvllm_compat_source = {drifted_tree}\nvllm_compat_speculators = 0.3.0\n")
    result = run(pytester)
    assert result.ret == 1
    assert "speculators 0.3.0:" in result.stdout.str() and "speculators 0.4.0.1:" not in result.stdout.str()


@pytest.mark.wheels
def test_covered_drift_lets_the_session_run(pytester: pytest.Pytester, vllm_tree) -> None:
    """vLLM 0.16.0 as released: its drift for speculators 0.3.0 is covered by adapters."""
    result = run(pytester, "--vllm-compat-source", str(vllm_tree("0.16.0")))
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["vllm-compat guard: vLLM 0.16.0 (*): OK (* drifted findings, all covered; 0 unknown)"])


@pytest.mark.wheels
def test_strict_fails_on_facts_it_cannot_establish(pytester: pytest.Pytester, vllm_tree) -> None:
    tree = vllm_tree("0.12.0")
    (tree / "vllm/model_executor/models/llama.py").write_text("class LlamaModel(:\n    pass\n")
    source = ["--vllm-compat-source", str(tree), "--vllm-compat-speculators", "0.4.0.1"]
    run(pytester, *source).assert_outcomes(passed=2)
    result = run(pytester, *source, "--vllm-compat-strict")
    assert result.ret == 1
    assert "UNKNOWN" in result.stdout.str() and "covers: model." in result.stdout.str()


def test_a_source_that_cannot_be_read_exits_2(pytester: pytest.Pytester, tmp_path: Path) -> None:
    result = run(pytester, "--vllm-compat-source", str(tmp_path / "nowhere"))
    assert result.ret == 2
    assert "vllm-compat guard:" in result.stdout.str() and "no such file or folder" in result.stdout.str()
    bad = run(pytester, "--vllm-compat-source", str(tmp_path), "--vllm-compat-speculators", "9.9")
    assert bad.ret == 2 and "unknown speculators line" in bad.stdout.str()


def test_the_installed_vllm_by_default(pytester: pytest.Pytester) -> None:
    result = run(pytester, "--vllm-compat-guard")
    if importlib.util.find_spec("vllm") is None:
        assert result.ret == 2 and "no vLLM is installed here" in result.stdout.str()
    else:
        assert "vllm-compat" in result.stdout.str() + result.stderr.str()


def test_the_entry_point_loads_it_without_dash_p(pytester: pytest.Pytester, tmp_path: Path) -> None:
    if not INSTALLED:
        pytest.skip("vllm-compat's metadata predates the pytest11 entry point: pip install -e .")
    pytester.makepyfile(test_a=A_TEST.format(guarded=True))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--vllm-compat-source", str(tmp_path / "nowhere"))
    assert result.ret == 2 and "vllm-compat guard:" in result.stdout.str()
