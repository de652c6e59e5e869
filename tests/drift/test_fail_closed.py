"""Fail closed on drift no adapter knows: a real vLLM release with one thing changed the way no adapter expects.

Each test takes the real sources of vLLM 0.16.0 (the ``vllm_tree`` fixture) and changes ONE thing speculators or an
adapter relies on: a renamed parameter, a function moved to a module nobody knows, a new required field, a changed
return convention. The probe must report it as unhandled (drifted with no adapter, or unknown), naming the probe,
the vLLM symbol and what it observed instead (the hint: the new name, the new signature, where it looked, file:line);
and ``vllm-compat probe --strict --source TREE`` must exit 1 with the table saying what is not covered and what to do.
The same changes made to a live vLLM are in tests/e2e/test_fail_closed.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.drift.test_capability import cut_function, edit
from vllm_compat.apiview.static import StaticView
from vllm_compat.findings import State
from vllm_compat.plan import Plan, make_plan

pytestmark = pytest.mark.wheels

RELEASE = "0.16.0"
LINES = ("0.3.0", "0.4.0.1")


@pytest.fixture
def tree(vllm_tree) -> Path:
    return vllm_tree(RELEASE)


def plan_of(tree: Path) -> Plan:
    return make_plan(StaticView(tree), LINES)


def unhandled(plan: Plan, probe: str) -> list:
    found = [f for f in plan.findings if f.probe == probe]
    assert found, f"no finding of {probe}"
    return [f for f in found if f.state is not State.BASELINE and not f.handled]


def probe_cli(tree: Path, *extra: str) -> subprocess.CompletedProcess:
    script = shutil.which("vllm-compat")
    cmd = [script] if script else [sys.executable, "-m", "vllm_compat.cli"]
    return subprocess.run(
        [*cmd, "probe", "--strict", "--source", str(tree), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def assert_cli_fails_closed(tree: Path, probe: str, symbol: str, state: str, hint: str) -> None:
    table = probe_cli(tree)
    assert table.returncode == 1, table.stdout[-3000:] + table.stderr
    assert "Traceback" not in table.stderr
    row = next(line for line in table.stdout.splitlines() if line.strip().startswith(probe + " "))
    assert ("UNHANDLED" if state == "drifted" else "UNKNOWN") in row
    assert hint in " ".join(table.stdout.split())  # the table wraps long lines
    assert "not covered: " in table.stdout and f"{probe} ({symbol})" in table.stdout
    assert "what to do:" in table.stdout
    assert table.stdout.splitlines()[1].startswith("verdict: FAIL"), "the verdict comes first"
    report = json.loads(probe_cli(tree, "--json").stdout)
    assert report["ok"] is False
    named = [f for f in report["findings"] if f["probe"] == probe and not f["handled"]]
    assert named and all(f["symbol"] == symbol and f["state"] == state for f in named)
    assert all(hint in f["observed"] or hint in f["evidence"] for f in named)


def test_renamed_parameter(tree: Path) -> None:
    """``get_kv_cache_config_from_groups(kv_cache_groups=...)`` becomes ``groups=...``: both lines pass the old name."""
    edit(
        tree,
        "vllm/v1/core/kv_cache_utils.py",  # vllm/v1/core/kv_cache_utils.py:1069 in 0.16.0
        "    vllm_config: VllmConfig,\n    kv_cache_groups: list[KVCacheGroupSpec],\n    available_memory: int,\n"
        ") -> KVCacheConfig:",
        "    vllm_config: VllmConfig,\n    groups: list[KVCacheGroupSpec],\n    available_memory: int,\n"
        ") -> KVCacheConfig:",
    )
    probe, symbol = "kv_cache.config_from_groups_kwargs", "vllm.v1.core.kv_cache_utils.get_kv_cache_config_from_groups"
    found = unhandled(plan_of(tree), probe)
    assert {f.speculators for f in found} == set(LINES)
    for f in found:
        assert f.state is State.DRIFTED and f.symbol == symbol and f.adapter is None
        assert "rejects=kv_cache_groups" in f.variant and "requires=groups" in f.variant
        assert "get_kv_cache_config_from_groups(vllm_config, groups, available_memory)" in f.observed
        assert "vllm/v1/core/kv_cache_utils.py:1069" in f.evidence
    assert_cli_fails_closed(tree, probe, symbol, "drifted", "groups, available_memory")


def test_function_moved_to_an_unknown_module(tree: Path) -> None:
    """``get_request_block_hasher`` leaves kv_cache_utils for a module no probe knows (0.4.0.1 imports it)."""
    moved = cut_function(tree, "vllm/v1/core/kv_cache_utils.py", "get_request_block_hasher")
    (tree / "vllm/v1/core/block_hashing.py").write_text('"""Block hashing."""\n\n' + moved)
    plan = plan_of(tree)
    probe, symbol = (
        "import.v1.core.kv_cache_utils.get_request_block_hasher",
        ("vllm.v1.core.kv_cache_utils.get_request_block_hasher"),
    )
    (found,) = unhandled(plan, probe)
    assert found.speculators == "0.4.0.1" and found.state is State.DRIFTED and found.variant == "missing"
    assert found.observed == (
        "vllm.v1.core.kv_cache_utils has no get_request_block_hasher, and it is not at any known new place"
    )
    (factory,) = unhandled(plan, "request.block_hasher_factory")  # the call can no longer be judged either
    assert factory.variant == "missing"
    assert_cli_fails_closed(tree, probe, symbol, "drifted", "not at any known new place")


def test_new_required_field(tree: Path) -> None:
    """SchedulerConfig gains a required field: neither line passes it, and no adapter can invent its value."""
    anchor = "    is_encoder_decoder: InitVar[bool]\n"  # vllm/config/scheduler.py:35 in 0.16.0
    edit(tree, "vllm/config/scheduler.py", anchor, anchor + "    tenant_id: str\n")
    probe, symbol = "config.scheduler_config_kwargs", "vllm.config.SchedulerConfig"
    found = unhandled(plan_of(tree), probe)
    assert {f.speculators for f in found} == set(LINES)
    for f in found:
        assert f.state is State.DRIFTED and f.symbol == symbol and "tenant_id" in f.variant
        assert "tenant_id" in f.observed and "vllm/config/scheduler.py:" in f.evidence
    # 0.3.0's variant also holds is_encoder_decoder, which an adapter covers alone; together they are unhandled
    (v030,) = [f for f in found if f.speculators == "0.3.0"]
    assert v030.variant == "requires=is_encoder_decoder,tenant_id"
    assert_cli_fails_closed(tree, probe, symbol, "drifted", "tenant_id")


def test_changed_return_convention(tree: Path) -> None:
    """``collective_rpc`` returns a dict keyed by rank: a shape neither speculators line was written for."""
    edit(
        tree,
        "vllm/v1/executor/multiproc_executor.py",  # vllm/v1/executor/multiproc_executor.py:363 in 0.16.0
        "return responses[0] if output_rank is not None else responses",
        'return {"by_rank": dict(enumerate(responses))}',
    )
    probe = "executor.unique_reply_shape"
    symbol = "vllm.v1.executor.multiproc_executor.MultiprocExecutor.collective_rpc"
    found = unhandled(plan_of(tree), probe)
    assert {f.speculators for f in found} == set(LINES)
    for f in found:
        assert f.state is State.UNKNOWN and f.symbol == symbol
        assert f.observed == "could not tell: no return statement of a known shape"
        assert "vllm/v1/executor/multiproc_executor.py:" in f.evidence
    assert_cli_fails_closed(tree, probe, symbol, "unknown", "no return statement of a known shape")
    # without --strict an unknown fact does not fail the report (the documented contract); the generator's guard
    # counts it as unhandled all the same (tests/e2e/test_fail_closed.py)
    assert probe_cli(tree).returncode == 1
    lenient = subprocess.run(
        [sys.executable, "-m", "vllm_compat.cli", "probe", "--source", str(tree)], capture_output=True, timeout=300
    )
    assert lenient.returncode == 0


def test_extensible_kv_cache_forced_on(vllm_tree) -> None:
    """vLLM 0.34.0, but its resolver turns the extensible KV cache on whatever was asked: the explicit False that
    extensible-kv-cache-off passes would not hold, so the drift is unhandled."""
    tree = vllm_tree("0.34.0")
    edit(
        tree,
        "vllm/config/vllm.py",  # vllm/config/vllm.py:3250 in 0.34.0
        "        if requested is None:\n            enabled = unsupported is None",
        "        if True:\n            enabled = unsupported is None",
    )
    probe, symbol = "kv_cache.commitment", "vllm.config.CacheConfig.enable_extensible_kv_cache"
    found = unhandled(make_plan(StaticView(tree), LINES), probe)
    assert {f.speculators for f in found} == set(LINES)
    assert all(f.variant == "forced" and f.adapter is None for f in found)
    assert_cli_fails_closed(tree, probe, symbol, "drifted", "whatever was asked")


def test_a_new_engine_start_up_step(vllm_tree) -> None:
    """vLLM 0.34.0, but EngineCore's start-up asks the executor for one more thing: nobody reviewed whether
    speculators' hand-built engine needs it, so it is unhandled (as extend_kv_cache should have been)."""
    tree = vllm_tree("0.34.0")
    anchor = "            self.model_executor.extend_kv_cache(num_blocks)\n"  # vllm/v1/engine/core.py:418 in 0.34.0
    edit(tree, "vllm/v1/engine/core.py", anchor, anchor + "            self.model_executor.pin_kv_cache_pages()\n")
    probe, symbol = "engine.startup_steps", "vllm.v1.engine.core.EngineCore._initialize_kv_caches"
    found = unhandled(make_plan(StaticView(tree), LINES), probe)
    assert {f.speculators for f in found} == set(LINES)
    assert all(f.variant == "unreviewed=pin_kv_cache_pages" for f in found)
    assert_cli_fails_closed(tree, probe, symbol, "drifted", "pin_kv_cache_pages")
