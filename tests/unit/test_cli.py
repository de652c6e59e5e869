"""The ``vllm-compat probe`` contract: exit codes, the JSON report (docs/json-report.md), line filtering, --strict.

Exit codes: 0 every drift is covered, 1 some drift is unhandled (with --strict: or some fact is unknown),
2 usage or environment error. Checked in-process through ``vllm_compat.cli.main`` and, for the main
cases, through ``python -m vllm_compat.cli`` and the ``vllm-compat`` console script.

Unhandled drift is made by a tree whose drift no adapter can cover: ``Request`` gains a required
parameter ``totally_new_field``, a variant no adapter can know about in advance.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import vllm_compat.cli as cli
import vllm_compat.versions as versions
from vllm_compat.lines import LineVerdict

TOP_KEYS = {
    "schema_version",
    "vllm_version",
    "speculators_version",
    "speculators_lines",
    "speculators_judged",
    "source",
    "families",
    "findings",
    "adapters",
    "unhandled",
    "unknown",
    "needed_unknown",
    "strict",
    "ok",
    "vllm_range",
    "proof",
    "refused_unproven",
}
FINDING_KEYS = {
    "probe",
    "symbol",
    "speculators",
    "state",
    "variant",
    "expected",
    "observed",
    "evidence",
    "adapter",
    "handled",
}
NEW_FIELD = "totally_new_field"


# -- helpers ---------------------------------------------------------------------------------------
def run_main(args: list[str], capsys) -> tuple[int, str, str]:
    rc = cli.main(args)
    out, err = capsys.readouterr()
    return rc, out, err


def run_module(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_compat.cli", *args], capture_output=True, text=True, check=False, timeout=300
    )


def run_script(args: list[str]) -> subprocess.CompletedProcess:
    script = shutil.which("vllm-compat")
    if script is None:
        pytest.skip("the vllm-compat console script is not on PATH (pip install -e .)")
    return subprocess.run([script, *args], capture_output=True, text=True, check=False, timeout=300)


def all_three(args: list[str], capsys) -> list[tuple[str, int, str, str]]:
    """(how, exit code, stdout, stderr) through main(), ``python -m vllm_compat.cli`` and the console script."""
    rc, out, err = run_main(args, capsys)
    runs = [("main", rc, out, err)]
    for how, run in (("python -m", run_module), ("console script", run_script)):
        done = run(args)
        runs.append((how, done.returncode, done.stdout, done.stderr))
    return runs


def write_metadata(root: Path, version: str) -> None:
    info = root / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")


@pytest.fixture
def new_field_tree(tmp_path: Path) -> Path:
    """A tiny vLLM whose Request requires ``totally_new_field`` (and which lacks everything else)."""
    root = tmp_path / "tiny"
    (root / "vllm/v1").mkdir(parents=True)
    (root / "vllm/__init__.py").write_text("")
    (root / "vllm/v1/__init__.py").write_text("")
    (root / "vllm/v1/request.py").write_text(
        textwrap.dedent(
            f"""
            class Request:
                def __init__(
                    self, request_id, prompt_token_ids, sampling_params, pooling_params, {NEW_FIELD},
                    eos_token_id=None, arrival_time=None, block_hasher=None,
                ):
                    self.request_id = request_id
            """
        )
    )
    write_metadata(root, "9.9.9")
    return root


def assert_unhandled_new_field(report: dict) -> None:
    assert report["ok"] is False
    assert "request.request_kwargs" in report["unhandled"]
    for f in report["findings"]:
        if f["probe"] == "request.request_kwargs":
            assert f["state"] == "drifted"
            assert f["variant"] == f"requires={NEW_FIELD}"
            assert f["adapter"] is None and f["handled"] is False
            assert "vllm/v1/request.py:" in f["evidence"]


# -- exit code 2: usage and environment errors -----------------------------------------------------
def test_missing_path_exits_2(tmp_path: Path, capsys) -> None:
    missing = str(tmp_path / "no-such-vllm")
    for how, rc, out, err in all_three(["probe", "--source", missing], capsys):
        assert rc == 2, how
        assert "no such file or folder" in err, how
        assert out == "", how


def test_a_release_older_than_served_exits_2_without_downloading(tmp_path: Path, capsys, monkeypatch) -> None:
    """``--source vllm==0.10.0`` once downloaded the wheel (hundreds of MB) before saying 0.10 is not served."""
    import vllm_compat.sources as sources

    def no_download(version: str, dest=None):
        raise AssertionError(f"vllm=={version} was downloaded")

    monkeypatch.setattr(sources, "fetch_release", no_download)
    monkeypatch.setenv("VLLM_COMPAT_CACHE", str(tmp_path))  # the subprocesses: an empty cache, so a fetch would show
    for how, rc, out, err in all_three(["probe", "--source", "vllm==0.10.0"], capsys):
        assert rc == 2, how
        assert "older than the releases vllm-compat serves" in err and "nothing downloaded" in err, how
        assert "pip download --no-deps vllm==0.10.0" in err, how
        assert out == "", how
    assert not any(tmp_path.rglob("*.whl")), "no wheel fetched"


def test_unreadable_wheel_exits_2(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "vllm-0.0.1-py3-none-any.whl"
    bad.write_bytes(b"this is not a zip file")
    for how, rc, _out, err in all_three(["probe", "--source", str(bad), "--json"], capsys):
        assert rc == 2, how
        assert "not a readable wheel" in err, how


def test_wheel_or_folder_without_vllm_exits_2(tmp_path: Path, capsys) -> None:
    empty_wheel = tmp_path / "vllm-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(empty_wheel, "w") as zf:
        zf.writestr("other/__init__.py", "")
    folder = tmp_path / "not-vllm"
    folder.mkdir()
    for source in (empty_wheel, folder):
        rc, out, err = run_main(["probe", "--source", str(source)], capsys)
        assert rc == 2, source
        assert "vllm" in err and out == ""


def test_no_vllm_installed_and_no_source_exits_2(monkeypatch, capsys) -> None:
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda pkg: None if pkg == "vllm" else real(pkg))
    rc, out, err = run_main(["probe"], capsys)
    assert rc == 2
    assert "no vLLM is installed" in err and "--source" in err
    assert out == ""


def test_no_vllm_installed_subprocess_exits_2(capsys) -> None:
    if versions.installed_version("vllm") is not None:
        pytest.skip("vLLM is installed here; the in-process test covers this case")
    for how, rc, _out, err in all_three(["probe", "--json"], capsys):
        assert rc == 2, how
        assert "no vLLM is installed" in err, how


@pytest.mark.parametrize(
    "args",
    [[], ["probe", "--speculators", "0.10.9"], ["probe", "--no-such-flag"], ["frobnicate"]],
)
def test_usage_errors_exit_2(args: list[str], capsys) -> None:
    rc, _out, err = run_main(args, capsys)
    assert rc == 2
    assert "usage:" in err


def test_help_exits_0(capsys) -> None:
    rc, out, _err = run_main(["probe", "--help"], capsys)
    assert rc == 0
    assert "Exit codes" in out


# -- exit code 1: unhandled drift ------------------------------------------------------------------
def test_unhandled_drift_exits_1(new_field_tree: Path, capsys) -> None:
    for how, rc, out, _err in all_three(["probe", "--source", str(new_field_tree), "--json"], capsys):
        assert rc == 1, how
        assert_unhandled_new_field(json.loads(out))


def test_table_names_the_unhandled_drift(new_field_tree: Path, capsys) -> None:
    rc, out, _err = run_main(["probe", "--source", str(new_field_tree)], capsys)
    assert rc == 1
    row = next(line for line in out.splitlines() if line.strip().startswith("request.request_kwargs"))
    assert "drifted" in row and "UNHANDLED" in row
    assert NEW_FIELD in out  # the observed signature
    assert out.splitlines()[1].startswith("verdict: FAIL: "), "the verdict comes first"
    verdict = out.split("\nspeculators:")[0]
    assert "not covered: " in verdict and "request.request_kwargs (vllm.v1.request.Request)" in verdict
    assert "vLLM 9.9.9 is newer than the releases the probes were checked against (0.11 to 0.34)" in out


def test_the_table_shows_what_needs_a_look_and_all_on_request(new_field_tree: Path, capsys) -> None:
    """Baseline rows are counted, not listed, unless --all; a long probe name keeps its column."""
    source = ["probe", "--source", str(new_field_tree), "--speculators", "0.4.0.1"]
    _rc, short, _err = run_main(source, capsys)
    report = json.loads(run_main([*source, "--json"], capsys)[1])
    shown = {f["probe"] for f in report["findings"] if f["state"] != "baseline"}
    baseline = {f["probe"] for f in report["findings"] if f["state"] == "baseline"}
    assert table_rows(short) == shown
    assert "--all lists them" in short
    _rc, everything, _err = run_main([*source, "--all"], capsys)
    assert table_rows(everything) == shown | baseline
    assert "--all lists them" not in everything


def table_rows(table: str) -> set[str]:
    """The probes of the table's rows: two spaces, the probe, its state, its cover, each in its column."""
    import re

    row = re.compile(r"^  (\S+) +(baseline|drifted|unknown) +(\S+)$")
    return {m.group(1) for m in map(row.match, table.splitlines()) if m}


