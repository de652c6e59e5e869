"""``vllm-compat probe`` on the installed vLLM: the default (its files, read with ast) and ``--live`` (imported) print
one report on stdout and nothing else, and find the same.

Importing vLLM logs to stdout (its logger's default stream): before ``--live`` sent that to stderr, ``probe --json``
on an installed vLLM was not JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.e2e.report import record

pytestmark = pytest.mark.e2e


def probe(*args: str, cwd) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "vllm_compat.cli", "probe", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=cwd,  # outside the checkout: the installed vllm_compat
    )
    return done, time.perf_counter() - start


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cwd = tmp_path_factory.mktemp("probe-cli")
    out = {}
    for name, args in (("static", ()), ("live", ("--live",))):
        done, seconds = probe("--json", "--family", "all", *args, cwd=cwd)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        out[name] = json.loads(done.stdout)  # the whole of stdout: one JSON object, nothing else
        record(f"probe_{name}_seconds", round(seconds, 2))
    return out


def test_stdout_is_one_json_object(reports: dict) -> None:
    assert reports["static"]["source"] == "static" and reports["live"]["source"] == "live"
    assert reports["static"]["vllm_version"] == reports["live"]["vllm_version"]


def test_static_and_live_find_the_same(reports: dict) -> None:
    """The same finding for every fact, except where the live import of a model's module fails in this environment
    (a family's optional dependency missing, such as torchvision for Qwen3-VL): reading the files cannot see that,
    which is what ``--live`` is for."""

    def facts(report: dict) -> dict:
        return {(f["probe"], f["speculators"]): f for f in report["findings"]}

    static, live = facts(reports["static"]), facts(reports["live"])
    assert static.keys() == live.keys()
    not_importable = set()
    for key, seen in live.items():
        if seen["state"] == "unknown" and "does not import here" in seen["observed"]:
            not_importable.add(key[0])
            continue
        want = static[key]
        assert (seen["state"], seen["variant"], seen["evidence"]) == (want["state"], want["variant"], want["evidence"])
    record("probe_live_not_importable", sorted(not_importable))
    assert len(not_importable) < len({k[0] for k in live}) // 4, "most facts must be established both ways"
    if not not_importable:
        for key in ("adapters", "unhandled", "unknown", "ok"):
            assert reports["static"][key] == reports["live"][key], key
    for key in ("families", "speculators_lines", "vllm_range", "vllm_version"):
        assert reports["static"][key] == reports["live"][key], key


def test_the_default_families_agree_whole(tmp_path) -> None:
    """Without --family (Llama, the default), every key of the two reports but `source` is the same."""
    (static, _), (live, _) = probe("--json", cwd=tmp_path), probe("--json", "--live", cwd=tmp_path)
    static, live = json.loads(static.stdout), json.loads(live.stdout)
    assert {k: v for k, v in static.items() if k != "source"} == {k: v for k, v in live.items() if k != "source"}


def test_the_live_table_holds_only_the_report(tmp_path) -> None:
    done, _seconds = probe("--live", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("vllm-compat probe: vLLM "), done.stdout[:500]
    assert done.stdout.splitlines()[1].startswith("verdict: OK: ")
