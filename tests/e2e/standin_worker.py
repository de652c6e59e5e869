"""A stand-in for a vLLM worker that captures states, for the hand-over tests (tests/e2e/test_transport.py).

It runs vllm-compat's own capture code (vllm_compat.capture) and hand-over (states-through-shared-memory) on captured
tensors it makes itself, step by step, exactly as per-request-capture calls them in a real worker, and writes each
call's pickled reply to a file for the test process to unpickle, as vLLM's executor does in the generator's process.
Commands arrive as JSON lines on stdin; each answer is one line on stdout, ``@@ `` then JSON (vLLM may log to stdout).

    {"op": "call", "plan": [[rid, n], ...], "steps": [[[rid, rows], ...], ...], "line": "0.4.0.1", "out": PATH,
     "layers": 3, "hidden": 8, "dtype": "bfloat16", "seed": 1, "fail_at_step": null}
    {"op": "slabs"}        -> {"slabs": N, "free": N, "busy": N, "pinned_bytes": N, "bytes": N, "sizes": [N, ...]}
    {"op": "prepare", "size": N} -> the slabs made ahead at setup, once they are made
    {"op": "wait_slabs", "at_most": N, "seconds": S} -> polls until it holds at most N slabs (or S pass): "slabs"
    {"op": "join_maker"}   -> waits for a slab being made by the thread; {"slabs": N}
    {"op": "wait_released", "count": N, "seconds": S} -> polls until the generator's process said it let go of N
                              hand-overs and the pool looked at them (or S pass): {"released": N}
    {"op": "fds"}          -> {"fds": [fd, ...]}: the descriptors of its slabs (another process may try them)
    {"op": "speculators", ...same as call...} -> speculators 0.4.0.1's own reply for the same steps, pickled to PATH

The captured rows of a request are ``states(seed, i, n, layers, hidden, dtype)``: request ``i`` of the plan, its
``n``-token prompt, a tensor per layer; rows past a prompt (decode tokens) are filled with a marker value that must
never reach a returned state.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time

DECODE_MARKER = -7.0


def states(seed: int, i: int, n: int, layers: int, hidden: int, dtype: str) -> list:
    import torch

    g = torch.Generator().manual_seed(seed * 100003 + i)
    return [torch.randn(n, hidden, generator=g).to(getattr(torch, dtype)) for _ in range(layers)]


def step_tensors(cmd: dict) -> list[tuple[list, list[tuple[str, int]]]]:
    """Each step's captured tensors (one per layer) and its rows, from the command's plan and steps."""
    import torch

    plan = [(rid, n) for rid, n in cmd["plan"]]
    index = {rid: i for i, (rid, _) in enumerate(plan)}
    full = {rid: states(cmd["seed"], index[rid], n, cmd["layers"], cmd["hidden"], cmd["dtype"]) for rid, n in plan}
    lengths = dict(plan)
    progress = dict.fromkeys(lengths, 0)
    out = []
    for step in cmd["steps"]:
        per_layer: list[list] = [[] for _ in range(cmd["layers"])]
        for rid, rows in step:
            if rid not in lengths:  # a request the call does not hold: rows of zeros
                for j in range(cmd["layers"]):
                    per_layer[j].append(torch.zeros(rows, cmd["hidden"], dtype=getattr(torch, cmd["dtype"])))
                continue
            done = progress[rid]
            take = max(0, min(rows, lengths[rid] - done))
            for j in range(cmd["layers"]):
                part = full[rid][j][done : done + take]
                extra = torch.full((rows - take, cmd["hidden"]), DECODE_MARKER, dtype=part.dtype)
                per_layer[j].append(torch.cat([part, extra]))
            progress[rid] = done + take
        aux = [torch.cat(parts) if parts else torch.empty(0, cmd["hidden"]) for parts in per_layer]
        out.append((aux, [(rid, rows) for rid, rows in step]))
    return out


def run_call(cmd: dict) -> dict:
    from vllm_compat import capture, transport

    call = capture.CallCapture(cmd["plan"], cmd["line"])
    try:
        for number, (aux, rows) in enumerate(step_tensors(cmd)):
            if cmd.get("fail_at_step") == number:
                aux = [h[:-1] for h in aux]  # one row short: the capture refuses the step
            call.store(aux, rows)
        reply = capture.hand_over(call)
    except Exception as exc:
        call.release()
        return {"error": f"{type(exc).__name__}: {exc}"}
    with open(cmd["out"] + ".tmp", "wb") as f:
        pickle.dump(reply, f)
    os.replace(cmd["out"] + ".tmp", cmd["out"])
    return {"ok": True, "stats": transport.worker_stats()}


def speculators_reply(cmd: dict) -> dict:
    """speculators 0.4.0.1's own ``_get_captured_states`` for the same steps (its metadata: prefill rows per request,
    in row order), past every wrapper."""
    import inspect
    import types

    from speculators.data_generation import custom_worker

    cls = custom_worker.HiddenStatesWorkerExtension
    if not hasattr(cls, "_set_request_metadata"):
        return {"skip": "speculators 0.3 returns per-layer tensors"}
    original = inspect.getattr_static(cls, "_get_captured_states")
    while hasattr(original, "__wrapped__"):
        original = original.__wrapped__
    lengths = dict((rid, n) for rid, n in cmd["plan"])
    progress = dict.fromkeys(lengths, 0)
    ext = types.SimpleNamespace(_captured_states=None, _request_metadata=[])
    for aux, rows in step_tensors(cmd):
        if ext._captured_states is None:
            ext._captured_states = [[h] for h in aux]
        else:
            for j, h in enumerate(aux):
                ext._captured_states[j].append(h)
        meta = []
        for rid, n in rows:
            take = max(0, min(n, lengths[rid] - progress[rid]))
            progress[rid] += n
            if take:
                meta.append((rid, take))
        ext._request_metadata.append(meta)
    reply = original(ext)
    with open(cmd["out"], "wb") as f:
        pickle.dump(reply, f)
    return {"ok": True}


def slabs_answer(pool) -> dict:
    slabs = list(pool.slabs)
    return {
        "slabs": len(slabs),
        "free": sum(s.is_free() for s in slabs),
        "busy": sum(s.busy for s in slabs),
        "pinned_bytes": pool.pinned_bytes(),
        "bytes": sum(s.size for s in slabs),
        "sizes": sorted(s.size for s in slabs),
    }


def main() -> None:
    import vllm_compat  # as in a worker: the adapters speculators' import needs

    vllm_compat.install()
    from vllm_compat.adapters.transfer import hand_over_slab

    from vllm_compat import capture

    capture.HAND_OVER = hand_over_slab  # what states-through-shared-memory sets in a worker
    from vllm_compat import transport

    released: list[int] = []
    transport.when_released(released.extend)  # after the pool's own: a serial here has been looked at by the pool
    print("@@", json.dumps({"pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "call":
            answer = run_call(cmd)
        elif cmd["op"] == "speculators":
            answer = speculators_reply(cmd)
        elif cmd["op"] == "slabs":
            answer = slabs_answer(capture.SLABS)
        elif cmd["op"] == "wait_slabs":  # the slabs closed by a thread (a release the caller said) are gone
            deadline = time.monotonic() + cmd["seconds"]
            while len(capture.SLABS.slabs) > cmd["at_most"] and time.monotonic() < deadline:
                time.sleep(0.01)
            for closer in capture.SLABS.closers:
                closer.join()
            answer = slabs_answer(capture.SLABS)
        elif cmd["op"] == "prepare":  # what per-request-capture does at setup (made ahead by a thread)
            capture.SLABS.prepare(cmd["size"], None)
            if capture.SLABS.maker is not None:
                capture.SLABS.maker.join()
            answer = {"slabs": len(capture.SLABS.slabs), "sizes": [s.size for s in capture.SLABS.slabs]}
        elif cmd["op"] == "join_maker":  # wait for a spare being made, so that the next call's stats are certain
            if capture.SLABS.maker is not None:
                capture.SLABS.maker.join()
            answer = {"slabs": len(capture.SLABS.slabs)}
        elif cmd["op"] == "wait_released":  # the caller's release messages arrive on the channel's own thread
            deadline = time.monotonic() + cmd["seconds"]
            while len(released) < cmd["count"] and time.monotonic() < deadline:
                time.sleep(0.005)
            answer = {"released": len(released)}
        elif cmd["op"] == "fds":
            answer = {"fds": [s.fd for s in capture.SLABS.slabs]}
        else:
            answer = {"error": f"unknown op {cmd['op']}"}
        print("@@", json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
