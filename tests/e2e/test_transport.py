"""The shared-memory hand-over of captured states between real processes (torch needed; no engine).

A child process stands in for vLLM's worker: it writes states as the adapter does after speculators'
``_get_captured_states`` and sends the pickled reply; this process unpickles it as vLLM's executor does in the
generator's process, and copies the states as speculators does (``h.clone().cpu()``, after slicing on 0.3.0). What
users rely on: bit-identical values and structure, and ordinary tensors: each owns exactly its bytes (saving or
pickling one writes that one), survives ``fork()`` as a snapshot, and nothing another process or a later call does
changes it; nothing is left in /dev/shm, and only files whose owner is provably dead are ever removed.
"""

from __future__ import annotations

import gc
import io
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from vllm_compat.adapters import transfer  # noqa: E402

from vllm_compat import transport  # noqa: E402

pytestmark = pytest.mark.e2e
needs_shm = pytest.mark.skipif(not os.path.isdir(transport.SHM_DIR), reason="no /dev/shm on this platform")

CHILD = textwrap.dedent(
    """
    import os, pickle, sys, torch
    from vllm_compat.adapters.transfer import WRITER, pack

    def states(seed, rows, as_dict):
        g = torch.Generator().manual_seed(seed)
        layers = [torch.randn(rows, 8, generator=g).to(torch.bfloat16) for _ in range(3)]
        if not as_dict:
            return layers
        return {f"req_0_{i}": [h[i::2] for h in layers] for i in range(2)}  # non-contiguous views too

    print(os.getpid(), flush=True)
    for line in sys.stdin:
        if line.strip() == "handed":  # how many handed-over files the worker still holds
            print(len(WRITER.handed), flush=True)
            continue
        seed, rows, as_dict, out = line.split()
        handle = pack(states(int(seed), int(rows), as_dict == "1"))
        with open(out + ".tmp", "wb") as f:
            pickle.dump({"handle": handle, "stats": dict(WRITER.stats), "path": handle.path}, f)
        os.replace(out + ".tmp", out)
        print("ok", flush=True)
    """
)


def expected(seed: int, rows: int, as_dict: bool = False):
    g = torch.Generator().manual_seed(seed)
    layers = [torch.randn(rows, 8, generator=g).to(torch.bfloat16) for _ in range(3)]
    if not as_dict:
        return layers
    return {f"req_0_{i}": [h[i::2] for h in layers] for i in range(2)}


