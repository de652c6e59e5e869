"""The ``native`` and ``native_disk`` sides: vLLM's own extraction, nothing of vllm-compat in the process.

The speculative method ``extract_hidden_states`` with the ``ExampleHiddenStatesConnector`` KV connector (vLLM >=
0.17; the path speculators >= 0.5 drives through ``vllm serve``): ``LLM.generate`` with ``max_tokens=1`` on
prefill's engine settings, the same layers' states (aux layer ``l + 1`` is the output of layer ``l``). The connector
writes one safetensors file per sequence, after ``generate()`` returns, from a thread pool in the worker: ``native``
into a folder in /dev/shm, ``native_disk`` into ``--native-disk-dir`` (default: a temp folder). A call is timed
until every file is written (its lock released); reading the files back is timed apart, and files are removed after
each call. The KV-cache budget is the same bytes, of which this path also keeps the states of the running sequences.

Harness settings, applied only where needed and recorded with the side: chunked prefill off on vLLM 0.22 (its
extraction path needs it; speculators' launcher turns it off everywhere); on a CPU build, ``--cpu-unpinned-staging``
(on by default there) lets the connector stage states in ordinary memory and poll vLLM's CPU event stand-in
(bench/cpu_unpinned_staging.py: vLLM's CPU build cannot run this connector as shipped).
"""

from __future__ import annotations

import argparse
import copy
import fcntl
import hashlib
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from .common import (
    Partial,
    Rounds,
    SideFailure,
    log,
    memory_report,
    plain,
    prompt_calls,
    reset_peak,
    runner_info,
    save_sample,
    tokens_of,
    vllm_release,
)
from .config import NATIVE_NO_CHUNKED_PREFILL, check_call, check_positions
from .prefill import engine_kwargs, shutdown


def storage_of(args: argparse.Namespace, out: Path, name: str) -> Path:
    """Where the connector writes: a folder in /dev/shm (or on disk) named after DIR and the side, outside DIR
    (whose files may travel back from a remote host), so the harness can clean it after a killed side."""
    tag = hashlib.sha1(f"{out}:{name}".encode()).hexdigest()[:10]
    if name.startswith("native_disk"):
        base = Path(args.native_disk_dir) if args.native_disk_dir else Path(tempfile.gettempdir())
        return base / f"vllm-compat-bench-native-{tag}"
    return Path("/dev/shm") / f"vllm-compat-bench-native-{tag}"


def _engine_dead(llm) -> bool:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    return bool(getattr(getattr(core, "resources", None), "engine_dead", False))


def _written(path: str) -> bool:
    """Whether the connector has finished ``path``: its ``.lock`` (made when the request is scheduled, held by the
    writer until the file is written) can be locked shared. Connectors without locks (before vLLM's writes went to a
    thread pool) wrote the file before the request finished: there the file itself says so. Raises where the lock
    was let go but no file is there (the write failed)."""
    lock = path + ".lock"
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return os.path.exists(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: its writer let go of the lock without writing the file")
    return True


def wait_written(llm, paths: list[str], timeout: float) -> None:
    """Block until every file in ``paths`` is written (polling the writer's locks), or fail on a dead engine."""
    pending = list(paths)
    deadline = time.monotonic() + timeout
    while pending:
        pending = [path for path in pending if not _written(path)]
        if not pending:
            return
        if _engine_dead(llm):
            raise RuntimeError(f"vLLM's engine died with {len(pending)} of {len(paths)} states files unwritten")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} of {len(paths)} states files not written after {timeout:.0f}s")
        time.sleep(0.0005)


def engine_error(log_file: Path, offset: int) -> str | None:
    """The error vLLM's engine or worker logged since ``offset`` of sides.log (a side's output goes there)."""
    try:
        with open(log_file, errors="replace") as f:
            f.seek(offset)
            text = f.read()
    except OSError:
        return None
    found = re.findall(r"Worker failed with error '(.+?)', please check", text)
    if found:
        return found[-1]
    found = re.findall(r"\b(\w+(?:Error|Exception): .+)$", text, re.MULTILINE)
    return found[-1].strip() if found else None


def side_native(args: argparse.Namespace, out: Path, extra: dict, partial: Partial) -> dict:
    """vLLM's own extraction: ``extract_hidden_states`` + ``ExampleHiddenStatesConnector``, timed until written."""
    log_file = out / "sides.log"
    offset = log_file.stat().st_size if log_file.exists() else 0
    release = vllm_release()
    if release < (0, 17):
        raise SideFailure(f"vLLM {release[0]}.{release[1]} has no extract_hidden_states method (vLLM >= 0.17 has)")
    storage = storage_of(args, out, extra["name"])
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(parents=True)
    try:
        return _native_calls(args, out, extra, partial, storage, release)
    except SideFailure:
        raise
    except Exception as exc:
        here = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        cause = engine_error(log_file, offset)
        reason = f"vLLM's worker failed: {cause} (here: {here})" if cause else here
        if cause and "pin_memory" in cause and args.device == "cpu":
            reason = (
                "vLLM's ExampleHiddenStatesConnector stages states in pinned host memory, which a CPU build of "
                f"torch cannot allocate (worker: {cause}); --cpu-unpinned-staging works around it on a CPU (a harness "
                f"setting, bench/cpu_unpinned_staging.py); here: {here}"
            )
        raise SideFailure(reason) from exc
    finally:
        shutil.rmtree(storage, ignore_errors=True)