@pytest.mark.parametrize(
    ("version", "said"),
    [
        ("0.10.0", "vLLM 0.10.0 is older than the releases vllm-compat serves (0.11 to 0.34)"),
        ("0.35.0", "vLLM 0.35.0 is newer than the releases the probes were checked against (0.11 to 0.34)"),
        ("0.34.1", None),
        ("0.11.0", None),
    ],
)
def test_a_release_outside_the_served_range_is_said_so(tmp_path: Path, version: str, said, capsys) -> None:
    root = tmp_path / "tree"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm/__init__.py").write_text("")
    write_metadata(root, version)
    _rc, table, _err = run_main(["probe", "--source", str(root), "--speculators", "0.4.0.1"], capsys)
    report = json.loads(run_main(["probe", "--source", str(root), "--speculators", "0.4.0.1", "--json"], capsys)[1])
    verdict = "\n".join(table.splitlines()[1:4]).replace("\n    ", " ")
    if said is None:
        assert "serves (" not in table and "checked against (" not in table
        assert report["vllm_range"] == "inside"
    else:
        assert said in verdict
        assert report["vllm_range"] == ("older" if version < "0.11" else "newer")


def test_the_speculators_and_families_lines_read_as_sentences(new_field_tree: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "judge_line", lambda: LineVerdict(None, "absent"))
    source = ["probe", "--source", str(new_field_tree)]
    _rc, table, _err = run_main(source, capsys)
    assert (
        "speculators: none found here (no speculators code or metadata), so both lines are judged (0.3.0 and "
        "0.4.0.1); --speculators VERSION judges one" in table
    )
    assert "model families judged: llama (others: --model PATH, --family NAME or --family all)" in table
    _rc, table, _err = run_main([*source, "--speculators", "0.4.0.1", "--family", "all"], capsys)
    assert "speculators: line 0.4.0.1, as given (--speculators)" in table
    families = next(line for line in table.splitlines() if line.startswith("model families judged:"))
    assert "others" not in families and "llama" in families and "gpt_oss" in families


