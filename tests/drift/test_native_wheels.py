"""The native line's probes against real vLLM wheels: speculators 0.5 to 0.9 through `vllm serve`.

For each release below, ``make_plan(StaticView(wheel), NATIVE)`` must report exactly the (probe, line, variant)
triples in ``EXPECTED_VARIANTS`` as other than ``baseline`` (drifted, or a variant the line runs with, such as the
runner that serves extract_hidden_states), and nothing it cannot tell. Each entry's comment cites the release's
source that makes it true (paths inside the wheel, ``kv_connector/v1/`` short for
``vllm/distributed/kv_transfer/kv_connector/v1/``; for a ``missing`` member, the class that lacks it). The native
path appears in vLLM 0.17.0 but collects the layers one off until 0.18.0 (``before_layer``): 0.16.0 and 0.17.x are
judged as lacking it. hs-connectors 0.8 / 0.9 need HiddenStateCacheSpec and 0.9's fp8 connector needs
``_write_tensors``, both from vLLM 0.22.0.

``vllm-compat probe --source vllm==X --speculators 0.9.0 --json`` reports the same native-0.9 findings, and exits 0
exactly where none of them is unhandled. A fact hs-connectors needs, edited out of a real tree, fails closed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.drift import by_version, plan_getter
from tests.drift.test_capability import edit
from vllm_compat import cli
from vllm_compat.findings import State
from vllm_compat.plan import Plan
from vllm_compat.proof import proof_for

pytestmark = pytest.mark.wheels

N05, N06, N07, N08, N09 = NATIVE = ("native-0.5", "native-0.6", "native-0.7", "native-0.8", "native-0.9")
ALL, HSC = NATIVE, (N08, N09)
Variant = tuple[str, str, str]  # (probe id, speculators line, variant)

_METHOD, _LAYER_IDS, _LAYER_INDEX = "native.config.method", "native.config.layer_ids", "native.config.layer_index"
_CONNECTOR, _WRITE, _CREATION = (
    "native.connector.example",
    "native.connector.write_tensors",
    "native.connector.creation",
)
_SAVED, _RUNNER = "native.output.saved_file", "native.runner.extract_hidden_states"
_COPY = "native.connector.device_copy"  # torch.cuda.Stream() and pin_memory=True: the lines cited
_V1 = "native.import.distributed.kv_transfer.kv_connector.v1"
_EXAMPLE_MODULE = f"{_V1}.example_hidden_states_connector"
_EXAMPLE, _EXTRACT = f"{_EXAMPLE_MODULE}.ExampleHiddenStatesConnector", f"{_EXAMPLE_MODULE}.extract_from_kv_cache"
_CACHE_ONLY = "native.import.model_executor.models.extract_hidden_states.CacheOnlyAttentionLayer"
_SPEC = "native.import.v1.kv_cache_interface.HiddenStateCacheSpec"


def each(lines: tuple[str, ...], probe: str, variant: str) -> tuple[Variant, ...]:
    return tuple((probe, line, variant) for line in lines)


# release -> every native finding whose variant is not baseline. Comments cite the release's own source.
EXPECTED_VARIANTS: dict[str, set[Variant]] = {
    "0.16.0": {
        *each(ALL, _COPY, "missing"),  # no kv_connector/v1/example_hidden_states_connector.py
        *each(ALL, _LAYER_IDS, "missing"),  # no vllm/v1/spec_decode/extract_hidden_states.py
        *each(ALL, "native.config.draft_hf_config", "ignored"),  # vllm/config/speculative.py:56
        *each(ALL, "native.connector.storage_path", "missing"),  # no kv_connector/v1/example_hidden_states_connector.py
        *each(ALL, _LAYER_INDEX, "before_layer"),  # vllm/model_executor/models/llama.py:401
        *each(ALL, _METHOD, "missing"),  # vllm/config/speculative.py:56
        *each(ALL, _CONNECTOR, "missing"),  # no kv_connector/v1/example_hidden_states_connector.py
        *each((N09,), _WRITE, "missing"),  # no example_hidden_states_connector.py
        *each((N09,), _EXAMPLE_MODULE, "missing"),  # no example_hidden_states_connector.py
        *each(HSC, _EXAMPLE, "missing"),  # no example_hidden_states_connector.py
        *each(HSC, _EXTRACT, "missing"),  # no example_hidden_states_connector.py
        *each(HSC, _CACHE_ONLY, "missing"),  # no vllm/model_executor/models/extract_hidden_states.py
        *each(HSC, _SPEC, "missing"),  # vllm/v1/kv_cache_interface.py: no class HiddenStateCacheSpec
        *each(ALL, _SAVED, "missing"),  # no example_hidden_states_connector.py
        *each(ALL, _RUNNER, "missing"),  # no extract_hidden_states proposer (V1 or V2)
    },
    "0.17.0": {
        *each(ALL, _LAYER_INDEX, "before_layer"),  # vllm/model_executor/models/llama.py:401
        *each((N09,), _WRITE, "missing"),  # kv_connector/v1/example_hidden_states_connector.py:102
        *each(HSC, _SPEC, "missing"),  # vllm/v1/kv_cache_interface.py: no class HiddenStateCacheSpec
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/v1/spec_decode/extract_hidden_states.py:31
    },
    "0.17.1": {
        *each(ALL, _LAYER_INDEX, "before_layer"),  # vllm/model_executor/models/llama.py:401
        *each((N09,), _WRITE, "missing"),  # kv_connector/v1/example_hidden_states_connector.py:102
        *each(HSC, _SPEC, "missing"),  # vllm/v1/kv_cache_interface.py: no class HiddenStateCacheSpec
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/v1/spec_decode/extract_hidden_states.py:31
    },
    "0.18.0": {
        *each((N09,), _WRITE, "missing"),  # kv_connector/v1/example_hidden_states_connector.py:102
        *each(HSC, _SPEC, "missing"),  # vllm/v1/kv_cache_interface.py: no class HiddenStateCacheSpec
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/v1/spec_decode/extract_hidden_states.py:26
    },
    "0.18.1": {
        *each((N09,), _WRITE, "missing"),  # kv_connector/v1/example_hidden_states_connector.py:102
        *each(HSC, _SPEC, "missing"),  # vllm/v1/kv_cache_interface.py: no class HiddenStateCacheSpec
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/v1/spec_decode/extract_hidden_states.py:26
    },
    "0.19.0": {
        *each((N09,), _WRITE, "missing"),  # kv_connector/v1/example_hidden_states_connector.py:102
        *each(HSC, _SPEC, "missing"),  # vllm/v1/kv_cache_interface.py: no class HiddenStateCacheSpec
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/v1/spec_decode/extract_hidden_states.py:26
    },
    "0.19.1": {
        *each((N09,), _WRITE, "missing"),  # kv_connector/v1/example_hidden_states_connector.py:102
        *each(HSC, _SPEC, "missing"),  # vllm/v1/kv_cache_interface.py: no class HiddenStateCacheSpec
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/v1/spec_decode/extract_hidden_states.py:26
    },
    "0.20.0": {
        *each((N09,), _WRITE, "missing"),  # kv_connector/v1/example_hidden_states_connector.py:102
        *each(HSC, _SPEC, "missing"),  # vllm/v1/kv_cache_interface.py: no class HiddenStateCacheSpec
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/v1/spec_decode/extract_hidden_states.py:26
    },
    "0.20.1": {
        *each((N09,), _WRITE, "missing"),  # kv_connector/v1/example_hidden_states_connector.py:102
        *each(HSC, _SPEC, "missing"),  # vllm/v1/kv_cache_interface.py: no class HiddenStateCacheSpec
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/v1/spec_decode/extract_hidden_states.py:26
    },
    "0.20.2": {
        *each((N09,), _WRITE, "missing"),  # kv_connector/v1/example_hidden_states_connector.py:102
        *each(HSC, _SPEC, "missing"),  # vllm/v1/kv_cache_interface.py: no class HiddenStateCacheSpec
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/v1/spec_decode/extract_hidden_states.py:26
    },
    "0.21.0": {
        *each((N09,), _WRITE, "missing"),  # kv_connector/v1/example_hidden_states_connector.py:102
        *each(HSC, _SPEC, "missing"),  # vllm/v1/kv_cache_interface.py: no class HiddenStateCacheSpec
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/v1/spec_decode/extract_hidden_states.py:26
    },
    "0.22.0": {
        *each(ALL, _COPY, "cuda_copy_stream"),  # kv_connector/v1/example_hidden_states_connector.py:209, :358
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/config/vllm.py:1977; vllm/v1/spec_decode/extract_hidden_states.py:28
    },
    "0.22.1": {
        *each(ALL, _COPY, "cuda_copy_stream"),  # kv_connector/v1/example_hidden_states_connector.py:209, :358
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/config/vllm.py:1977; vllm/v1/spec_decode/extract_hidden_states.py:28
    },
    "0.23.0": {
        *each(ALL, _COPY, "cuda_copy_stream"),  # kv_connector/v1/example_hidden_states_connector.py:209, :358
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/config/vllm.py:1982; vllm/v1/spec_decode/extract_hidden_states.py:28
    },
    "0.24.0": {
        *each(ALL, _COPY, "cuda_copy_stream"),  # kv_connector/v1/example_hidden_states_connector.py:209, :351
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/config/vllm.py:1994; vllm/v1/spec_decode/extract_hidden_states.py:28
    },
    "0.25.0": {
        *each(ALL, _COPY, "cuda_copy_stream"),  # kv_connector/v1/example_hidden_states_connector.py:250, :394
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/config/vllm.py:2042; vllm/v1/spec_decode/extract_hidden_states.py:29
    },
    "0.25.1": {
        *each(ALL, _COPY, "cuda_copy_stream"),  # kv_connector/v1/example_hidden_states_connector.py:250, :394
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/config/vllm.py:2042; vllm/v1/spec_decode/extract_hidden_states.py:29
    },
    "0.26.0": {
        *each(ALL, _COPY, "cuda_copy_stream"),  # kv_connector/v1/example_hidden_states_connector.py:250, :394
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/config/vllm.py:2127; vllm/v1/spec_decode/extract_hidden_states.py:29
    },
    "0.27.0": {
        *each(ALL, _COPY, "cuda_copy_stream"),  # kv_connector/v1/example_hidden_states_connector.py:250, :394
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/config/vllm.py:2166; vllm/v1/spec_decode/extract_hidden_states.py:29
    },
    "0.27.1": {
        *each(ALL, _COPY, "cuda_copy_stream"),  # kv_connector/v1/example_hidden_states_connector.py:250, :394
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/config/vllm.py:2166; vllm/v1/spec_decode/extract_hidden_states.py:29
    },
    "0.28.0": {
        *each(ALL, _COPY, "cuda_copy_stream"),  # kv_connector/v1/example_hidden_states_connector.py:250, :394
        *each(ALL, _RUNNER, "v1_fallback"),  # vllm/config/vllm.py:2369; vllm/v1/spec_decode/extract_hidden_states.py:28
    },
    "0.29.0": {
        *each(ALL, _COPY, "cuda_copy_stream"),  # kv_connector/v1/example_hidden_states_connector.py:243, :389
        *each(ALL, _RUNNER, "v2"),  # vllm/v1/worker/gpu/spec_decode/extract_hidden_states.py:18
    },
    "0.30.0": {
        *each(ALL, _COPY, "cuda_copy_stream"),  # kv_connector/v1/example_hidden_states_connector.py:244, :391
        *each(ALL, _RUNNER, "v2"),  # vllm/v1/worker/gpu/spec_decode/extract_hidden_states.py:18
    },
    "0.31.0": {
        *each(ALL, _COPY, "cuda_copy_stream"),  # kv_connector/v1/example_hidden_states_connector.py:256, :403
        *each(ALL, _RUNNER, "v2"),  # vllm/v1/worker/gpu/spec_decode/extract_hidden_states.py:18
    },
    "0.32.0": {
        *each(ALL, _COPY, "cuda_copy_stream"),  # kv_connector/v1/example_hidden_states_connector.py:256, :403
        *each(ALL, _RUNNER, "v2"),  # vllm/v1/worker/gpu/spec_decode/extract_hidden_states.py:18
    },
    "0.33.0": {
        *each(ALL, _COPY, "cuda_copy_stream"),  # kv_connector/v1/example_hidden_states_connector.py:256, :403
        *each(ALL, _RUNNER, "v2"),  # vllm/v1/worker/gpu/spec_decode/extract_hidden_states.py:18
    },
    "0.34.0": {
        *each(ALL, _COPY, "cuda_copy_stream"),  # kv_connector/v1/example_hidden_states_connector.py:257, :404
        *each(
            ALL, _CREATION, "after_warmup_in_process"
        ),  # vllm/v1/worker/extensible_kv_cache.py:489; kv_connector/v1/base.py:205
        *each(ALL, _RUNNER, "v2"),  # vllm/v1/worker/gpu/spec_decode/extract_hidden_states.py:20
    },
}
# variants a line runs with unchanged, and drift an adapter covers (the rest of each set is unhandled drift)
ACCEPTED = {"v1_fallback", "v2", "after_warmup_in_process"}
COVERED = {(_COPY, "cuda_copy_stream"): "native-connector-on-cpu"}  # on vLLM's CPU platform; nothing on a GPU
RELEASES = by_version(EXPECTED_VARIANTS)


@pytest.fixture(scope="module")
def plan_for():
    return plan_getter(NATIVE)


def _variants(plan: Plan) -> set[Variant]:
    return {(f.probe, f.speculators, f.variant) for f in plan.findings if f.variant != "baseline"}


@pytest.mark.parametrize("release", RELEASES)
def test_native_variants_are_exactly_the_table(plan_for, release: str) -> None:
    plan = plan_for(release)
    assert plan.vllm_version == release
    found, expected = _variants(plan), EXPECTED_VARIANTS[release]
    assert found == expected, (
        f"vLLM {release}: reported but not in the table: {sorted(found - expected)}; "
        f"in the table but not reported: {sorted(expected - found)}"
    )
    for f in plan.findings:
        assert f.state is not State.UNKNOWN, (f.probe, f.speculators, f.observed)  # every fact is decided
        assert (f.state is State.DRIFTED) == (f.variant not in ACCEPTED | {"baseline"}), (f.probe, f.variant)
        assert f.adapter == COVERED.get((f.probe, f.variant))  # the native line's one adapter, for that drift only
        assert f.handled is (f.variant in ACCEPTED | {"baseline"} or f.adapter is not None)


def test_the_table_covers_every_release_from_0_18() -> None:
    """Every vLLM release 0.18.0 to 0.34.0, patch releases included, and the two before the native path."""
    assert RELEASES == [
        "0.16.0", "0.17.0", "0.17.1", "0.18.0", "0.18.1", "0.19.0", "0.19.1", "0.20.0", "0.20.1", "0.20.2", "0.21.0",
        "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0",
        "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0",
    ]  # fmt: skip


def passing(release: str, line: str) -> bool:
    return not any(
        line == ln and variant not in ACCEPTED and (probe, variant) not in COVERED
        for probe, ln, variant in EXPECTED_VARIANTS[release]
    )


def test_which_releases_each_line_works_with() -> None:
    """What docs/compatibility.md's native section says: 0.5 to 0.7 from vLLM 0.18.0, 0.8 and 0.9 from 0.22.0."""
    first = {line: next(r for r in RELEASES if passing(r, line)) for line in NATIVE}
    assert first == {N05: "0.18.0", N06: "0.18.0", N07: "0.18.0", N08: "0.22.0", N09: "0.22.0"}
    for line in NATIVE:  # and every release after the first passes
        assert all(passing(r, line) for r in RELEASES[RELEASES.index(first[line]) :])


