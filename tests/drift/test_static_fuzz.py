"""Property tests (hypothesis) on what parses foreign input: StaticView over broken wheels and source trees.

A wheel or tree handed to ``vllm-compat probe --source`` may be truncated (an interrupted download), corrupted, hold
non-UTF-8 or garbage Python, absurdly nested expressions, or symlink loops. Whatever it holds, the probe run must end
with findings (``unknown`` or ``missing`` ones carrying a reason) or a SourceError, and the CLI with exit code 0, 1
or 2 and no traceback. The inputs are derived from a real vLLM release: a slim wheel holding exactly the members the
probes read from vLLM 0.16.0 (checked to judge exactly like the full wheel).

Examples per property: ``VLLM_COMPAT_FUZZ_EXAMPLES`` (default 10, about a second each: the probes' own parsing),
derandomized so CI is repeatable; ``VLLM_COMPAT_FUZZ_RANDOM=1`` draws fresh random examples on each run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import vllm_compat.cli as cli  # noqa: E402
from vllm_compat.apiview import static  # noqa: E402
from vllm_compat.apiview.static import StaticSourceError, StaticView  # noqa: E402
from vllm_compat.findings import State  # noqa: E402
from vllm_compat.plan import Plan, make_plan  # noqa: E402

pytestmark = pytest.mark.wheels

RELEASE = "0.16.0"
LINES = ("0.3.0", "0.4.0.1")
FUZZ = settings(
    max_examples=int(os.environ.get("VLLM_COMPAT_FUZZ_EXAMPLES", "10")),
    deadline=None,
    derandomize=os.environ.get("VLLM_COMPAT_FUZZ_RANDOM", "") != "1",
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)


@dataclass(frozen=True)
class Slim:
    wheel: bytes  # the slim wheel's bytes
    members: tuple[str, ...]  # the vllm/*.py members the probes read
    metadata: str  # its dist-info METADATA member
    base: Plan  # the findings for the intact slim wheel


@pytest.fixture(scope="module")
def slim(tmp_path_factory: pytest.TempPathFactory) -> Slim:
    """A wheel holding only what the probes read from the real vLLM 0.16.0 wheel, judged like the full wheel."""
    from vllm_compat.errors import SourceError
    from vllm_compat.sources import fetch_release

    try:
        full = fetch_release(RELEASE)
    except SourceError as exc:
        pytest.skip(f"vllm=={RELEASE} is not cached and cannot be fetched: {exc}")
    reads: set[str] = set()
    original_read, original_exists = static._WheelReader.read, static._WheelReader.exists

    def read(self, rel: str) -> str | None:
        reads.add(rel)
        return original_read(self, rel)

    def exists(self, rel: str) -> bool:
        reads.add(rel)
        return original_exists(self, rel)

    static._WheelReader.read, static._WheelReader.exists = read, exists
    try:
        full_plan = make_plan(StaticView(full), LINES)
    finally:
        static._WheelReader.read, static._WheelReader.exists = original_read, original_exists
    buffer = io.BytesIO()
    with zipfile.ZipFile(full) as src, zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as dst:
        names = set(src.namelist())
        for name in sorted(reads & names):
            dst.writestr(name, src.read(name))
    path = tmp_path_factory.mktemp("slim") / f"vllm-{RELEASE}-py3-none-any.whl"
    path.write_bytes(buffer.getvalue())
    base = make_plan(StaticView(path), LINES)
    assert [f.to_json() for f in base.findings] == [f.to_json() for f in full_plan.findings]
    members = tuple(sorted(n for n in reads & names if n.endswith(".py")))
    (metadata,) = [n for n in reads & names if n.endswith(".dist-info/METADATA")]
    return Slim(buffer.getvalue(), members, metadata, base)


# -- what every example must satisfy ----------------------------------------------------------------------------------
def probe_cli(path: Path) -> tuple[int, str, str]:
    """``vllm-compat probe --source PATH --strict --allow-code-only --json`` in-process: (exit code, stdout, stderr).
    The examples judge a damaged tree's facts; whether its release ran end to end is tests/drift/test_proof.py's."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["probe", "--source", str(path), "--strict", "--allow-code-only", "--json"])
    return rc, out.getvalue(), err.getvalue()


