"""scripts/e2e_matrix.py without a vLLM: the --resume rule on a real git repository, the record file, the cells."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITE = ["tests/e2e/test_extraction.py"]


@pytest.fixture(scope="module")
def matrix():
    spec = importlib.util.spec_from_file_location("e2e_matrix_under_test", ROOT / "scripts" / "e2e_matrix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    return subprocess.run(["git", "-C", str(repo), *args], env=env, capture_output=True, text=True, check=True).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A checkout with the layout the matrix fingerprints, one commit."""
    root = tmp_path / "checkout"
    for name, text in {
        "vllm_compat/__init__.py": "core = 1\n",
        "adapters/transfer.py": "adapter = 1\n",
        "probes/engine.py": "probe = 1\n",
        "tests/e2e/test_extraction.py": "def test(): pass\n",
        "pyproject.toml": "[project]\nname = 'x'\n",
        "docs/compatibility.md": "# page\n",
        ".gitignore": "__pycache__/\n",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "first")
    return root


def passed_record(fp, suite=SUITE, **extra) -> dict:
    return {"passed": True, "suite": suite, "dirty": fp.dirty, "commit": fp.commit, "trees": fp.trees,
            "date": "2026-12-01T00:00:00Z", **extra}  # fmt: skip


def commit(repo: Path, name: str, text: str) -> None:
    (repo / name).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", f"change {name}")


def test_a_pass_stands_while_the_code_is_unchanged(matrix, repo: Path) -> None:
    first = matrix.fingerprint(repo)
    assert first.commit == git(repo, "rev-parse", "HEAD").strip() and not first.dirty
    assert first.trees["adapters"] == git(repo, "rev-parse", "HEAD:adapters").strip()
    record = passed_record(first)
    assert matrix.reuse_verdict(record, SUITE, first)[0]
    # commits that touch docs or the tests leave the code as it was: the pass still counts
    commit(repo, "docs/compatibility.md", "# page, regenerated\n")
    commit(repo, "tests/e2e/test_extraction.py", "def test(): assert True\n")
    later = matrix.fingerprint(repo)
    assert later.commit != first.commit and not later.dirty
    reuse, why = matrix.reuse_verdict(record, SUITE, later)
    assert reuse, why
    assert first.commit[:10] in why


@pytest.mark.parametrize("path", ["vllm_compat/__init__.py", "adapters/transfer.py", "probes/engine.py"])
def test_a_committed_change_to_the_code_reruns_the_cell(matrix, repo: Path, path: str) -> None:
    record = passed_record(matrix.fingerprint(repo))
    commit(repo, path, "changed = 2\n")
    reuse, why = matrix.reuse_verdict(record, SUITE, matrix.fingerprint(repo))
    assert not reuse and why.startswith(path.split("/")[0] + "/ changed since")


def test_uncommitted_changes_count_as_changes_and_a_dirty_run_never_counts(matrix, repo: Path) -> None:
    clean = matrix.fingerprint(repo)
    record = passed_record(clean)
    (repo / "adapters" / "transfer.py").write_text("adapter = 2\n")  # edited, not committed
    edited = matrix.fingerprint(repo)
    assert edited.dirty and edited.commit == clean.commit
    assert not matrix.reuse_verdict(record, SUITE, edited)[0]
    dirty_record = passed_record(edited)  # a pass run from that tree ...
    assert dirty_record["dirty"]
    reuse, why = matrix.reuse_verdict(dirty_record, SUITE, edited)  # ... never counts, not even on the same tree
    assert not reuse and "uncommitted" in why
    # an untracked file is part of what gets installed; an ignored one is not
    (repo / "adapters" / "transfer.py").write_text("adapter = 1\n")
    (repo / "adapters" / "__pycache__").mkdir()
    (repo / "adapters" / "__pycache__" / "transfer.cpython-311.pyc").write_bytes(b"\0")
    assert matrix.fingerprint(repo) == clean
    assert matrix.reuse_verdict(record, SUITE, matrix.fingerprint(repo))[0]
    (repo / "probes" / "new_probe.py").write_text("probe = 2\n")
    assert matrix.fingerprint(repo).dirty
    assert "probes/ changed" in matrix.reuse_verdict(record, SUITE, matrix.fingerprint(repo))[1]
    # a tests/e2e edit does not change the key, but a record made with it is dirty
    (repo / "probes" / "new_probe.py").unlink()
    (repo / "tests" / "e2e" / "test_extraction.py").write_text("def test(): assert False\n")
    with_test_edit = matrix.fingerprint(repo)
    assert with_test_edit.dirty and with_test_edit.key() == clean.key()
    assert matrix.reuse_verdict(record, SUITE, with_test_edit)[0]
    assert not matrix.reuse_verdict(passed_record(with_test_edit), SUITE, with_test_edit)[0]