def test_live_goes_without_source(new_field_tree: Path, capsys) -> None:
    rc, out, err = run_main(["probe", "--live", "--source", str(new_field_tree)], capsys)
    assert rc == 2 and out == "" and "--live imports the installed vLLM" in err


# -- the JSON report -------------------------------------------------------------------------------
def test_json_schema(new_field_tree: Path, capsys) -> None:
    rc, out, _err = run_main(["probe", "--source", str(new_field_tree), "--json"], capsys)
    report = json.loads(out)
    assert set(report) == TOP_KEYS
    assert report["schema_version"] == 1
    assert report["vllm_version"] == "9.9.9"
    assert report["source"] == "static"
    assert isinstance(report["strict"], bool) and isinstance(report["ok"], bool)
    assert isinstance(report["findings"], list) and report["findings"]
    for f in report["findings"]:
        assert set(f) == FINDING_KEYS
        assert f["state"] in {"baseline", "drifted", "unknown"}
        assert f["speculators"] in report["speculators_lines"]
        assert isinstance(f["handled"], bool)
        assert f["adapter"] is None or isinstance(f["adapter"], str)
        for key in ("probe", "symbol", "variant", "expected", "observed", "evidence"):
            assert isinstance(f[key], str), key
        assert f["handled"] == (f["state"] == "baseline" or f["adapter"] is not None)
    # the summaries are derived from the findings
    assert report["unhandled"] == sorted(
        {f["probe"] for f in report["findings"] if f["state"] == "drifted" and not f["handled"]}
    )
    assert report["unknown"] == sorted({f["probe"] for f in report["findings"] if f["state"] == "unknown"})
    assert set(report["needed_unknown"]) <= set(report["unknown"])
    assert report["adapters"] == list(dict.fromkeys(f["adapter"] for f in report["findings"] if f["adapter"]))
    assert report["ok"] == (not report["unhandled"] and not report["needed_unknown"])
    assert rc == (0 if report["ok"] else 1)


