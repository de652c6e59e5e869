"""The states-through-shared-memory hand-over between two real processes (torch needed; no engine).

A child process stands in for vLLM's worker: it packs tensors as the adapter does after speculators'
``_get_captured_states`` and writes the pickled reply; this process unpickles it as vLLM's executor does in the
generator's process. What users rely on: bit-identical values and structure, each call's states in memory of their
own (a later call never overwrites them, and speculators' ``.clone()`` hands that memory over instead of copying),
the next call's segment prepared ahead, nothing left in /dev/shm or mapped in the worker, memory freed with the last
tensor, and a fallback to the RPC reply where /dev/shm has no room.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from vllm_compat.adapters import transfer  # noqa: E402

pytestmark = pytest.mark.e2e
needs_shm = pytest.mark.skipif(not os.path.isdir(transfer.SHM_DIR), reason="no /dev/shm on this platform")

CHILD = textwrap.dedent(
    """
    import pickle, sys, torch
    from vllm_compat.adapters.transfer import SharedStates, _SEGMENTS

    def states(seed, rows, as_dict):
        g = torch.Generator().manual_seed(seed)
        layers = [torch.randn(rows, 8, generator=g).to(torch.bfloat16) for _ in range(3)]
        if not as_dict:
            return layers
        return {f"req_0_{i}": [h[i::2] for h in layers] for i in range(2)}  # non-contiguous views too

    for line in sys.stdin:
        seed, rows, as_dict, out = line.split()
        handle = SharedStates.pack(states(int(seed), int(rows), as_dict == "1"))
        with open(out, "wb") as f:
            pickle.dump({"handle": handle, "stats": dict(_SEGMENTS.stats), "path": handle.path}, f)
        print("ok", flush=True)
    """
)


def expected(seed: int, rows: int, as_dict: bool):
    g = torch.Generator().manual_seed(seed)
    layers = [torch.randn(rows, 8, generator=g).to(torch.bfloat16) for _ in range(3)]
    if not as_dict:
        return layers
    return {f"req_0_{i}": [h[i::2] for h in layers] for i in range(2)}


class Worker:
    """A child process that packs states on request, like a vLLM worker answering ``_get_captured_states``."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.n = 0
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tmp
        )  # not the checkout: the installed vllm_compat

    def pack(self, seed: int, rows: int, as_dict: bool = False) -> dict:
        self.n += 1
        out = self.tmp / f"reply{self.n}.pkl"
        self.proc.stdin.write(f"{seed} {rows} {int(as_dict)} {out}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"
        return pickle.loads(out.read_bytes())  # unpickling maps the segment: what the generator's process does

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture
def worker(tmp_path: Path):
    w = Worker(tmp_path)
    yield w
    w.close()


def ours() -> set[str]:
    return {n for n in os.listdir(transfer.SHM_DIR) if n.startswith(transfer.PREFIX)}


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@needs_shm
@pytest.mark.parametrize("as_dict", [False, True], ids=["list-per-layer", "dict-per-request"])
def test_values_and_structure_survive(worker: Worker, as_dict: bool) -> None:
    reply = worker.pack(1, 100, as_dict)["handle"]
    assert same(reply, expected(1, 100, as_dict))


def state(path: str) -> int:
    """A segment's state as this process sees it (free, in use, retired)."""
    return transfer._state(transfer._MAPPED[path])


@needs_shm
def test_segments_are_reused_once_let_go_and_leave_no_name(tmp_path: Path) -> None:
    import gc

    before = ours()
    w = Worker(tmp_path)
    gc.disable()  # freed by reference counting as the last tensor goes, not whenever the collector runs
    try:
        first = w.pack(1, 100)
        assert first["path"] not in ours(), "the generator's process removes a segment's name once it mapped it"
        assert not first["stats"]["reused"], "nothing to reuse on the first call"
        assert first["stats"]["pool_segments"] == 2, "the first call makes the spare for the second as well"
        held = w.pack(2, 50)  # the first call's states are still held: another segment (the spare)
        assert held["path"] != first["path"] and held["stats"]["reused"]
        assert same(first["handle"], expected(1, 100, False)), "a held call's states are never overwritten"
        assert state(first["path"]) == transfer._IN_USE
        paths = {first["path"], held["path"]}
        first_path = first["path"]
        del first
        assert state(first_path) == transfer._FREE, "free again once its last tensor is gone"
        for seed in range(3, 9):  # a loop that drops each call's states before the next, as a data pipeline does
            reply = w.pack(seed, 80)
            assert reply["stats"]["reused"] and same(reply["handle"], expected(seed, 80, False))
            paths.add(reply["path"])
            del reply
        assert len(paths) <= 4 and w.pack(9, 10)["stats"]["pool_segments"] <= 4, "the pool does not grow"
        rows = 4 * transfer._STEP // (8 * 2 * 3)  # more than any segment holds: made on the spot
        big = w.pack(10, rows)
        assert not big["stats"]["reused"] and big["stats"]["segment_bytes"] >= rows * 8 * 2 * 3
        assert same(big["handle"], expected(10, rows, False))
        assert same(held["handle"], expected(2, 50, False))
    finally:
        gc.enable()
        w.close()
    assert ours() <= before, "the spare segment is removed when the worker exits"
    transfer._forget_retired()
    assert not [p for p in transfer._MAPPED if transfer._owner(p) == w.proc.pid], "mappings of a gone worker drop"


@needs_shm
def test_speculators_copy_is_a_hand_over(worker: Worker) -> None:
    """``.clone()`` (after slicing, as 0.3.0 does) gives plain tensors over the call's memory; other ops copy."""
    views = worker.pack(1, 100)["handle"]
    handed = transfer.handed_over_type()
    assert all(type(h) is handed for h in views)
    rows = views[0][10:20]
    assert type(rows) is handed, "indexing keeps the type"
    kept = rows.clone().cpu()
    assert type(kept) is torch.Tensor and kept.data_ptr() == rows.data_ptr(), "handed over, not copied"
    assert torch.equal(kept, expected(1, 100, False)[0][10:20])
    doubled = views[0] * 2
    assert type(doubled) is torch.Tensor and doubled.data_ptr() != views[0].data_ptr()
    worker.pack(2, 100)
    assert torch.equal(kept, expected(1, 100, False)[0][10:20]), "the next call does not touch it"
    restored = pickle.loads(pickle.dumps(views[1]))  # picklable by name, as torch.save needs
    assert type(restored) is handed and torch.equal(restored, expected(1, 100, False)[1])


@needs_shm
def test_a_failed_copy_gives_its_segment_back() -> None:
    segments = transfer._Segments()
    try:
        slot = transfer._Slot(transfer._HEADER, 4 * 8 * 2, "bfloat16", (4, 8))
        wrong = torch.zeros(5, 8, dtype=torch.bfloat16)  # not the slot's shape: the copy raises
        with pytest.raises(RuntimeError):
            transfer._copy_in(segments, transfer._HEADER + 64, [slot], [(wrong, slot, [])], 1)
        assert segments.pool and all(s.state == transfer._FREE for s in segments.pool), "reusable, not leaked"
    finally:
        segments.close()
    assert not segments.pool


@needs_shm
def test_orphaned_segment_of_a_dead_worker_is_removed(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = Path(transfer.SHM_DIR) / f"{transfer.PREFIX}{int(dead.stdout)}_deadbeef"
    orphan.write_bytes(b"x" * 128)
    w = Worker(tmp_path)
    try:
        w.pack(1, 10)
    finally:
        w.close()
    assert not orphan.exists()


def test_no_room_falls_back_to_the_rpc_reply(monkeypatch: pytest.MonkeyPatch, caplog, tmp_path: Path) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transfer, "SHM_DIR", str(tmp_path))
    monkeypatch.setattr(transfer.os, "posix_fallocate", full)
    monkeypatch.setattr(transfer, "_WARNED", [])
    states = expected(1, 10, True)
    with caplog.at_level("WARNING", logger="vllm_compat"):
        returned = transfer.SharedStates.pack(states, segments=transfer._Segments())
    assert returned is states
    assert "--shm-size" in caplog.text and "message queue" in caplog.text
    assert list(tmp_path.iterdir()) == []


EQUIVALENCE = textwrap.dedent(
    """
    import inspect, json, pickle, sys, types
    import vllm_compat  # first, as in a worker: speculators needs its import adapters under transformers 5
    import torch
    from speculators.data_generation import custom_worker
    from vllm_compat.adapters import transfer

    cls = custom_worker.HiddenStatesWorkerExtension
    if not hasattr(cls, "_set_request_metadata"):
        print(json.dumps({"skip": "speculators 0.3 returns per-layer tensors (no per-request grouping)"}))
        sys.exit(0)
    original = inspect.getattr_static(cls, "_get_captured_states")
    while hasattr(original, "__wrapped__"):  # speculators' own method, past any wrapper
        original = original.__wrapped__
    steps, metadata = json.loads(sys.argv[1])

    def extension():
        g = torch.Generator().manual_seed(len(steps))
        ext = types.SimpleNamespace()
        ext._captured_states = [[torch.randn(n, 8, generator=g).to(torch.bfloat16) for n in steps] for _ in range(3)]
        ext._request_metadata = [[tuple(item) for item in step] for step in metadata]
        return ext

    expected = original(extension())
    ext = extension()
    segments = transfer._Segments()
    handle = transfer.collect_per_request(ext, segments=segments)
    got = pickle.loads(pickle.dumps(handle))  # what the generator's process receives
    print(json.dumps({
        "keys": [list(got), list(expected)],
        "equal": all(len(got[k]) == len(expected[k]) and all(
            a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(got[k], expected[k]))
            for k in expected),
        "shapes": {k: [list(t.shape) for t in v] for k, v in expected.items()},
        "cleared": ext._captured_states is None and ext._request_metadata == [],
    }))
    segments.close()
    """
)


@pytest.mark.parametrize(
    ("steps", "metadata"),
    [
        # a request split over three steps, others between its pieces; an id that sorts before req_0_2 as a string
        (
            [7, 5, 9],
            [[("req_0_0", 4), ("req_0_1", 3)], [("req_0_2", 2), ("req_0_1", 3)], [("req_0_1", 1), ("req_0_10", 8)]],
        ),
        # a step with more captured rows than its metadata counts: speculators' running index is kept as it is
        ([7, 6], [[("req_1_0", 4), ("req_1_1", 3)], [("req_1_1", 2), ("req_1_2", 3)]]),
        # metadata past the captured rows: the last slice comes out short, as speculators' slicing does
        ([4], [[("req_2_0", 3), ("req_2_1", 3)]]),
    ],
    ids=["split-requests", "extra-rows", "short-capture"],
)
def test_per_request_collect_equals_speculators(steps, metadata, tmp_path: Path) -> None:
    """``collect_per_request`` returns what speculators 0.4.0.1's own ``_get_captured_states`` returns, bit for bit."""
    import importlib.util
    import json

    if importlib.util.find_spec("speculators") is None:  # found, not imported: the child imports it after vllm_compat
        pytest.skip("needs speculators")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_COMPAT_DISABLE"}  # the child is a user's process
    done = subprocess.run(
        [sys.executable, "-c", EQUIVALENCE, json.dumps([steps, metadata])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )  # not the checkout
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    got, expected = result["keys"]
    assert got == expected, "the same requests, in the same order"
    assert result["equal"], f"states differ (shapes {result['shapes']})"
    assert result["cleared"]


def test_per_request_collect_leaves_other_shapes_to_speculators() -> None:
    """Not 0.4.0.1's structures (0.3.0's extension, nothing captured): None, and nothing is touched."""
    import types

    assert transfer.collect_per_request(types.SimpleNamespace(_captured_states=None)) is None
    ext = types.SimpleNamespace(_captured_states=[[torch.zeros(2, 4)]])  # no _request_metadata: speculators 0.3.0
    assert transfer.collect_per_request(ext) is None and ext._captured_states is not None