def test_only_a_pass_of_the_same_suite_counts(matrix, repo: Path) -> None:
    fp = matrix.fingerprint(repo)
    assert matrix.reuse_verdict(None, SUITE, fp) == (False, "not on record")
    assert not matrix.reuse_verdict({**passed_record(fp), "passed": False}, SUITE, fp)[0]
    assert not matrix.reuse_verdict(passed_record(fp), ["tests/e2e"], fp)[0]
    assert not matrix.reuse_verdict({k: v for k, v in passed_record(fp).items() if k != "dirty"}, SUITE, fp)[0]


def test_outside_a_git_checkout_nothing_is_reused(matrix, tmp_path: Path) -> None:
    fp = matrix.fingerprint(tmp_path)
    assert fp.dirty and fp.commit == ""
    assert not matrix.reuse_verdict(passed_record(fp, dirty=False), SUITE, fp)[0]


def test_the_record_file_keeps_every_cell_in_matrix_order(matrix, tmp_path: Path) -> None:
    report = tmp_path / "docs" / "e2e-matrix.json"
    assert matrix.load_report(report) == {}
    records = {"0.4.0.1@0.32.0": {"passed": True}, "0.3.0@0.11.0": {"passed": False}}
    matrix.save_report(report, records)
    data = json.loads(report.read_text())
    assert data["format"] == matrix.REPORT_FORMAT
    assert list(data["cells"]) == ["0.3.0@0.11.0", "0.4.0.1@0.32.0"]
    assert matrix.load_report(report) == records
    assert [p.name for p in report.parent.iterdir()] == ["e2e-matrix.json"]  # no temporary file left
    assert report.stat().st_mode & 0o777 == 0o644


def test_a_report_of_the_old_format_loads_without_commit(matrix, tmp_path: Path) -> None:
    old = [{"speculators": "0.3.0", "vllm": "0.17.0", "kind": "e2e", "passed": True, "tests": "6 passed in 1.0s",
            "numbers": {"max_abs_diff": 1e-6, "applied": ["a"], "worker_applied": ["a", "b"]}}]  # fmt: skip
    report = tmp_path / "old.json"
    report.write_text(json.dumps(old))
    (record,) = matrix.load_report(report).values()
    assert record["commit"] == "" and record["dirty"] and record["tests"]["summary"] == "6 passed in 1.0s"
    assert record["adapters"] == {"parent": ["a"], "workers": ["a", "b"]} and record["max_abs_diff"] == 1e-6


def test_cells_and_suites(matrix) -> None:
    def plan(*argv: str):
        parser_args = matrix.argparse.Namespace(cells=None, preset="full", suite=None)
        for arg in argv:
            key, value = arg.split("=")
            setattr(parser_args, key, value.split(",") if key in ("cells", "suite") else value)
        return matrix.plan_cells(parser_args)

    cells = plan()
    e2e = [c for c in cells if c.kind == "e2e" and not c.native]
    assert len(e2e) == 68 and {c.vllm for c in e2e} == set(matrix.RELEASES) - matrix.NO_CPU_BUILD
    native = [c for c in cells if c.native]
    assert [c.vllm for c in native] == matrix.NATIVE_RELEASES and matrix.NATIVE_RELEASES[0] == matrix.NATIVE_FIRST
    assert matrix.NATIVE_RELEASES[-1] == "0.32.0" and all(c.kind == "e2e" for c in native)
    assert all(c.id.startswith("native-0.9@") and c.suite == matrix.NATIVE_SUITE for c in native)
    ids = [c.id for c in cells]  # per release the native cell comes last: its install changes the environment
    assert ids.index("native-0.9@0.26.0") == ids.index("0.4.0.1@0.26.0") + 1
    assert [c.id for c in cells if c.kind == "import"] == [
        "0.3.0@0.33.0", "0.4.0.1@0.33.0", "0.3.0@0.34.0", "0.4.0.1@0.34.0"
    ]  # fmt: skip
    assert all(c.suite == matrix.IMPORT_SUITE for c in cells if c.kind == "import")
    assert {c.id for c in e2e if c.suite == matrix.FULL_SUITE} == set(matrix.FULL_MATRIX_SUITES)
    assert all(c.suite == matrix.CORE_SUITE for c in e2e if c.id not in matrix.FULL_MATRIX_SUITES)
    ci = plan("preset=ci")
    assert [c.id for c in ci] == matrix.CI_CELLS
    assert {c.id: c.suite for c in ci}["0.4.0.1@0.32.0"] == matrix.CI_GUARD_SUITE
    assert [c.suite for c in plan("cells=0.3.0@0.11.0", "suite=tests/e2e/test_live_view.py")] == [
        ["tests/e2e/test_live_view.py"]
    ]
    with pytest.raises(SystemExit, match=r"not a matrix cell: 0\.3\.0@0\.10\.0"):
        plan("cells=0.3.0@0.10.0")
    with pytest.raises(SystemExit, match=r"not a matrix cell: native-0\.9@0\.21\.0"):
        plan("cells=native-0.9@0.21.0")  # before the first release the native probes pass