def _native_calls(
    args: argparse.Namespace, out: Path, extra: dict, partial: Partial, storage: Path, release: tuple[int, int]
) -> dict:
    t0 = time.perf_counter()
    import torch
    from vllm import LLM

    name = extra["name"]
    aux = sorted({layer + 1 for layer in extra["layers"]})  # aux layer l + 1: the residual stream after layer l
    kwargs = engine_kwargs(args, extra["engine"])
    kwargs["speculative_config"] = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux}},
    }
    kwargs["kv_transfer_config"] = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    harness = {}
    if release in NATIVE_NO_CHUNKED_PREFILL:
        kwargs["enable_chunked_prefill"] = harness["enable_chunked_prefill"] = False
    if args.cpu_unpinned_staging and args.device == "cpu":
        kwargs["worker_extension_cls"] = harness["worker_extension_cls"] = "cpu_unpinned_staging.UnpinnedStagingOnCpu"
    log(
        out, name, f"aux layers {aux} (outputs of layers {[a - 1 for a in aux]}), files in {storage}; harness {harness}"
    )
    settings = plain({k: v for k, v in kwargs.items() if k != "model"})  # before vLLM makes config objects of it
    llm = LLM(**copy.deepcopy(kwargs))
    result = partial.result
    result |= {
        "init_seconds": time.perf_counter() - t0,
        "runner": llm.collective_rpc(runner_info)[0],
        "settings": settings,
        "harness": harness,
        "vllm": ".".join(map(str, release)),
        "torch": torch.__version__,
        "storage": str(storage),
        "aux_layers": aux,
        "warmup": [],
        "rounds": [],
    }
    log(out, name, f"LLM ready in {result['init_seconds']:.1f}s; {result['runner']}")
    try:
        _timed_calls(args, out, extra, partial, llm, aux)
    finally:
        shutdown(llm)
    return result


def _timed_calls(args: argparse.Namespace, out: Path, extra: dict, partial: Partial, llm, aux: list[int]) -> None:
    from safetensors.torch import load_file
    from vllm import SamplingParams

    name, result = extra["name"], partial.result
    params = SamplingParams(max_tokens=1, temperature=0.0)
    hidden = llm.llm_engine.model_config.get_hidden_size()
    calls = prompt_calls(args)
    positions = check_positions(args)

    def one_call(call: list[list[int]], keep: bool) -> tuple[dict, list]:
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in call], params, use_tqdm=False)
        returned = time.perf_counter()
        if len(outputs) != len(call):
            raise RuntimeError(f"generate() returned {len(outputs)} outputs for {len(call)} prompts")
        paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outputs]
        if not all(paths):
            raise RuntimeError("a request finished without a hidden_states_path in its kv_transfer_params")
        wait_written(llm, paths, args.native_wait_timeout)
        end = time.perf_counter()
        kept, size = [], 0
        for k, (ids, path) in enumerate(zip(call, paths, strict=True)):  # read back, checked, removed: not timed
            data = load_file(path)
            got = data["hidden_states"]
            if data["token_ids"].tolist() != ids:
                raise RuntimeError(f"{path} holds other token ids than its prompt")
            if tuple(got.shape) != (len(ids), len(aux), hidden):
                raise RuntimeError(f"{path}: states of shape {tuple(got.shape)}, not {(len(ids), len(aux), hidden)}")
            if keep and k in positions:
                kept.append([got[:, a] for a in range(len(aux))])
            size += os.path.getsize(path)
            for file in (path, path + ".lock"):
                if os.path.exists(file):
                    os.remove(file)
        entry = {
            "seconds": end - start,
            "generate_seconds": returned - start,
            "read_seconds": time.perf_counter() - end,
            "file_bytes": size,
        }
        return entry, kept

    for i in range(args.warmup_calls):
        entry, _ = one_call(calls[i], False)
        result["warmup"].append(entry)
        log(out, name, f"warm-up call {i}: {entry['seconds']:.3f}s")
    llm.collective_rpc(reset_peak)
    rounds = Rounds(extra.get("rounds", args.repeat), extra.get("deadline"))
    for r in rounds:
        done: list[dict] = []
        result["rounds"].append({"calls": done})
        for j, call in enumerate(calls[args.warmup_calls :]):
            keep = r == 0 and args.warmup_calls + j == check_call(args) and extra.get("sample")
            entry, kept = one_call(call, keep)
            done.append(entry)
            partial.write()
            if keep:
                save_sample(out, name, call, positions, [a - 1 for a in aux], kept)
            log(
                out,
                name,
                f"round {r + 1} call {j}: {tokens_of(call)} tokens in {entry['seconds']:.3f}s (generate() returned "
                f"after {entry['generate_seconds']:.3f}s, files ({entry['file_bytes'] / 2**20:.0f} MiB) written "
                f"{entry['seconds'] - entry['generate_seconds']:.3f}s later); reading them back "
                f"{entry['read_seconds']:.3f}s",
            )
    result["stopped"] = rounds.stopped
    result["memory"] = llm.collective_rpc(memory_report)[0]