@pytest.mark.parametrize("release", RELEASES)
def test_probe_cli_json_for_speculators_0_9_0(release: str, capsys) -> None:
    """``vllm-compat probe --source vllm==X --speculators 0.9.0 --json``: the native-0.9 facts with their variants."""
    rc = cli.main(["probe", "--source", f"vllm=={release}", "--speculators", "0.9.0", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["speculators_lines"] == [N09] and report["speculators_version"] == "0.9.0"
    got = {(f["probe"], f["speculators"], f["variant"]) for f in report["findings"] if f["variant"] != "baseline"}
    assert got == {v for v in EXPECTED_VARIANTS[release] if v[1] == N09}
    assert len(report["findings"]) == 38  # every fact native-0.9 touches, baseline ones included
    assert report["unknown"] == []
    covered = sorted({COVERED[(p, v)] for p, ln, v in EXPECTED_VARIANTS[release] if ln == N09 and (p, v) in COVERED})
    assert report["adapters"] == covered
    proof = proof_for(release, N09)  # the end-to-end record shipped with vllm-compat
    assert report["proof"][0]["level"] == proof.level
    assert rc == (0 if passing(release, N09) and proof.level != "failed" else 1) and report["ok"] is (rc == 0)


# -- fail closed: one fact hs-connectors needs, edited out of a real tree --------------------------------------------
_BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
_EXAMPLE_FILE = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"


def probe_cli(tree: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_compat.cli", "probe", "--source", str(tree), "--speculators", "0.9.0", *extra],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def assert_fails_closed(tree: Path, probe: str, hint: str) -> None:
    table = probe_cli(tree)
    assert table.returncode == 1, table.stdout[-3000:] + table.stderr
    assert "Traceback" not in table.stderr
    assert table.stdout.splitlines()[1].startswith("verdict: FAIL")
    row = next(line for line in table.stdout.splitlines() if line.strip().startswith(probe + " "))
    assert "UNHANDLED" in row
    assert f"not covered: {probe} (" in table.stdout or f", {probe} (" in table.stdout
    assert "pin a vLLM release this report passes for the line" in " ".join(table.stdout.split())
    report = json.loads(probe_cli(tree, "--json").stdout)
    assert report["ok"] is False and probe in report["unhandled"]
    (finding,) = [f for f in report["findings"] if f["probe"] == probe]
    assert hint in finding["observed"] + finding["evidence"]
    # the same edit leaves every other native fact as it was on the real release (the connector's CUDA-only copy
    # there is drift native-connector-on-cpu covers)
    assert {f["probe"] for f in report["findings"] if f["state"] == "drifted" and not f["handled"]} == {probe}
    assert {f["probe"] for f in report["findings"] if f["handled"] and f["adapter"]} <= {_COPY}


def test_write_tensors_renamed(vllm_tree) -> None:
    """vLLM 0.34.0, but ExampleHiddenStatesConnector's private _write_tensors is renamed: hs-connectors 0.9.0's fp8
    connector would override nothing, and its files would be written unquantized."""
    tree = vllm_tree("0.34.0")
    text = (tree / _EXAMPLE_FILE).read_text()
    assert text.count("_write_tensors") == 2  # vllm/.../example_hidden_states_connector.py:330 and :437 in 0.34.0
    (tree / _EXAMPLE_FILE).write_text(text.replace("_write_tensors", "_write_payload"))
    assert_fails_closed(tree, _WRITE, "no _write_tensors")


def test_base_method_signature_changed(vllm_tree) -> None:
    """vLLM 0.34.0, but KVConnectorBase_V1.request_finished takes a new required argument: the mooncake connector's
    override (request, block_ids) cannot take what vLLM passes."""
    tree = vllm_tree("0.34.0")
    edit(
        tree,
        _BASE,  # vllm/distributed/kv_transfer/kv_connector/v1/base.py:661 in 0.34.0
        '    def request_finished(\n        self,\n        request: "Request",\n        block_ids: list[int],\n',
        '    def request_finished(\n        self,\n        request: "Request",\n        block_ids: list[int],\n'
        "        group_ids: list[int],\n",
    )
    assert_fails_closed(tree, "native.connector.overrides", "request_finished: cannot take group_ids")


def test_a_moved_import(vllm_tree) -> None:
    """vLLM 0.30.0, but extract_from_kv_cache (which hs-connectors' mooncake connector imports) leaves its module."""
    from tests.drift.test_capability import cut_function

    tree = vllm_tree("0.30.0")
    moved = cut_function(tree, _EXAMPLE_FILE, "extract_from_kv_cache")
    (tree / "vllm/v1/kv_cache_extract.py").write_text('"""Moved."""\n\n' + moved)
    assert_fails_closed(tree, _EXTRACT, "not at any known new place")


def test_an_unreadable_fact_is_unknown_and_strict_fails_on_it(vllm_tree) -> None:
    """vLLM 0.34.0, but LlamaModel.forward collects the aux hidden states in a way no probe knows: the layer-index
    fact is unknown. Without --strict the report still passes (an unknown fact is not drift); with --strict it fails
    naming the fact (--allow-code-only: the native line has no end-to-end record, which --strict refuses too)."""
    tree = vllm_tree("0.34.0")
    rel = "vllm/model_executor/models/llama.py"
    text = (tree / rel).read_text()
    assert text.count("self._maybe_add_hidden_state(") == 2  # vllm/model_executor/models/llama.py:429, :439 in 0.34.0
    (tree / rel).write_text(text.replace("self._maybe_add_hidden_state(", "self._record_layer_output("))
    lenient = probe_cli(tree, "--json")
    report = json.loads(lenient.stdout)
    assert lenient.returncode == 0 and report["unknown"] == [_LAYER_INDEX] and report["unhandled"] == []
    strict = probe_cli(tree, "--strict", "--allow-code-only")
    assert strict.returncode == 1, strict.stdout[-2000:]
    row = next(line for line in strict.stdout.splitlines() if line.strip().startswith(_LAYER_INDEX + " "))
    assert "UNKNOWN" in row
    assert "collects aux hidden states in no known way" in " ".join(strict.stdout.split())
    assert probe_cli(tree, "--strict").returncode == 1  # and without --allow-code-only: not proven end to end


def test_a_cuda_only_copy_the_adapter_does_not_know(vllm_tree) -> None:
    """vLLM 0.32.0, but the connector also calls torch.cuda.synchronize() before its copy: a CUDA-only call
    native-connector-on-cpu does not replace, so the copy path is unhandled (on vLLM's CPU platform it would kill the
    engine; the adapter refuses it at import there too: tests/unit/test_native_connector_adapter.py)."""
    tree = vllm_tree("0.32.0")
    edit(
        tree,
        _EXAMPLE_FILE,  # vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py:388 in 0.32.0
        "        copy_stream.wait_event(ready_event)\n",
        "        copy_stream.wait_event(ready_event)\n        torch.cuda.synchronize()\n",
    )
    assert_fails_closed(tree, _COPY, "torch.cuda.synchronize")
