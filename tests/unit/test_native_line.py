"""The native line (speculators 0.5 to 0.9, extraction through `vllm serve`): which line a version is judged as, how
``vllm-compat probe`` chooses it, and the probes' judgements on tiny vLLM trees (the real releases are in
tests/drift/test_native_wheels.py)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from vllm_compat.probes.native_connector import _fits

import vllm_compat.cli as cli
from vllm_compat.apiview.static import StaticView
from vllm_compat.errors import SourceError
from vllm_compat.findings import State
from vllm_compat.lines import LineVerdict
from vllm_compat.plan import load_probes, make_plan
from vllm_compat.versions import NATIVE_LINES, SPECULATORS_LINES, line_kind, native_line, speculators_line

NATIVE = tuple(NATIVE_LINES)


def tree(root: Path, files: dict[str, str], version: str = "9.9.9") -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for path in list(root.rglob("*.py")):
        for folder in path.relative_to(root).parents:
            if folder != Path("."):
                (root / folder / "__init__.py").touch()
    info = root / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return root


@pytest.fixture
def empty_tree(tmp_path: Path) -> Path:
    """A vLLM with none of the native path: every native fact is missing."""
    return tree(tmp_path / "empty", {"vllm/__init__.py": ""})


# -- which line ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("version", "line"),
    [
        ("0.5.0", "native-0.5"),
        ("0.6.0.2", "native-0.6"),
        ("0.7.0.1", "native-0.7"),
        ("0.8.1", "native-0.8"),
        ("0.9.0", "native-0.9"),
        ("0.4.0.1", None),
        ("0.3.0", None),
        ("0.10.0", None),
        (None, None),
    ],
)
def test_native_line_of_a_version(version: str | None, line: str | None) -> None:
    assert native_line(version) == line
    if version is not None and line is not None:
        assert speculators_line(version) is None  # a version is of one kind of line only


def test_line_kinds() -> None:
    assert {line_kind(line) for line in NATIVE} == {"native"}
    assert {line_kind(line) for line in SPECULATORS_LINES} == {"in_process"}


def test_every_native_probe_is_judged_for_native_lines_only() -> None:
    probes = load_probes()
    native = {pid: p for pid, p in probes.items() if pid.startswith("native.")}
    assert len(native) >= 30
    for pid, p in probes.items():
        lines = set(p.expected)
        if pid in native:
            assert lines <= set(NATIVE), pid
            assert p.surface.startswith("native_"), (pid, p.surface)  # probes/native_*.py, beside the others
        else:
            assert not lines & set(NATIVE), pid
    # every native line is judged on the config contract, the server and the saved file
    for pid in ("native.config.method", "native.config.layer_index", "native.server.completions",
                "native.output.saved_file", "native.connector.example"):  # fmt: skip
        assert set(native[pid].expected) == set(NATIVE)
    # hs-connectors' imports are facts of the lines that run hs-connectors inside vLLM (0.8, 0.9)
    hsc = {pid for pid in native if pid.startswith("native.import.")}
    assert all(set(native[pid].expected) <= {"native-0.8", "native-0.9"} for pid in hsc)
    assert set(native["native.connector.write_tensors"].expected) == {"native-0.9"}


@pytest.mark.parametrize(("asked", "line"), [("0.9.0", "native-0.9"), ("0.5.0", "native-0.5"), ("0.8.1", "native-0.8")])
def test_speculators_choice_takes_a_native_release(asked: str, line: str) -> None:
    lines, version, how = cli.speculators_choice(asked)
    assert lines == (line,) and version == asked
    assert f"judged as the {line} line" in how


def test_speculators_choice_refuses_what_no_line_serves() -> None:
    with pytest.raises(SourceError, match=r"0\.5\.x to 0\.9\.x"):
        cli.speculators_choice("0.10.0")


def test_an_installed_native_speculators_is_judged_as_its_line(monkeypatch) -> None:
    monkeypatch.setattr(cli, "judge_line", lambda: LineVerdict(None, "absent", "0.8.1"))
    lines, version, how = cli.speculators_choice(None)
    assert lines == ("native-0.8",) and version == "0.8.1"
    assert "speculators 0.8.1 installed" in how


def test_no_speculators_still_judges_both_in_process_lines(monkeypatch) -> None:
    monkeypatch.setattr(cli, "judge_line", lambda: LineVerdict(None, "absent"))
    assert cli.speculators_choice(None)[0] == tuple(SPECULATORS_LINES)


def test_in_process_code_wins_over_a_native_metadata(monkeypatch) -> None:
    """Generator code on the path is the in-process line whatever the metadata says (lines.py's rule)."""
    monkeypatch.setattr(
        cli, "judge_line", lambda: LineVerdict("0.4.0.1", "code", "0.9.0", (("m", "f", "0.4.0.1", "x"),))
    )
    assert cli.speculators_choice(None)[0] == ("0.4.0.1",)


# -- the report --------------------------------------------------------------------------------------------------
def test_a_vllm_without_the_native_path_fails_with_what_to_do(empty_tree: Path, capsys) -> None:
    rc = cli.main(["probe", "--source", str(empty_tree), "--speculators", "0.9.0", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and report["ok"] is False
    assert report["speculators_lines"] == ["native-0.9"] and report["speculators_version"] == "0.9.0"
    assert {f["speculators"] for f in report["findings"]} == {"native-0.9"}
    assert all(f["probe"].startswith("native.") for f in report["findings"])
    assert "native.config.method" in report["unhandled"]
    assert report["adapters"] == []  # no connector: nothing for native-connector-on-cpu to cover
    assert report["proof"][0]["level"] == "code_only"
    rc = cli.main(["probe", "--source", str(empty_tree), "--speculators", "0.9.0"])
    table = " ".join(capsys.readouterr().out.split())
    assert rc == 1
    assert "native-0.9: speculators extracts through `vllm serve`" in table
    assert "pin a vLLM release this report passes for the line" in table


def test_the_in_process_report_has_no_native_note(empty_tree: Path, capsys) -> None:
    cli.main(["probe", "--source", str(empty_tree), "--speculators", "0.4.0.1"])
    assert "extracts through `vllm serve`" not in capsys.readouterr().out


# -- probes on tiny trees ----------------------------------------------------------------------------------------
_LLAMA_AFTER = """
class LlamaModel:
    def forward(self, input_ids, positions):
        aux_hidden_states = self._maybe_add_hidden_state([], 0, hidden_states, residual)
        for idx, layer in enumerate(self.layers):
            hidden_states, residual = layer(positions, hidden_states, residual)
            self._maybe_add_hidden_state(aux_hidden_states, idx + 1, hidden_states, residual)
        return hidden_states
"""
_LLAMA_BEFORE = """
class LlamaModel:
    def forward(self, input_ids, positions):
        aux_hidden_states = []
        for idx, layer in enumerate(self.layers):
            if idx in self.aux_hidden_state_layers:
                aux_hidden_states.append(hidden_states + residual)
            hidden_states, residual = layer(positions, hidden_states, residual)
        return hidden_states
"""


@pytest.mark.parametrize(("source", "variant"), [(_LLAMA_AFTER, "baseline"), (_LLAMA_BEFORE, "before_layer")])
def test_layer_index_convention(tmp_path: Path, source: str, variant: str) -> None:
    root = tree(tmp_path / "t", {"vllm/model_executor/models/llama.py": source})
    (finding,) = make_plan(StaticView(root), ["native-0.5"], ["native.config.layer_index"]).findings
    assert finding.variant == variant
    assert finding.state is (State.BASELINE if variant == "baseline" else State.DRIFTED)
    assert "vllm/model_executor/models/llama.py:" in finding.evidence


_EXAMPLE = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"


_SAVE = "        save_file(tensors, filename)\n"


@pytest.mark.parametrize(
    ("write", "variant"),
    [
        ("    @staticmethod\n    def _write_tensors(tensors, event, filename, lock_fd):\n" + _SAVE, "baseline"),
        ("    def _write_tensors(self, tensors, event, filename, lock_fd):\n" + _SAVE, "changed"),
        ("    @staticmethod\n    def _write_tensors(tensors, filename):\n" + _SAVE, "changed"),
        ("", "missing"),
    ],
)
def test_write_tensors(tmp_path: Path, write: str, variant: str) -> None:
    """hs-connectors 0.9.0's fp8 connector overrides the staticmethod _write_tensors(tensors, event, filename,
    lock_fd): anything else and its quantizing write is never called, or called wrongly."""
    calls = "        self._write_tensors(tensors, event, filename, fd)\n" if write else ""
    text = f"class ExampleHiddenStatesConnector:\n    def wait_for_save(self):\n        pass\n{calls}{write}"
    root = tree(tmp_path / "t", {_EXAMPLE: text})
    (finding,) = make_plan(StaticView(root), ["native-0.9"], ["native.connector.write_tensors"]).findings
    assert finding.variant == variant


def test_connector_creation_in_extend_kv_cache(tmp_path: Path) -> None:
    base = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
    files = {
        "vllm/v1/worker/extensible_kv_cache.py": """
            def extend_kv_cache(runner, kv_cache_config, num_blocks):
                ensure_kv_transfer_initialized(runner.vllm_config, kv_cache_config)
        """,
        base: """
            class KVConnectorBase_V1:
                @classmethod
                def kv_cache_access(cls, kv_transfer_config):
                    return KVCacheAccess.IN_PROCESS
        """,
    }
    root = tree(tmp_path / "t", files)
    (finding,) = make_plan(StaticView(root), ["native-0.9"], ["native.connector.creation"]).findings
    assert finding.variant == "after_warmup_in_process" and finding.state is State.BASELINE
    (root / base).write_text((root / base).read_text().replace("IN_PROCESS", "REGISTERS"))
    (finding,) = make_plan(StaticView(root), ["native-0.9"], ["native.connector.creation"]).findings
    assert finding.variant == "after_warmup_registers" and finding.state is State.DRIFTED


def test_override_call_shapes() -> None:
    from vllm_compat.apiview import Param

    def params(*names: str, kind: str = "positional_or_keyword") -> tuple[Param, ...]:
        return tuple(Param(n, kind, True) for n in names)

    assert _fits(("request", "block_ids"), params("request", "block_ids")) == []
    assert _fits(("*", "**"), params("forward_context")) == []
    assert (
        _fits(("layer_name", "kv_layer", "attn_metadata", "**"), params("layer_name", "kv_layer", "attn_metadata"))
        == []
    )
    assert _fits(("request", "block_ids"), params("request", "block_ids", "group")) == ["cannot take group"]
    assert _fits(("request", "blocks"), params("request", "block_ids")) == [
        "cannot take block_ids",
        "expects blocks, which the base does not pass",
    ]
