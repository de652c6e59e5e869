"""The speculators line is judged from the code Python imports; the metadata decides only where no code is found.

The trees here are stand-ins: a ``speculators`` package whose generator and worker modules hold only the calls the line
markers look for (vllm_compat/lines.py), and optionally a dist-info claiming another release.
"""

from __future__ import annotations

import json
import logging
import sys
import textwrap
from pathlib import Path

import pytest

import vllm_compat.cli as cli
from vllm_compat import lines
from vllm_compat.engine import _Engine
from vllm_compat.errors import SpeculatorsLineUnknown, UnhandledDrift

GENERATOR = {
    "0.3.0": """
        def build(self, spec):
            return get_kv_cache_config_from_groups(vllm_config=self, kv_cache_groups=[], kv_cache_specs=spec)

        def step(self, scheduler_output, status):
            for req_id in scheduler_output.num_scheduled_tokens:
                self.scheduler.finish_requests([req_id], status)
    """,
    "0.4.0.1": """
        def build(self, ids, hasher):
            config = SchedulerConfig(max_num_seqs=32, is_encoder_decoder=False)
            request = Request(request_id="r", prompt_token_ids=ids, block_hasher=hasher)
            self.executor.collective_rpc("_set_request_metadata", args=({},))
    """,
}
WORKER = {
    "0.3.0": """
        def forward(self, input_ids):
            if not supports_eagle3(self):
                raise ValueError
            return self.get_input_embeddings(input_ids)
    """,
    "0.4.0.1": """
        class HiddenStatesWorkerExtension:
            def _set_request_metadata(self, metadata):
                return self.embed_input_ids(metadata)
    """,
}


@pytest.fixture()
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``make(generator=, worker=, metadata=)`` puts a stand-in speculators first on sys.path (no other on it)."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p or ".") / "speculators").is_dir()])
    for name in [m for m in sys.modules if m == "speculators" or m.startswith("speculators.")]:
        monkeypatch.delitem(sys.modules, name)
    count = iter(range(100))

    def make(generator: str | None = None, worker: str | None = None, metadata: str | None = None) -> Path:
        root = tmp_path / f"tree{next(count)}"
        package = root / "speculators" / "data_generation"
        package.mkdir(parents=True)
        (root / "speculators" / "__init__.py").write_text("")
        (package / "__init__.py").write_text("")
        for text, name in ((generator, "vllm_hidden_states_generator"), (worker, "custom_worker")):
            if text is not None:
                (package / f"{name}.py").write_text(textwrap.dedent(text))
        if metadata:
            info = root / f"speculators-{metadata}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: speculators\nVersion: {metadata}\n")
        monkeypatch.syspath_prepend(str(root))
        return root

    return make


@pytest.mark.parametrize(("code", "metadata"), [("0.3.0", "0.4.0.1"), ("0.4.0.1", "0.3.0")])
def test_the_code_wins_over_the_metadata_and_says_so(tree, code: str, metadata: str, caplog) -> None:
    tree(GENERATOR[code], WORKER[code], metadata)
    with caplog.at_level(logging.WARNING, logger="vllm_compat"):
        verdict = lines.judge_line()
    assert (verdict.line, verdict.how, verdict.metadata_version) == (code, "code", metadata)
    assert "judged from its code" in verdict.describe() and f"metadata says {metadata}" in verdict.describe()
    told = [r.getMessage() for r in caplog.records if "the code wins" in r.getMessage()]
    assert len(told) == 1 and f"is the {code} line" in told[0] and f"says speculators {metadata}" in told[0]


def test_code_and_metadata_agreeing_log_nothing(tree, caplog) -> None:
    tree(GENERATOR["0.4.0.1"], WORKER["0.4.0.1"], "0.4.0.1")
    with caplog.at_level(logging.INFO, logger="vllm_compat"):
        verdict = lines.judge_line()
    assert (verdict.line, verdict.how) == ("0.4.0.1", "code") and "metadata agrees" in verdict.describe()
    assert not caplog.records


def test_a_patch_release_is_judged_as_its_line(tree) -> None:
    tree(GENERATOR["0.3.0"], WORKER["0.3.0"], "0.3.4")
    assert (lines.judge_line().line, lines.judge_line().how) == ("0.3.0", "code")


def test_only_the_metadata_where_no_code_is_found(tree) -> None:
    root = tree(metadata="0.4.0.1")
    for name in ("vllm_hidden_states_generator.py", "custom_worker.py"):
        assert not (root / "speculators/data_generation" / name).exists()
    verdict = lines.judge_line()
    assert (verdict.line, verdict.how) == ("0.4.0.1", "metadata")


