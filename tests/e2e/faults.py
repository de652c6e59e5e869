"""Fault injection around a real engine: /dev/shm filling up, emptied, read-only or gone, calls from two threads, and
another process going for the states' memory. Every state is judged against transformers (float32).

Run by tests/e2e/test_faults.py inside a mount namespace of its own whose /dev/shm is a fresh tmpfs of a set size
(``unshare -m`` and a tmpfs mount), so nothing here touches the host's /dev/shm:

    python tests/e2e/faults.py --model DIR --out OUT.json

Each case runs its calls in threads joined with a timeout (a hang is recorded as one) and records what the user sees.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

CALL_TIMEOUT = 180.0
LAYERS = [0, 1, 2]  # not the last: transformers' output_hidden_states has it after the final norm
RECORD: dict[str, Any] = {"cases": {}}


def shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 500) for _ in range(length - rng.randrange(0, length // 4))] for _ in range(n)]


class Judge:
    """Each returned state against transformers' float32 residual stream after its layer: the largest
    ``max|diff| / max|ref|`` (float32 on both sides: about 1e-6; a state of another sequence or layer: about 1)."""

    def __init__(self, model: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def worst(self, call: list[list[int]], results: list[dict]) -> float:
        torch = self.torch
        worst = 0.0
        assert len(results) == len(call), f"{len(results)} results for {len(call)} sequences"
        with torch.no_grad():
            for ids, result in zip(call, results, strict=True):
                assert result["input_ids"].tolist() == ids, "not in input order"
                hs = self.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
                for got, layer in zip(result["hidden_states"], LAYERS, strict=True):
                    ref = hs[layer + 1][0]
                    worst = max(worst, ((got.float() - ref).abs().max() / ref.abs().max()).item())
        return worst


def in_thread(fn: Any, timeout: float = CALL_TIMEOUT) -> dict[str, Any]:
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = f"{type(exc).__name__}: {exc}"
            box["trace"] = traceback.format_exc(limit=20)[-3000:]

    thread = threading.Thread(target=target, daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(timeout)
    box["seconds"] = round(time.monotonic() - start, 2)
    if thread.is_alive():
        box["hang"] = True
    return box


def record(name: str, **values: Any) -> None:
    RECORD["cases"][name] = values
    print(f"[faults] {name}: {json.dumps({k: v for k, v in values.items() if k != 'trace'})[:400]}", flush=True)


def calls_and_judge(generator: Any, judge: Judge, calls: list[list[list[int]]], keep: bool) -> dict[str, Any]:
    """Run the calls one after another; judge each (keeping every result alive to the end when ``keep``)."""
    held, worst, done = [], 0.0, 0
    for call in calls:
        box = in_thread(lambda call=call: generator.generate(call))
        if "value" not in box:
            return {"done": done, "worst": worst, **{k: box[k] for k in ("error", "trace", "hang") if k in box}}
        done += 1
        if keep:
            held.append((call, box["value"]))
        else:
            worst = max(worst, judge.worst(call, box["value"]))
    for call, results in held:
        worst = max(worst, judge.worst(call, results))
    held_bytes = sum(h.numel() * h.element_size() for _, rs in held for r in rs for h in r["hidden_states"])
    return {"done": done, "worst": worst, "held_bytes": held_bytes}


def case_hold(generator: Any, judge: Judge, target_bytes: int) -> None:
    """A caller that keeps every call's results, more bytes in all than /dev/shm holds."""
    before = shm_used()
    calls, seed = [], 0
    per_call = 8 * 512 * len(LAYERS) * judge.model.config.hidden_size * 4
    while len(calls) * per_call < target_bytes:
        calls.append(prompts(seed, 8, 512))
        seed += 1
    found = calls_and_judge(generator, judge, calls, keep=True)
    record("hold", calls=len(calls), shm_used_before=before, shm_used_after=shm_used(), **found)


def case_threads(generator: Any, judge: Judge) -> None:
    """Two threads calling generate() on one generator at once, six calls each."""
    results: dict[int, dict[str, Any]] = {}

    def run(t: int) -> None:
        calls = [prompts(100 * t + i, 5 + i, 64) for i in range(6)]
        results[t] = calls_and_judge(generator, judge, calls, keep=False)

    threads = [threading.Thread(target=run, args=(t,), daemon=True) for t in (1, 2)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * 6 * CALL_TIMEOUT)
    hung = any(t.is_alive() for t in threads)
    record("threads", seconds=round(time.monotonic() - start, 1), hang=hung, per_thread=results)