# -- which speculators lines are judged ------------------------------------------------------------
def _lines_judged(report: dict) -> set[str]:
    return {f["speculators"] for f in report["findings"]}


def test_speculators_filter(new_field_tree: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "judge_line", lambda: LineVerdict(None, "absent"))  # no speculators installed
    source = ["probe", "--source", str(new_field_tree), "--json"]

    both = json.loads(run_main(source, capsys)[1])
    assert both["speculators_lines"] == ["0.3.0", "0.4.0.1"]
    assert both["speculators_version"] is None
    assert _lines_judged(both) == {"0.3.0", "0.4.0.1"}

    for line in ("0.3.0", "0.4.0.1"):
        one = json.loads(run_main([*source, "--speculators", line], capsys)[1])
        assert one["speculators_lines"] == [line]
        assert one["speculators_version"] == line
        assert _lines_judged(one) == {line}
        expected = {(f["probe"], f["variant"]) for f in both["findings"] if f["speculators"] == line}
        assert {(f["probe"], f["variant"]) for f in one["findings"]} == expected
    # probes that only one line touches are filtered with it
    only_040 = "import.utils.hashing.get_hash_fn_by_name"
    assert only_040 in {f["probe"] for f in both["findings"]}
    one = json.loads(run_main([*source, "--speculators", "0.3.0"], capsys)[1])
    assert only_040 not in {f["probe"] for f in one["findings"]}


def test_installed_speculators_picks_its_line(new_field_tree: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "judge_line", lambda: LineVerdict("0.3.0", "metadata", "0.3.5"))
    _rc, out, _err = run_main(["probe", "--source", str(new_field_tree), "--json"], capsys)
    report = json.loads(out)
    assert report["speculators_lines"] == ["0.3.0"]
    assert report["speculators_version"] == "0.3.5"
    assert _lines_judged(report) == {"0.3.0"}
    # --speculators wins over what is installed
    report = json.loads(
        run_main(["probe", "--source", str(new_field_tree), "--json", "--speculators", "0.4.0.1"], capsys)[1]
    )
    assert report["speculators_lines"] == ["0.4.0.1"]
    assert report["speculators_version"] == "0.4.0.1"


@pytest.mark.parametrize(
    ("asked", "line"), [("0.4.0", "0.4.0.1"), ("0.4.2", "0.4.0.1"), ("0.3.1", "0.3.0"), ("0.4.0.1", "0.4.0.1")]
)
def test_any_served_speculators_version_is_judged_as_its_line(
    new_field_tree: Path, asked: str, line: str, capsys
) -> None:
    """docs/limits.md: 0.3.x and 0.4.x releases are judged as the 0.3.0 and 0.4.0.1 lines; --speculators says so."""
    source = ["probe", "--source", str(new_field_tree), "--speculators", asked]
    rc, out, _err = run_main([*source, "--json"], capsys)
    report = json.loads(out)
    assert rc in (0, 1)
    assert report["speculators_lines"] == [line]
    assert report["speculators_version"] == asked
    assert _lines_judged(report) == {line}
    judged = f"judged as the {line} line" if asked != line else "as given (--speculators)"
    assert judged in report["speculators_judged"]
    _rc, table, _err = run_main(source, capsys)
    assert f"speculators: {report['speculators_judged']}" in table and f"speculators {line}:" in table