def test_no_speculators_no_line(tree) -> None:
    verdict = lines.judge_line()
    assert (verdict.line, verdict.how, verdict.native) == (None, "absent", None)


@pytest.mark.parametrize(
    ("generator", "metadata", "native"),
    [(None, "0.9.0", "native-0.9"), (None, "0.5.1", "native-0.5"), (None, "0.4.0.1", None), ("0.4.0.1", "0.9.0", None)],
    ids=["0.9-installed", "0.5-patch", "in-process-metadata", "in-process-code-wins"],
)
def test_the_native_line_only_where_no_generator_code_is_found(tree, generator, metadata, native) -> None:
    """status, probe and the engine's native adapters all read the native line from this one property."""
    tree(GENERATOR[generator] if generator else None, WORKER[generator] if generator else None, metadata)
    assert lines.judge_line().native == native


@pytest.mark.parametrize(
    ("generator", "worker"),
    [
        (GENERATOR["0.3.0"] + GENERATOR["0.4.0.1"], None),  # both lines' calls: a mixed or modified generator
        ("def generate(self, token_ids):\n    return []\n", None),  # neither
        (GENERATOR["0.3.0"], WORKER["0.4.0.1"]),  # the two modules disagree
    ],
    ids=["both", "neither", "disagree"],
)
def test_code_of_no_known_line_stops_the_guard(tree, generator: str, worker: str | None) -> None:
    tree(generator, worker, "0.4.0.1")
    verdict = lines.judge_line()
    assert verdict.unknown and verdict.line is None
    engine = _Engine()
    engine.installed = True
    with pytest.raises(SpeculatorsLineUnknown) as caught:
        engine.check(where="VllmHiddenStatesGenerator.__init__ (before the model loads)")
    assert isinstance(caught.value, UnhandledDrift)
    message = str(caught.value)
    assert "cannot tell which speculators line" in message and "vllm_hidden_states_generator" in message
    assert "before the model loads" in message and "Nothing was loaded" in message


def test_an_imported_module_is_judged_by_its_own_file(tree) -> None:
    """Once imported, the module that runs is judged (and its package's worker), whatever sys.path says since."""
    first = tree(GENERATOR["0.3.0"], WORKER["0.3.0"])
    import speculators.data_generation.vllm_hidden_states_generator as generator

    tree(GENERATOR["0.4.0.1"], WORKER["0.4.0.1"], "0.4.0.1")  # now first on sys.path
    verdict = lines.judge_line()
    assert (verdict.line, verdict.how) == ("0.3.0", "code")
    assert [path for _module, path, _line, _shows in verdict.code] == [
        generator.__file__,
        str(first / "speculators/data_generation/custom_worker.py"),
    ]


def test_probe_reports_the_line_of_the_code(tree, tmp_path: Path, capsys) -> None:
    from tests.unit.test_cli import write_metadata

    vllm_tree = tmp_path / "vllm-src"
    (vllm_tree / "vllm").mkdir(parents=True)
    (vllm_tree / "vllm/__init__.py").write_text("")
    write_metadata(vllm_tree, "9.9.9")
    tree(GENERATOR["0.3.0"], WORKER["0.3.0"], "0.4.0.1")
    rc = cli.main(["probe", "--source", str(vllm_tree), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["speculators_lines"] == ["0.3.0"]
    assert report["speculators_version"] == "0.4.0.1"
    assert "line 0.3.0, judged from its code" in report["speculators_judged"]
    assert rc == (0 if report["ok"] else 1)


def test_probe_fails_where_the_guard_would_stop(tree, tmp_path: Path, capsys) -> None:
    from tests.unit.test_cli import write_metadata

    vllm_tree = tmp_path / "vllm-src"
    (vllm_tree / "vllm").mkdir(parents=True)
    (vllm_tree / "vllm/__init__.py").write_text("")
    write_metadata(vllm_tree, "9.9.9")
    tree(GENERATOR["0.3.0"], WORKER["0.4.0.1"], "0.4.0.1")
    rc = cli.main(["probe", "--source", str(vllm_tree), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and report["ok"] is False
    assert report["speculators_judged"].startswith("line unknown")
    assert report["speculators_lines"] == ["0.3.0", "0.4.0.1"]
    rc = cli.main(["probe", "--source", str(vllm_tree)])
    table = capsys.readouterr().out
    assert rc == 1 and "matches neither line" in table and "FAIL" in table