def case_other_process(generator: Any, judge: Judge) -> None:
    """Another process of this user goes for the states' memory through the worker's descriptors."""
    call = prompts(7, 4, 128)
    results = generator.generate(call)
    attempts = []
    for pid in _worker_pids():
        for fd in os.listdir(f"/proc/{pid}/fd"):
            path = f"/proc/{pid}/fd/{fd}"
            try:
                target = os.readlink(path)
            except OSError:
                continue
            if "vllm-compat-states" not in target:
                continue
            code = (
                "import os, sys\n"
                "fd = os.open(sys.argv[1], os.O_RDWR)\n"
                "for what, act in (('write', lambda: os.pwrite(fd, b'\\x42' * 65536, 0)),"
                " ('truncate', lambda: os.ftruncate(fd, 0))):\n"
                "    try:\n        act(); print(what, 'DONE')\n"
                "    except OSError as e:\n        print(what, 'refused', e.errno)\n"
            )
            done = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=60)
            attempts.append({"target": target, "stdout": done.stdout.strip(), "stderr": done.stderr[-300:]})
    record("other_process", attempts=attempts, worst=judge.worst(call, results))


def case_shm_emptied(generator: Any, judge: Judge) -> None:
    """Everything in /dev/shm removed between calls (``rm /dev/shm/*``, systemd-logind's RemoveIPC, tmp cleaners)."""
    outcomes = []
    for i in range(3):
        removed = 0
        for name in os.listdir("/dev/shm"):
            try:
                os.unlink(os.path.join("/dev/shm", name))
                removed += 1
            except OSError:
                pass
        outcomes.append({"removed": removed, **calls_and_judge(generator, judge, [prompts(200 + i, 6, 200)], False)})
    record("shm_emptied", outcomes=outcomes)


def case_shm_read_only(generator: Any, judge: Judge) -> None:
    """/dev/shm turned read-only after start (a read-only tmpfs mounted over it)."""
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", "/dev/shm"], capture_output=True)
    if done.returncode != 0:
        record("shm_read_only", skipped=done.stderr.decode()[-300:])
        return
    writable = os.access("/dev/shm", os.W_OK) and _can_create("/dev/shm")
    found = calls_and_judge(generator, judge, [prompts(300 + i, 6, 200) for i in range(3)], keep=False)
    record("shm_read_only", can_create=writable, **found)


def interrupted_calls(generator: Any, judge: Judge, interrupts: int = 8, later: int = 6) -> dict[str, Any]:
    """``interrupts`` calls each interrupted by a SIGINT to this process (Ctrl-C at the caller) at a point spread over
    the call, then ``later`` calls judged against transformers. generate() runs in the main thread, where Python
    raises KeyboardInterrupt."""
    sizes = (12, 400)  # 4800 tokens a call: several steps in flight on the CPU engine
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, even where a parent ignored SIGINT
    generator.generate(prompts(399, *sizes))  # a warm-up: the first call of a generator is slower
    started = time.monotonic()
    generator.generate(prompts(400, *sizes))
    length = max(time.monotonic() - started, 0.05)
    landed: list[str] = []
    attempt = 0
    while landed.count("interrupted") < interrupts and attempt < 4 * interrupts:
        fraction = 0.05 + 0.9 * ((attempt * 0.37) % 1.0)  # spread over the call: add, reset, steps, collect
        attempt += 1
        timer = threading.Timer(length * fraction, os.kill, (os.getpid(), signal.SIGINT))
        in_call = False
        try:
            try:
                timer.start()
                in_call, started = True, time.monotonic()
                generator.generate(prompts(410 + attempt, *sizes))
                in_call = False
                length = max(min(length, time.monotonic() - started), 0.05)  # aim within the calls as they are now
                landed.append("finished first")
            except KeyboardInterrupt:
                landed.append("interrupted" if in_call else "after the call")
            except Exception as exc:
                landed.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            finally:
                timer.cancel()
                timer.join()
            time.sleep(0.05)  # a SIGINT still on its way lands here, not in the next call
        except KeyboardInterrupt:
            landed.append("after the call")
    outcomes = []
    for i in range(later):
        call = prompts(500 + i, 3 + i, 64 + 40 * i)
        box = in_thread(lambda call=call: generator.generate(call))
        if "value" in box:
            try:
                outcome = {"worst": judge.worst(call, box["value"])}
            except AssertionError as exc:
                outcome = {"error": f"AssertionError: {exc}"}
        else:
            outcome = {k: box[k] for k in ("error", "hang") if k in box}
        outcome["passed"] = outcome.get("worst", 1.0) < 1e-4
        outcomes.append(outcome)
    return {
        "call_seconds": round(length, 3),
        "interrupted": landed.count("interrupted"),
        "landed": landed,
        "later": outcomes,
        "later_passed": sum(o["passed"] for o in outcomes),
    }