def check(path: Path, slim: Slim, touched: set[str] | None = None) -> dict | None:
    """Probe ``path`` as ``vllm-compat probe --strict --json`` does (make_plan over a StaticView); the report, or
    None when the source is refused (exit 2, one line on stderr).

    Every finding has a state and a reason; unknown ones say "could not tell: why"; the exit code follows the
    verdict. A name speculators imports is never reported importable from a file that cannot be read or parsed:
    ``import.*`` findings whose evidence lies in a ``touched`` member leave ``baseline``.
    """
    rc, out, err = probe_cli(path)  # raises (failing the example) if anything crashes
    assert "Traceback" not in err
    if rc == 2:
        assert out == "" and err.startswith("vllm-compat: ") and len(err.strip().splitlines()) == 1, err
        with pytest.raises(StaticSourceError):
            StaticView(path)
        return None
    report = json.loads(out)
    assert rc == (0 if report["ok"] else 1), (rc, err)
    states = {str(s) for s in State}
    for f in report["findings"]:
        assert f["state"] in states and f["observed"].strip(), f
        if f["state"] == "unknown":
            assert f["observed"].startswith("could not tell"), f
    assert report["ok"] is not any(f["state"] != "baseline" and not f["handled"] for f in report["findings"])
    if touched:
        before = {(f.probe, f.speculators): f for f in slim.base.findings}
        for f in report["findings"]:
            was = before[(f["probe"], f["speculators"])]
            files = {part.split(":")[0] for part in _evidence_files(was.evidence)}
            if f["probe"].startswith("import.") and was.state is State.BASELINE and files and files <= touched:
                assert f["state"] != "baseline", f"{f['probe']} still importable with {sorted(touched)} broken"
    return report


def _evidence_files(evidence: str) -> list[str]:
    """``mod.Name (vllm/x.py:12); ...`` -> ``["vllm/x.py:12", ...]``."""
    return [part.rsplit("(", 1)[1].rstrip(")") for part in evidence.split("; ") if "(" in part and "vllm/" in part]


def write_wheel(tmp: Path, slim: Slim, replace: dict[str, bytes] | None = None, name: str = "fuzz.whl") -> Path:
    path = tmp / name
    with zipfile.ZipFile(io.BytesIO(slim.wheel)) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, (replace or {}).get(info.filename, src.read(info.filename)))
    return path


def write_tree(tmp: Path, slim: Slim) -> Path:
    root = tmp / "tree"
    if root.exists():
        shutil.rmtree(root)
    with zipfile.ZipFile(io.BytesIO(slim.wheel)) as zf:
        zf.extractall(root)
    return root


# -- broken wheels -----------------------------------------------------------------------------------------------------
@FUZZ
@given(data=st.data())
def test_truncated_wheel(slim: Slim, tmp_path: Path, data) -> None:
    """An interrupted download: any prefix of the wheel is refused cleanly (exit 2)."""
    cut = data.draw(st.integers(min_value=0, max_value=len(slim.wheel) - 1), label="kept bytes")
    path = tmp_path / "truncated.whl"
    path.write_bytes(slim.wheel[:cut])
    assert check(path, slim) is None


@FUZZ
@given(data=st.data())
def test_corrupted_wheel_bytes(slim: Slim, tmp_path: Path, data) -> None:
    """Random bytes of the wheel overwritten: refused (exit 2), or judged with findings that say what is unreadable."""
    raw = bytearray(slim.wheel)
    for _ in range(data.draw(st.integers(min_value=1, max_value=8), label="hits")):
        at = data.draw(st.integers(min_value=0, max_value=len(raw) - 1), label="offset")
        raw[at] ^= data.draw(st.integers(min_value=1, max_value=255), label="xor")
    path = tmp_path / "corrupted.whl"
    path.write_bytes(bytes(raw))
    check(path, slim)


@FUZZ
@given(data=st.data())
def test_corrupted_compressed_member(slim: Slim, tmp_path: Path, data) -> None:
    """A member whose compressed data is damaged (zlib error or bad CRC on read), the metadata included."""
    raw = bytearray(slim.wheel)
    with zipfile.ZipFile(io.BytesIO(slim.wheel)) as zf:
        name = data.draw(st.sampled_from([*slim.members, slim.metadata]), label="member")
        info = zf.getinfo(name)
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)  # the local header's size
    for _ in range(data.draw(st.integers(min_value=1, max_value=4), label="hits")):
        at = start + data.draw(st.integers(min_value=0, max_value=max(0, info.compress_size - 1)), label="offset")
        raw[at] ^= data.draw(st.integers(min_value=1, max_value=255), label="xor")
    path = tmp_path / "member.whl"
    path.write_bytes(bytes(raw))
    check(path, slim)


# -- odd sources, in a wheel and in a folder ---------------------------------------------------------------------------
def nested(depth: int, kind: str) -> str:
    if kind == "parens":
        return "x = " + "(" * depth + "0" + ")" * depth + "\n"
    if kind == "lists":
        return "x = " + "[" * depth + "]" * depth + "\n"
    if kind == "binop":  # a left-deep chain: parses, but deep for anything recursive over the tree
        return "x = " + "1 + " * depth + "1\n"
    if kind == "unary":
        return "x = " + "-" * depth + "1\n"
    if kind == "attributes":
        return "x = a" + ".a" * depth + "\n"
    if kind == "classes":  # nested class bodies, deeper than the indentation limit (100) when depth > 100
        depth = min(depth, 300)  # the text grows with depth squared
        return "".join("    " * i + f"class C{i}:\n" for i in range(depth)) + "    " * depth + "pass\n"
    raise AssertionError(kind)


