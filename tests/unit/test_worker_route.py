"""Which route brought vllm-compat to vLLM's workers, as ``status()`` and the guard's summary say it (the routes on a
real engine, in the generator's process and in every worker: tests/e2e/test_extraction.py)."""

from __future__ import annotations

import pytest
from vllm_compat.adapters import plugin_fallback

from tests.unit import test_engine as base
from tests.unit.test_plugin_processes import in_fork, spawned_status
from vllm_compat import engine as engine_module
from vllm_compat import plugin

sandbox = base.sandbox


def test_the_plugin_route_is_named_in_the_worker() -> None:
    status = spawned_status("1")
    assert status["worker_route"] == "plugin"
    assert "entry point" in status["worker_route_why"]


def test_a_worker_that_did_not_opt_in_names_no_route() -> None:
    status = spawned_status(None)
    assert status["worker_route"] is None and status["worker_route_why"] is None


@pytest.mark.parametrize("plugins", ["none", "other_plugin", ""])
def test_vllm_plugins_without_vllm_compat_takes_the_fallback(monkeypatch: pytest.MonkeyPatch, plugins: str) -> None:
    monkeypatch.setenv("VLLM_PLUGINS", plugins)
    route, why = plugin_fallback.workers_route()
    assert route == "worker-extension-fallback"
    assert why == (
        f"vllm_compat.worker.HiddenStatesWorkerExtension as the worker extension: VLLM_PLUGINS={plugins!r} leaves "
        "vllm_compat out"
    )


def test_the_installed_entry_point_takes_the_plugin_route(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert plugin_fallback.workers_route()[0] == "plugin"  # this checkout is installed, entry point included
    monkeypatch.setenv("VLLM_PLUGINS", "vllm_compat,other")
    assert plugin_fallback.workers_route()[0] == "plugin"


def test_the_fallback_adapter_is_armed_not_claimed_as_the_route() -> None:
    assert "acts only where" in plugin_fallback.WorkerExtensionFallback.always


def test_the_generator_process_is_not_taken_for_a_worker(sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    """While its constructor starts the workers, the generator's own process has VLLM_COMPAT_ACTIVE=1 too; a plugin
    load there (vLLM may load plugins in the caller's process) must not say it is a worker reached by the plugin."""
    engine, _ = sandbox
    monkeypatch.setattr(plugin, "route", None)
    monkeypatch.setenv(engine_module.ENV_ACTIVE, "1")
    engine.starting_workers = engine_module.os.getpid()
    plugin.register()
    assert plugin.route is None and engine.status()["worker_route"] is None

    def child() -> dict:  # a worker forked while the constructor runs inherits the flag, but has its own pid
        plugin.register()
        return {"route": plugin.route, "installed": engine_module.engine.installed}

    assert in_fork(child) == {"route": "plugin", "installed": True}


def test_the_summary_names_the_route(sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _ = sandbox
    monkeypatch.setattr(plugin, "route", None)  # the generator's process, not a worker
    engine.worker_route = ("worker-extension-fallback", "X as the worker extension: VLLM_PLUGINS='none' leaves it out")
    plan = engine_module.make_plan(engine.view(), ("0.4.0.1",), [], cache={})
    summary = engine._summary(engine_module.judge_line(), plan)
    assert summary.endswith("; workers reached through X as the worker extension: VLLM_PLUGINS='none' leaves it out")
    assert engine.status()["worker_route"] == "worker-extension-fallback"
