"""``vllm_compat.status()`` reads as a few lines for people and stays a plain mapping for programs;
``vllm-compat status`` prints it."""

from __future__ import annotations

import json
import pickle
from types import SimpleNamespace

import pytest

import vllm_compat
import vllm_compat.cli as cli
from vllm_compat import engine as engine_module
from vllm_compat import plugin

OBSERVED = "vllm.v1.request.Request(request_id, prompt_token_ids, sampling_params, " + "x=\u2026, " * 300 + ")"


@pytest.fixture
def generator_process(monkeypatch: pytest.MonkeyPatch):
    """A fresh engine as in the generator's process after its constructor ran: two adapters applied, plugin route."""
    fresh = engine_module._Engine()
    fresh.installed = True
    fresh.hooked = {"vllm.v1.request", "speculators.data_generation.vllm_hidden_states_generator"}
    fresh.applied = {
        "request-eos-token-id": SimpleNamespace(reason=f"request.request_kwargs: {OBSERVED}"),
        "async-scheduling-off": SimpleNamespace(reason="always: a run-time condition"),
    }
    fresh.guard = object()
    fresh.worker_route = ("plugin", "the vllm_compat entry point, loaded by vLLM in each worker")
    monkeypatch.setattr(engine_module, "engine", fresh)
    monkeypatch.setattr(plugin, "route", None)
    monkeypatch.setattr(plugin, "loaded", False)
    return fresh


def test_status_prints_as_a_few_readable_lines(generator_process) -> None:
    status = vllm_compat.status()
    text = str(status)
    lines = text.splitlines()
    assert 8 <= len(lines) <= 25 and max(len(line) for line in lines) <= 120, text
    assert "the generator's process" in lines[0]
    # what was applied, and why: the finding each adapter covers (a long one cut in the text, whole in the mapping)
    assert any(
        line.strip().startswith("request-eos-token-id  request.request_kwargs: vllm.v1.request") for line in lines
    )
    assert any("async-scheduling-off" in line and "always" in line for line in lines)
    assert OBSERVED not in text and OBSERVED in status["applied"]["request-eos-token-id"]
    # plugin_loaded False beside the plugin route is explained, not left as a contradiction
    assert "reach" in text and "plugin route" in text
    flat = " ".join(text.split())
    explained = flat[flat.index("plugin_loaded: False") : flat.index("guarded: True")]
    assert "expected" in explained and "workers" in explained
    for flag in ("guarded: True", "strict: False", "pass_through: none"):
        assert any(line.strip().startswith(flag) and len(line.strip()) > len(flag) + 10 for line in lines), flag


def test_status_stays_a_mapping_with_its_keys(generator_process) -> None:
    status = vllm_compat.status()
    assert isinstance(status, dict)
    assert repr(status) == repr(dict(status))
    back = json.loads(json.dumps(status))
    assert back == dict(status)
    for key in (
        "installed", "strict", "vllm_version", "speculators_version", "speculators_line", "speculators_line_judged",
        "applied", "pass_through", "hooks", "guarded", "plugin_loaded", "worker_route", "worker_route_why", "pid",
    ):  # fmt: skip
        assert key in status, key
    assert status["worker_route"] == "plugin" and status["in_worker"] is False
    copy = pickle.loads(pickle.dumps(status))
    assert type(copy) is dict and copy == dict(status), "pickles (torch.save) as the plain dict it was"


def test_status_in_a_worker_says_it_is_one(generator_process, monkeypatch: pytest.MonkeyPatch) -> None:
    generator_process.worker_route = None
    monkeypatch.setattr(plugin, "route", "plugin")
    monkeypatch.setattr(plugin, "loaded", True)
    status = vllm_compat.status()
    assert status["in_worker"] is True
    text = str(status)
    assert text.splitlines()[0].startswith("vllm-compat in a vLLM worker process")
    assert "expected" not in text  # plugin_loaded True in a worker needs no excuse


def test_status_pass_through_and_not_installed_are_explained(generator_process) -> None:
    generator_process.installed = False
    generator_process.applied = {}
    generator_process.pass_through = {"test-shim": ["Thing.method"]}
    text = str(vllm_compat.status())
    assert "installed: no" in text
    assert "pass_through: test-shim (1 wrapper(s)): reverted by uninstall()" in " ".join(text.split())


def test_cli_status_prints_the_text(generator_process, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("vllm-compat in the generator's process") and "guarded: True" in out


def test_cli_status_json(generator_process, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--json"]) == cli.EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert data["applied"]["request-eos-token-id"].endswith(OBSERVED) and data["worker_route"] == "plugin"


def test_status_names_a_native_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """speculators 0.5 to 0.9 has no generator code to judge: the line comes from the installed metadata, and the text
    says how vllm-compat reaches that line's processes (a new user's run saw "no line, judged: absent" and the
    in-process generator's worker routes)."""
    from vllm_compat.lines import LineVerdict

    monkeypatch.setattr(engine_module, "engine", engine_module._Engine())
    monkeypatch.setattr(engine_module, "judge_line", lambda: LineVerdict(None, "absent", "0.9.0"))
    monkeypatch.setattr(plugin, "route", None)
    status = vllm_compat.status()
    assert status["speculators_line"] == "native-0.9" and status["speculators_line_judged"] == "metadata"
    flat = " ".join(str(status).split())
    assert "(line native-0.9, judged: metadata)" in flat and "`vllm-compat run --`" in flat
    assert "a generator built now" not in flat
    monkeypatch.setattr(engine_module, "judge_line", lambda: LineVerdict(None, "absent", None))
    assert vllm_compat.status()["speculators_line"] is None  # no speculators at all: still no line
