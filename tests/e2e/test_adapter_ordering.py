"""The ordering suite every adapter gets automatically (dd-trace-py's PatchTestCase, for vllm-compat's adapters).

For every adapter in ``vllm_compat.adapter.load_adapters()`` and against the real speculators and vLLM modules of
this environment: import then install, install then import, install twice, install / uninstall / install, uninstall
without install, and after each uninstall the patched attributes hold the very same objects as before (identity).
Each scenario runs once, in a fresh interpreter (tests/e2e/ordering.py), for all adapters at once; the test items
are per scenario and adapter. An adapter that does not serve the installed speculators line, or whose ``apply()``
does not fit this vLLM release (it patches something the release does not have), is skipped with the reason.

A new adapter needs nothing here: it is registered, so it is tested.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_compat.adapter import load_adapters

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent
ADAPTERS = sorted(load_adapters())
SCENARIO_TIMEOUT = 600


@pytest.fixture(scope="module")
def scenario_runs(tmp_path_factory: pytest.TempPathFactory):
    """``run(name)`` -> the scenario's JSON record; each scenario runs once per module, in its own interpreter."""
    done: dict[str, dict[str, Any]] = {}
    folder = tmp_path_factory.mktemp("ordering")

    def run(name: str) -> dict[str, Any]:
        if name not in done:
            out = folder / f"{name}.json"
            env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_COMPAT_")}
            proc = subprocess.run(
                [sys.executable, str(HERE / "ordering.py"), name, "--out", str(out)],
                env=env,
                capture_output=True,
                text=True,
                timeout=SCENARIO_TIMEOUT,
                check=False,
            )
            if not out.exists():
                pytest.fail(f"scenario {name} wrote no record (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
            record = json.loads(out.read_text())
            assert record["ok"], f"scenario {name} failed: {record.get('error')}\n{record.get('trace', '')}"
            done[name] = record
        return done[name]

    return run


@pytest.fixture(params=ADAPTERS)
def adapter_id(request: pytest.FixtureRequest) -> str:
    return request.param


class AdapterOrderingSuite:
    """The ordering contract, one test per scenario, run for every registered adapter."""

    @staticmethod
    def adapter(record: dict[str, Any], adapter_id: str, applied_key: str = "applied_installed") -> dict[str, Any]:
        """The adapter's record in a scenario; skips when the adapter has nothing to patch in this environment."""
        info = record["adapters"].get(adapter_id)
        if info is None:
            pytest.fail(f"{adapter_id} is registered here but unknown to the scenario process (not installed?)")
        if not info["serves"]:
            pytest.skip(f"{adapter_id} does not serve speculators {record['speculators']}")
        if info["not_applicable"]:
            pytest.skip(f"{adapter_id} does not fit vLLM {record['vllm']}: {info['not_applicable']}")
        if info["not_importable_before_install"]:
            pytest.skip(
                f"{info['target']} cannot be imported before vllm-compat here (import vllm_compat first, as "
                f"documented): {info['not_importable_before_install']}"
            )
        if not info[applied_key]:
            pytest.skip(f"{adapter_id} found nothing to patch with vLLM {record['vllm']} here")
        return info

    def test_install_then_import(self, scenario_runs, adapter_id: str) -> None:
        info = self.adapter(scenario_runs("install-then-import"), adapter_id)
        assert info["apply_calls"] == 1
        assert info["problems"] == []

    def test_import_then_install(self, scenario_runs, adapter_id: str) -> None:
        record = scenario_runs("import-then-install")
        info = self.adapter(record, adapter_id)
        assert info["apply_calls"] == 1
        assert info["problems"] == []
        assert record["module_diffs"].get(info["target"], []) == []

    def test_install_twice(self, scenario_runs, adapter_id: str) -> None:
        """install(), install(), import, install(): applied once, patched once."""
        info = self.adapter(scenario_runs("install-twice"), adapter_id)
        assert info["apply_calls"] == 1
        assert info["problems"] == []

    def test_install_uninstall_install(self, scenario_runs, adapter_id: str) -> None:
        """Applied again after an uninstall, in place while installed, and reverted to the originals each time."""
        info = self.adapter(scenario_runs("install-uninstall-install"), adapter_id, "applied_first")
        assert info["applied_second"], "not applied again after uninstall() and install()"
        assert info["apply_calls"] == 2
        assert info["problems"] == []

    def test_uninstall_without_install(self, scenario_runs, adapter_id: str) -> None:
        record = scenario_runs("uninstall-without-install")
        assert record["installed_after_uninstall"] is False
        info = self.adapter(record, adapter_id)
        assert record["module_diffs"].get(info["target"], []) == [], "uninstall() without install() changed it"
        assert info["apply_calls"] == 1, "a later install() must still apply it, once"
        assert info["problems"] == []


class TestEveryAdapter(AdapterOrderingSuite):
    pass


@pytest.mark.parametrize("scenario", ["import-then-install", "uninstall-without-install"])
def test_uninstall_restores_the_modules(scenario_runs, scenario: str) -> None:
    """Every attribute of every target module and of the classes it binds is the very same object as before, the
    environment and sys.modules included (whatever adapter patched it)."""
    record = scenario_runs(scenario)
    assert {k: v for k, v in record["module_diffs"].items() if v} == {}
    assert record.get("engine_problems", []) == []


@pytest.mark.parametrize(
    "scenario", ["install-then-import", "install-twice", "install-uninstall-install", "uninstall-without-install"]
)
def test_the_engine_guards_follow_the_same_contract(scenario_runs, scenario: str) -> None:
    """The drift guard on the generator's constructor and the missing-name guards on vLLM modules: in place while
    installed (under any adapter wrapping the same attribute), and the originals back after uninstall()."""
    assert scenario_runs(scenario).get("engine_problems", []) == []