def case_interrupted(generator: Any, judge: Judge) -> None:
    """Ctrl-C at the caller during generate(), eight times; then calls judged against transformers."""
    record("interrupted", **interrupted_calls(generator, judge))


def case_interrupted_one_step(model: str, judge: Judge) -> None:
    """The same with one engine step at a time (VLLM_COMPAT_STEPS_IN_FLIGHT=1): a generator of its own."""
    os.environ["VLLM_COMPAT_STEPS_IN_FLIGHT"] = "1"
    try:
        generator = make_generator(model)
    finally:
        del os.environ["VLLM_COMPAT_STEPS_IN_FLIGHT"]
    try:
        steps = getattr(generator.executor, "_vllm_compat_steps", None)
        depth = steps.depth if steps else 1
        record("interrupted_one_step", steps_in_flight=depth, **interrupted_calls(generator, judge))
    finally:
        generator.executor.shutdown()


def case_generations(model: str, count: int) -> None:
    """``count`` generators made, used once and shut down in turn: this process's descriptors and connections after
    each (a loop that makes a generator per dataset shard)."""
    import gc

    from vllm_compat import transport

    fds, conns = [], []
    for i in range(count):
        generator = make_generator(model)
        generator.generate(prompts(600 + i, 2, 32))
        generator.executor.shutdown()
        del generator
        gc.collect()
        fds.append(len(os.listdir("/proc/self/fd")))
        receiver = transport.wire.current_receiver()
        conns.append(len(receiver.conns) if receiver else 0)
    record("generations", count=count, fds=fds, conns=conns)


def make_generator(model: str) -> Any:
    from speculators.data_generation import vllm_hidden_states_generator as gen_module

    return gen_module.VllmHiddenStatesGenerator(model_path=model, layer_ids=LAYERS, max_model_len=2048)


def _can_create(folder: str) -> bool:
    try:
        fd = os.open(os.path.join(folder, "probe"), os.O_CREAT | os.O_WRONLY)
    except OSError:
        return False
    os.close(fd)
    os.unlink(os.path.join(folder, "probe"))
    return True


def _worker_pids() -> list[int]:
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me:
            found.append(int(name))
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hold-bytes", type=int, default=320 << 20, help="bytes of results the hold case keeps")
    parser.add_argument("--cases", default="hold,threads,other_process,interrupted,shm_emptied,shm_read_only")
    parser.add_argument("--generations", type=int, default=4, help="generators the generations case makes in turn")
    args = parser.parse_args()
    import vllm_compat  # first, as in a user's script

    RECORD["shm_size"] = os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize
    RECORD["vllm_compat_installed"] = vllm_compat.status()["installed"]
    from speculators.data_generation import vllm_hidden_states_generator as gen_module

    original = gen_module.ModelConfig

    def float32(*a: Any, **kw: Any) -> Any:
        kw["dtype"] = "float32"  # a test-harness choice: compare with transformers at 1e-4
        return original(*a, **kw)

    gen_module.ModelConfig = float32
    generator = make_generator(args.model)
    RECORD["shm_used_after_start"] = shm_used()
    judge = Judge(args.model)
    try:
        cases = {
            "hold": lambda: case_hold(generator, judge, args.hold_bytes),
            "threads": lambda: case_threads(generator, judge),
            "other_process": lambda: case_other_process(generator, judge),
            "shm_emptied": lambda: case_shm_emptied(generator, judge),
            "shm_read_only": lambda: case_shm_read_only(generator, judge),
            "interrupted": lambda: case_interrupted(generator, judge),
            "interrupted_one_step": lambda: case_interrupted_one_step(args.model, judge),
            "generations": lambda: case_generations(args.model, args.generations),
        }
        for name in args.cases.split(","):
            cases[name]()
            with open(args.out, "w") as f:
                json.dump(RECORD, f, indent=1)
    finally:
        with open(args.out, "w") as f:
            json.dump(RECORD, f, indent=1)
        generator.executor.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