def test_every_named_test_exists(matrix) -> None:
    """A renamed test or parameter id in the core or CI's suite is caught here in seconds: pytest would only refuse
    the id ("not found") once the cell's vLLM environment is built, tens of minutes into CI."""
    for test in {*matrix.CORE_SUITE, *matrix.CI_GUARD_SUITE, *matrix.NATIVE_SUITE}:
        path, _, name = test.partition("::")
        assert (ROOT / path).is_file(), path
        name, _, param = name.partition("[")
        text = (ROOT / path).read_text()
        assert not name or f"def {name}(" in text, test
        assert not param or f'"{param.rstrip("]")}"' in text, test


def test_dry_run_says_which_cells_are_on_record(matrix, tmp_path: Path, capsys) -> None:
    now = matrix.fingerprint()
    report = tmp_path / "matrix.json"
    clean = {**passed_record(now, suite=matrix.CORE_SUITE), "dirty": False}
    matrix.save_report(report, {"0.3.0@0.11.0": clean, "0.4.0.1@0.11.0": {**clean, "dirty": True}})
    argv = ["--resume", "--dry-run", "--report", str(report), "--cells", "0.3.0@0.11.0", "0.4.0.1@0.11.0"]
    assert matrix.main(argv) == 0
    out = capsys.readouterr().out
    assert "0.3.0@0.11.0: skip (passed at" in out
    assert "0.4.0.1@0.11.0: run (on record from a tree with uncommitted changes)" in out
    assert "1 to run, 1 on record" in out


def test_junit_results_name_each_test_and_its_outcome(matrix, tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2, 'one is not two'\n"
        "def test_skip(): pytest.skip('needs two cores')\n"
        "class TestGroup:\n"
        "    @pytest.mark.parametrize('n', [1])\n"
        "    def test_param(self, n): pass\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError('fixture broke')\n"
        "def test_error(broken): pass\n"
    )
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "--junitxml", str(junit)],
                   cwd=tmp_path, capture_output=True, check=False)  # fmt: skip
    results = {r["id"]: r for r in matrix.parse_junit(junit, root=tmp_path)}
    assert {k: r["outcome"] for k, r in results.items()} == {
        "tests/test_sample.py::test_ok": "passed",
        "tests/test_sample.py::test_bad": "failed",
        "tests/test_sample.py::test_skip": "skipped",
        "tests/test_sample.py::TestGroup::test_param[1]": "passed",
        "tests/test_sample.py::test_error": "error",
    }
    assert "one is not two" in results["tests/test_sample.py::test_bad"]["message"]
    assert "needs two cores" in results["tests/test_sample.py::test_skip"]["message"]
    assert matrix.parse_junit(tmp_path / "absent.xml") == []


def test_a_suite_that_hangs_is_killed_with_its_children(matrix, tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    started = time.monotonic()
    code, output = matrix.run_group([sys.executable, "-c", script], dict(os.environ), tmp_path, timeout=3)
    assert code == 124 and "killed after 3 s" in output
    assert time.monotonic() - started < 30
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child), "the grandchild outlived its process group"


def _gone(pid: int) -> bool:
    """No such process, or a zombie (killed; its parent, killed too, never reaped it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_libraries_a_cpu_worker_needs_preloaded_are_found(matrix, tmp_path: Path) -> None:
    """vLLM CPU 0.18's worker refuses to start unless LD_PRELOAD names libtcmalloc (and libiomp on x86); later warn."""
    venv = tmp_path / "venv"
    worker = venv / "lib/python3.11/site-packages/vllm/v1/worker/cpu_worker.py"
    worker.parent.mkdir(parents=True)
    checker = (
        "def check_preloaded_libs(name: str):\n"
        "    if name not in os.environ.get('LD_PRELOAD', ''):\n"
        "        {}\n"
        'check_preloaded_libs("libtcmalloc")\nif x86:\n    check_preloaded_libs("libiomp")\n'
    )
    worker.write_text(checker.format("raise RuntimeError(f'{name} is not found in LD_PRELOAD')"))
    (venv / "lib/libiomp5.so").write_bytes(b"\x7fELF")
    names = matrix.required_preloads(venv)
    assert names[0] == "libtcmalloc" and set(names) <= {"libtcmalloc", "libiomp"}
    preload, missing = matrix.preload_for(venv, ["libiomp"])
    assert preload == str(venv / "lib/libiomp5.so") and missing == []
    _, missing = matrix.preload_for(venv, ["libnosuchthing"])
    assert missing == ["libnosuchthing"]
    worker.write_text("def init_device(self):\n    pass\n")
    assert matrix.required_preloads(venv) == []
    # vLLM CPU 0.19 on: the same checks only warn; preloading there is not required (and libiomp would leave its
    # registration file in /dev/shm)
    worker.write_text(checker.format("logger.warning('%s is not found in LD_PRELOAD', name)\n        return False"))
    assert matrix.required_preloads(venv) == []