@pytest.mark.parametrize("asked", ["0.10.0", "0.2.9", "1.0", "not-a-version"])
def test_a_speculators_version_outside_both_lines_is_a_usage_error(asked: str, capsys) -> None:
    rc, out, err = run_main(["probe", "--speculators", asked], capsys)
    assert rc == 2 and out == ""
    assert "0.3.x and 0.4.x" in err


# -- against real releases (wheels from the cache or the index) --------------------------------------
@pytest.mark.wheels
def test_real_release_with_a_new_required_request_parameter_exits_1(vllm_tree, capsys) -> None:
    tree = vllm_tree("0.16.0")
    request = tree / "vllm/v1/request.py"
    text = request.read_text()
    anchor = "        eos_token_id: int | None,\n"  # vllm/v1/request.py:65 in 0.16.0
    assert text.count(anchor) == 1
    request.write_text(text.replace(anchor, anchor + f"        {NEW_FIELD}: int,\n"))
    for how, rc, out, _err in all_three(["probe", "--source", str(tree), "--json"], capsys):
        assert rc == 1, how
        report = json.loads(out)
        assert report["vllm_version"] == "0.16.0"
        assert_unhandled_new_field(report)


@pytest.mark.wheels
def test_strict_fails_on_unknown(vllm_tree, capsys) -> None:
    """vLLM 0.12.0 is a release 0.4.0.1 was built for (no drift); an unparsable llama.py makes facts unknown."""
    tree = vllm_tree("0.12.0")
    (tree / "vllm/model_executor/models/llama.py").write_text("class LlamaModel(:\n    pass\n")
    args = ["probe", "--source", str(tree), "--speculators", "0.4.0.1", "--json"]

    rc, out, _err = run_main(args, capsys)
    report = json.loads(out)
    unknown = {"model.embedding_method", "model.forward_params", "model.decoder_layer_call", "model.layer_attributes"}
    assert unknown <= set(report["unknown"])
    assert report["unhandled"] == []
    assert (rc, report["ok"], report["strict"]) == (0, True, False)

    for how, rc, out, _err in all_three([*args, "--strict"], capsys):
        report = json.loads(out)
        assert (rc, report["ok"], report["strict"]) == (1, False, True), how
        assert unknown <= set(report["unknown"])

    rc, out, _err = run_main([*args[:-1], "--strict"], capsys)  # the table says why
    assert rc == 1
    assert "UNKNOWN" in out and "could not tell" in out and "strict" in out.splitlines()[1]


@pytest.mark.wheels
def test_json_of_a_fetched_release(capsys) -> None:
    from vllm_compat.errors import SourceError
    from vllm_compat.sources import fetch_release

    try:
        fetch_release("0.33.0")
    except SourceError as exc:
        pytest.skip(f"vllm==0.33.0 is not cached and cannot be fetched: {exc}")
    rc, out, _err = run_main(["probe", "--source", "vllm==0.33.0", "--json", "--speculators", "0.4.0.1"], capsys)
    report = json.loads(out)
    assert set(report) == TOP_KEYS
    assert report["vllm_version"] == "0.33.0"
    assert report["source"] == "static"
    assert _lines_judged(report) == {"0.4.0.1"}
    moved = next(f for f in report["findings"] if f["probe"].endswith("kv_cache_utils.get_kv_cache_config_from_groups"))
    assert moved["state"] == "drifted" and moved["variant"] == "moved"
    assert "vllm/v1/core/kv_cache_planning.py:642" in moved["evidence"]
    assert rc == (0 if report["ok"] else 1)