class Worker:
    """A child process that writes states on request, like a vLLM worker answering ``_get_captured_states``."""

    def __init__(self, tmp: Path, prefix: list[str] | None = None) -> None:
        self.tmp = tmp
        self.n = 0
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-c", CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=tmp,  # not the checkout: the installed vllm_compat
        )
        self.pid = int(self.proc.stdout.readline())

    def send(self, seed: int, rows: int, as_dict: bool = False) -> Path:
        """Ask for a call's states; the pickled reply is left in a file, not yet opened."""
        self.n += 1
        out = self.tmp / f"reply{self.n}.pkl"
        self.proc.stdin.write(f"{seed} {rows} {int(as_dict)} {out}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"
        return out

    def pack(self, seed: int, rows: int, as_dict: bool = False) -> dict:
        return pickle.loads(self.send(seed, rows, as_dict).read_bytes())  # what the generator's process does

    def holds(self) -> int:
        self.proc.stdin.write("handed\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@pytest.fixture
def worker(tmp_path: Path):
    w = Worker(tmp_path)
    yield w
    w.close()


def ours() -> set[str]:
    return {n for n in os.listdir(transport.SHM_DIR) if n.startswith(transport.PREFIX)}


def wait_for_files(before: set[str], count: int, timeout: float = 30.0) -> set[str]:
    """The states files made since ``before``, once there are ``count`` of them (a spare is made by a thread)."""
    deadline = time.monotonic() + timeout
    while len(ours() - before) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return ours() - before


def mapped_states_files() -> int:
    """How many mappings of states files this process has (the files are unlinked: '(deleted)')."""
    with open("/proc/self/maps") as f:
        return sum(transport.PREFIX in line for line in f)


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def speculators_copy(reply, as_dict: bool = False):
    """What speculators' generate() does with the reply: 0.4.0.1 clones each request's states, 0.3.0 slices each
    layer by the input lengths and clones the slices (here: rows of 10)."""
    if as_dict:
        return {k: [h.clone().cpu() for h in v] for k, v in reply.items()}
    rows = reply[0].shape[0]
    return [[h[i : i + 10].clone().cpu() for h in reply] for i in range(0, rows, 10)]


def expected_samples(seed: int, rows: int):
    return [[h[i : i + 10] for h in expected(seed, rows)] for i in range(0, rows, 10)]


@needs_shm
@pytest.mark.parametrize("as_dict", [False, True], ids=["list-per-layer", "dict-per-request"])
def test_values_and_structure_survive(worker: Worker, as_dict: bool) -> None:
    reply = worker.pack(1, 100, as_dict)["handle"]
    assert same(reply, expected(1, 100, as_dict))
    assert same(speculators_copy(reply, as_dict), expected(1, 100, as_dict) if as_dict else expected_samples(1, 100))


@needs_shm
def test_returned_states_are_plain_tensors_that_own_exactly_their_bytes(worker: Worker) -> None:
    """The audit: one saved sample held its call's whole segment (12 to 24x its size, its neighbours' states)."""
    samples = speculators_copy(worker.pack(1, 400)["handle"])
    sample = samples[3]
    nbytes = sum(h.numel() * h.element_size() for h in sample)
    assert all(type(h) is torch.Tensor for h in sample)
    assert all(h.untyped_storage().nbytes() == h.numel() * h.element_size() for h in sample)
    saved = io.BytesIO()
    torch.save({"hidden_states": sample}, saved)
    assert len(saved.getvalue()) < nbytes + 4096, f"{len(saved.getvalue())} bytes saved for a {nbytes}-byte sample"
    assert len(pickle.dumps(sample)) < nbytes + 4096
    loaded = torch.load(io.BytesIO(saved.getvalue()))["hidden_states"]
    assert same(loaded, expected_samples(1, 400)[3])
    copy = sample[0].clone()
    copy.add_(1)
    assert same(sample, expected_samples(1, 400)[3]), "clone() is independent"
    sample[1].mul_(0)
    assert same(samples[4], expected_samples(1, 400)[4]), "a write to one sample is private to it"
    assert same(samples[3][0], expected_samples(1, 400)[3][0])


@needs_shm
def test_handed_over_tensors_are_copied_only_where_they_must_be(worker: Worker) -> None:
    reply = worker.pack(1, 100)["handle"]
    handed = transport.handed_over_type()
    assert all(type(h) is handed for h in reply)
    rows = reply[0][10:20]
    assert type(rows) is handed, "indexing keeps the type"
    kept = rows.clone()
    assert type(kept) is torch.Tensor and kept.data_ptr() != rows.data_ptr(), "a mapping of its own"
    doubled = reply[0] * 2
    assert type(doubled) is torch.Tensor and torch.equal(doubled, expected(1, 100)[0] * 2)
    odd = reply[1][::2].clone()  # not contiguous: a real copy, still right
    assert type(odd) is torch.Tensor and torch.equal(odd, expected(1, 100)[1][::2])
    reply[2][0].fill_(7)  # written after the hand-over: clone() copies what is there now
    assert torch.equal(reply[2][:5].clone()[0], torch.full((8,), 7, dtype=torch.bfloat16))


@needs_shm
def test_a_later_call_never_changes_earlier_results(worker: Worker) -> None:
    first = speculators_copy(worker.pack(1, 100)["handle"])
    for seed in range(2, 6):
        speculators_copy(worker.pack(seed, 100)["handle"])
    assert same(first, expected_samples(1, 100))


@needs_shm
def test_fork_gives_the_child_a_snapshot(worker: Worker) -> None:
    """The audit: a forked child that dropped its copy freed the parent's segment, and the next call overwrote it."""
    held = speculators_copy(worker.pack(1, 100)["handle"])
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_drop, args=(held,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    for seed in range(2, 5):
        speculators_copy(worker.pack(seed, 100)["handle"])
    assert same(held, expected_samples(1, 100))

    def write_and_check(queue) -> None:
        ok_before = torch.equal(held[0][0], expected_samples(1, 100)[0][0])
        held[0][0].fill_(-1)  # the child's write stays in the child
        queue.put(ok_before)

    queue = ctx.Queue()
    child = ctx.Process(target=write_and_check, args=(queue,))
    child.start()
    assert queue.get(timeout=30) is True
    child.join(30)
    assert same(held, expected_samples(1, 100)), "nothing a child does changes the parent's states"


def _drop(samples: list) -> None:
    samples.clear()  # the child's copies go (and their mappings, in the child)
    gc.collect()


def _save(path: str, sample) -> None:
    time.sleep(0.2)  # the parent moves on to its next calls meanwhile
    torch.save({"hidden_states": sample}, path)


@needs_shm
def test_saving_each_call_from_forked_processes(worker: Worker, tmp_path: Path) -> None:
    """The audit: 4 of 6 files saved by forked processes held a later call's states, with no error."""
    ctx = multiprocessing.get_context("fork")
    children = []
    for seed in range(1, 7):
        samples = speculators_copy(worker.pack(seed, 60)["handle"])
        child = ctx.Process(target=_save, args=(str(tmp_path / f"call{seed}.pt"), samples[0]))
        child.start()
        children.append(child)
        del samples  # the parent keeps nothing
    for child in children:
        child.join(60)
        assert child.exitcode == 0
    for seed in range(1, 7):
        saved = torch.load(tmp_path / f"call{seed}.pt")["hidden_states"]
        assert same(saved, expected_samples(seed, 60)[0]), f"call {seed}"


@needs_shm
def test_memory_goes_with_the_last_tensor_and_no_name_is_left(tmp_path: Path) -> None:
    before = ours()
    w = Worker(tmp_path)
    try:
        gc.disable()  # freed by reference counting as the last tensor goes, not whenever the collector runs
        reply = w.pack(1, 200)
        assert reply["path"] not in ours(), "the generator's process removes the name once it opened the file"
        deadline = time.monotonic() + 10
        while w.holds() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.holds() == 0, "the worker lets go of a file once it is taken: its memory goes with the tensors"
        base = transport._MAPS.live - 1  # before the reply: it holds one mapping of the call's file
        samples = speculators_copy(reply["handle"])
        assert transport._MAPS.live == base + 61, "one mapping per returned tensor (20 samples x 3 layers)"
        del reply
        assert transport._MAPS.live == base + 60, "the reply's own mapping goes with it"
        kept = samples[5][1]
        del samples
        assert transport._MAPS.live == base + 1 and mapped_states_files() == 1
        assert torch.equal(kept, expected_samples(1, 200)[5][1])
        del kept
        assert transport._MAPS.live == base and mapped_states_files() == 0, "nothing is mapped once no tensor is left"
    finally:
        gc.enable()
        w.close()
    assert ours() <= before, "the spare file is removed when the worker exits"


@needs_shm
def test_the_caller_maps_only_the_workers_own_file(worker: Worker, tmp_path: Path) -> None:
    path, size, device, inode, spec = _handle_args(worker.send(1, 10).read_bytes())
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"\0" * size)
    os.unlink(path)
    os.symlink(decoy, path)  # someone put a link where the worker's file was
    try:
        with pytest.raises(transport.TransportError, match="cannot be opened"):
            transport.open_states(path, size, device, inode, spec)
    finally:
        os.unlink(path)
    other = Path(path)
    other.write_bytes(b"\0" * size)  # another file under the same name
    try:
        with pytest.raises(transport.TransportError, match="not the file the worker wrote"):
            transport.open_states(path, size, device, inode, spec)
    finally:
        other.unlink()


def _handle_args(data: bytes) -> tuple:
    """The arguments a pickled reply passes to ``open_states``, without opening anything."""
    seen: list[tuple] = []
    real = transport.open_states
    transport.open_states = lambda *args: seen.append(args) or None  # pickle looks the function up by name
    try:
        pickle.loads(data)
    finally:
        transport.open_states = real
    return seen[0]


@needs_shm
def test_files_of_live_owners_are_never_removed_across_pid_namespaces(tmp_path: Path) -> None:
    """The audit: a job in another PID namespace sees this job's pids as dead and deleted its live spare."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"]).returncode != 0:
        pytest.skip("needs root and unshare")
    before = ours()
    namespace = ["unshare", "-p", "-f", "--kill-child", "--mount-proc"]
    other = Worker(tmp_path, prefix=namespace)  # another job, in a PID namespace of its own
    try:
        assert other.pid == 1, "the stand-in worker runs as pid 1 of its own namespace"
        out = other.send(1, 50)  # its reply is not taken yet; its spare is being made
        theirs = wait_for_files(before, 2)
        assert len(theirs) == 2, theirs
        assert transport.remove_dead_files() == 0
        assert ours() - before == theirs, "a live job's files stay"
        reply = pickle.loads(out.read_bytes())
        assert same(reply["handle"], expected(1, 50))
    finally:
        other.proc.kill()
        other.proc.wait(30)
    time.sleep(0.2)
    transport.remove_dead_files()
    assert ours() <= before, "once its owner is dead, any process removes it"


@needs_shm
def test_a_killed_workers_files_are_removed_by_whoever_notices(tmp_path: Path) -> None:
    before = ours()
    w = Worker(tmp_path)
    out = w.send(1, 50)  # handed over (not yet taken) and a spare in the making
    assert len(wait_for_files(before, 2)) == 2
    os.kill(w.pid, signal.SIGKILL)
    w.proc.wait(30)
    reply = pickle.loads(out.read_bytes())  # the last reply was whole: still taken; the dead worker's spare goes
    assert same(reply["handle"], expected(1, 50))
    assert ours() <= before


@needs_shm
def test_a_failed_copy_leaves_no_file() -> None:
    writer = transport.StatesWriter()
    before = ours()
    try:
        slot = transport.Slot(0, 4 * 8 * 2, "bfloat16", (4, 8))
        wrong = torch.zeros(5, 8, dtype=torch.bfloat16)  # not the slot's shape: the copy raises
        with pytest.raises(RuntimeError):
            writer.write([slot], 64, [(wrong, slot, [])])
        assert not writer.handed
    finally:
        writer.close()
    assert ours() <= before


@needs_shm
def test_too_many_live_mappings_fall_back_to_copies(worker: Worker, monkeypatch, caplog) -> None:
    reply = worker.pack(1, 100)["handle"]
    monkeypatch.setattr(transport._MAPS, "limit", transport._MAPS.live + 5)
    monkeypatch.setattr(transport._MAPS, "warned", False)
    with caplog.at_level("WARNING", logger="vllm_compat"):
        samples = speculators_copy(reply)
    assert same(samples, expected_samples(1, 100))
    assert "vm.max_map_count" in caplog.text
    assert transport._MAPS.live <= transport._MAPS.limit


def test_no_room_falls_back_to_the_rpc_reply(monkeypatch: pytest.MonkeyPatch, caplog, tmp_path: Path) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transport, "SHM_DIR", str(tmp_path))
    monkeypatch.setattr(transport.os, "posix_fallocate", full)
    monkeypatch.setattr(transport, "_WARNED", [])
    states = expected(1, 10, True)
    with caplog.at_level("WARNING", logger="vllm_compat"):
        returned = transfer.pack(states, writer=transport.StatesWriter())
    assert returned is states
    assert "--shm-size" in caplog.text and "message queue" in caplog.text
    assert list(tmp_path.iterdir()) == []


EQUIVALENCE = textwrap.dedent(
    """
    import inspect, json, pickle, sys, types
    import vllm_compat  # first, as in a worker: speculators needs its import adapters under transformers 5
    import torch
    from speculators.data_generation import custom_worker
    from vllm_compat import transport
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
    writer = transport.StatesWriter()
    handle = transfer.collect_per_request(ext, writer=writer)
    got = pickle.loads(pickle.dumps(handle))  # what the generator's process receives
    print(json.dumps({
        "keys": [list(got), list(expected)],
        "equal": all(len(got[k]) == len(expected[k]) and all(
            a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(got[k], expected[k]))
            for k in expected),
        "shapes": {k: [list(t.shape) for t in v] for k, v in expected.items()},
        "cleared": ext._captured_states is None and ext._request_metadata == [],
    }))
    writer.close()
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
    got, expected_keys = result["keys"]
    assert got == expected_keys, "the same requests, in the same order"
    assert result["equal"], f"states differ (shapes {result['shapes']})"
    assert result["cleared"]


def test_per_request_collect_leaves_other_shapes_to_speculators() -> None:
    """Not 0.4.0.1's structures (0.3.0's extension, nothing captured): None, and nothing is touched."""
    import types

    assert transfer.collect_per_request(types.SimpleNamespace(_captured_states=None)) is None
    ext = types.SimpleNamespace(_captured_states=[[torch.zeros(2, 4)]])  # no _request_metadata: speculators 0.3.0
    assert transfer.collect_per_request(ext) is None and ext._captured_states is not None


@needs_shm
def test_only_this_transports_unlocked_files_are_removed() -> None:
    """An unlocked file of this transport's naming is a dead worker's; a file of vllm-compat 0.1.0's naming (which
    took no lock, so a live one looks the same) and a file of another program are left alone."""
    import uuid

    dead = Path(transport.SHM_DIR) / f"{transport.PREFIX}{uuid.uuid4().hex}"
    older = Path(transport.SHM_DIR) / f"{transport.PREFIX}{os.getpid()}_{uuid.uuid4().hex}"
    other = Path(transport.SHM_DIR) / f"not_{transport.PREFIX}{uuid.uuid4().hex}"
    for path in (dead, older, other):
        path.write_bytes(b"x" * 64)
    try:
        assert transport.remove_dead_files() >= 1
        assert not dead.exists()
        assert older.exists() and other.exists()
    finally:
        for path in (dead, older, other):
            path.unlink(missing_ok=True)