def test_an_attempt_that_ran_no_test_leaves_a_pass_on_record(matrix, repo: Path) -> None:
    """A host that cannot start a release's CPU worker (a library it preloads is missing) learns nothing about the
    code: the earlier pass stands, the attempt beside it; without a pass the attempt is the record."""
    fp = matrix.fingerprint(repo)
    attempt = {"speculators": "0.3.0", "vllm": "0.18.0", "passed": False, "failed": ["environment"],
               "date": "2026-12-03T00:00:00Z", "commit": "abc", "error": "no libtcmalloc"}  # fmt: skip
    kept = matrix.untested_attempt(passed_record(fp), attempt)
    assert kept["passed"] and kept["commit"] == fp.commit
    assert kept["untested_attempt"] == {"date": "2026-12-03T00:00:00Z", "commit": "abc", "error": "no libtcmalloc"}
    assert matrix.untested_attempt(None, attempt) is attempt
    assert matrix.untested_attempt({**passed_record(fp), "passed": False}, attempt) is attempt


def test_the_environments_install_datasets_as_the_readme_says(matrix) -> None:
    """The end-to-end environments install speculators' side as users do: what README.md and docs/index.md say."""
    advice = f'pip install "{matrix.README_DATASETS}"'
    for page in ("README.md", "docs/index.md"):
        assert advice in (ROOT / page).read_text(), f"{page} no longer says {advice}"


def test_torchvision_is_left_out_beside_a_local_torch_build(matrix, monkeypatch, tmp_path) -> None:
    calls = []
    monkeypatch.setattr(matrix, "installed", lambda venv, name: "2.13.0+cpu")
    monkeypatch.setattr(matrix, "pip", lambda venv, *args, **kw: calls.append(args))
    monkeypatch.setattr(matrix, "vllm_torchvision_pin", lambda version: "0.28.0")
    matrix.install_torchvision(tmp_path, "0.31.0", "2.13.0")
    assert calls == []
    monkeypatch.setattr(matrix, "installed", lambda venv, name: "2.13.0")
    matrix.install_torchvision(tmp_path, "0.31.0", "2.13.0")
    assert calls == [("torchvision==0.28.0", "torch==2.13.0")]  # torch named as it is: pip never changes it


SITE = "lib/python3.11/site-packages"


def test_records_name_no_folder_of_the_machine(matrix, tmp_path: Path, monkeypatch) -> None:
    """Error excerpts quote tracebacks and logs; the committed record keeps them with placeholders for the paths."""
    work = tmp_path / "work"
    monkeypatch.setitem(matrix.SCRUB_ROOTS, str(work), "<work>")
    env = "/home/someone/envs/matrix-full/vllm-0.11.2/lib/python3.11/site-packages/vllm/worker.py"
    record = {
        "error": f'File "{env}", line 3\n{work}/pytest/native0/model: bad\n{work}/vllm-0.32.0/{SITE}/x',
        "results": [{"message": f"{ROOT}/tests/e2e/test_native.py:12: AssertionError"}],
        "native_install": {"removed": ["torchvision==0.28.0"], "warnings": ["see /tmp/pip-x/log"]},
        "seconds": 1.5,
    }
    report = tmp_path / "matrix.json"
    matrix.save_report(report, {"native-0.9@0.32.0": record})
    text = report.read_text()
    assert str(tmp_path) not in text and "/home/someone/" not in text and str(ROOT) not in text
    (saved,) = matrix.load_report(report).values()
    site = f"<env>/{SITE}"
    assert saved["error"] == f'File "{site}/vllm/worker.py", line 3\n<work>/pytest/native0/model: bad\n{site}/x'
    assert saved["results"][0]["message"] == "<checkout>/tests/e2e/test_native.py:12: AssertionError"
    assert saved["native_install"]["warnings"] == ["see <tmp>/pip-x/log"] and saved["seconds"] == 1.5