def odd_sources() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=2000),  # not UTF-8, not Python
        st.text(max_size=2000).map(lambda t: t.encode("utf-8", "surrogatepass")),  # garbage text
        st.text(alphabet="()[]{}:=,.\n\t #'\"\\abc0123456789defclassimport", max_size=3000).map(str.encode),
        st.builds(
            nested,
            st.integers(min_value=1, max_value=30000),
            st.sampled_from(["parens", "lists", "binop", "unary", "attributes", "classes"]),
        ).map(str.encode),
        st.just("class é:\n    x = 'é'\n".encode("latin-1")),  # latin-1 without a coding cookie
        st.just(b"\x00" * 64),
        st.just(b"\xef\xbb\xbf" + b"\xff\xfe" * 100),
    )


@FUZZ
@given(data=st.data())
def test_odd_member_in_wheel(slim: Slim, tmp_path: Path, data) -> None:
    members = data.draw(st.lists(st.sampled_from(slim.members), min_size=1, max_size=3, unique=True), label="members")
    contents = {m: data.draw(odd_sources(), label=m) for m in members}
    check(write_wheel(tmp_path, slim, contents), slim, touched=set(members))


@FUZZ
@given(data=st.data())
def test_odd_file_in_tree(slim: Slim, tmp_path: Path, data) -> None:
    root = write_tree(tmp_path, slim)
    members = data.draw(st.lists(st.sampled_from(slim.members), min_size=1, max_size=3, unique=True), label="members")
    for m in members:
        (root / m).write_bytes(data.draw(odd_sources(), label=m))
    check(root, slim, touched=set(members))


@FUZZ
@given(data=st.data())
def test_symlink_loops_in_tree(slim: Slim, tmp_path: Path, data) -> None:
    """Files that link to themselves, folders that link to an ancestor, pairs that link to each other."""
    root = write_tree(tmp_path, slim)
    members = data.draw(st.lists(st.sampled_from(slim.members), min_size=1, max_size=3, unique=True), label="members")
    kind = data.draw(st.sampled_from(["self", "pair", "folder-to-ancestor", "folder-to-self"]), label="kind")
    touched: set[str] = set()
    for m in members:
        target = root / m
        if kind == "self":
            target.unlink()
            target.symlink_to(target.name)
            touched.add(m)
        elif kind == "pair":
            partner = target.with_name(target.name + ".loop")
            target.unlink()
            target.symlink_to(partner.name)
            partner.symlink_to(target.name)
            touched.add(m)
        else:
            folder = target.parent
            if folder == root / "vllm" or not folder.exists() or folder.is_symlink():
                continue
            touched.update(str(p.relative_to(root)) for p in folder.rglob("*.py") if not p.is_symlink())
            shutil.rmtree(folder)
            folder.symlink_to(".." if kind == "folder-to-ancestor" else folder.name, target_is_directory=True)
    check(root, slim, touched=touched if kind in {"self", "pair"} else None)


def test_the_package_itself_a_symlink_loop(slim: Slim, tmp_path: Path) -> None:
    root = write_tree(tmp_path, slim)
    shutil.rmtree(root / "vllm")
    (root / "vllm").symlink_to("vllm", target_is_directory=True)
    assert check(root, slim) is None


# -- the console script, for real: exit codes and no traceback on stderr ----------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "metadata-corrupted", "garbage-module", "deep-nesting", "not-a-zip"])
def test_console_script_never_shows_a_traceback(slim: Slim, tmp_path: Path, damage: str) -> None:
    if damage == "truncated":
        path = tmp_path / "t.whl"
        path.write_bytes(slim.wheel[: len(slim.wheel) // 2])
    elif damage == "not-a-zip":
        path = tmp_path / "n.whl"
        path.write_bytes(b"PK\x03\x04" + b"\xff" * 100)
    elif damage == "metadata-corrupted":
        raw = bytearray(slim.wheel)
        with zipfile.ZipFile(io.BytesIO(slim.wheel)) as zf:
            info = zf.getinfo(slim.metadata)
        start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
        for at in range(start, start + min(16, info.compress_size)):
            raw[at] ^= 0x5A
        path = tmp_path / "m.whl"
        path.write_bytes(bytes(raw))
    else:
        member = next(m for m in slim.members if m.endswith("v1/request.py"))
        text = b"\xff\xfe garbage ((((" if damage == "garbage-module" else nested(100000, "binop").encode()
        path = write_wheel(tmp_path, slim, {member: text})
    script = shutil.which("vllm-compat")
    cmd = [script] if script else [sys.executable, "-m", "vllm_compat.cli"]
    done = subprocess.run(
        [*cmd, "probe", "--source", str(path), "--strict", "--allow-code-only"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    expected = {"truncated": 2, "not-a-zip": 2, "metadata-corrupted": 0, "garbage-module": 1, "deep-nesting": 1}
    assert done.returncode == expected[damage], done.stdout[-2000:] + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    if done.returncode == 2:
        assert done.stderr.startswith("vllm-compat: ") and done.stdout == ""
    elif damage == "metadata-corrupted":  # the version is unreadable; the facts are not, and they decide
        assert done.stdout.startswith("vllm-compat probe: vLLM ? (static")
    else:
        assert ("UNHANDLED" in done.stdout or "UNKNOWN" in done.stdout) and "verdict: FAIL" in done.stdout
