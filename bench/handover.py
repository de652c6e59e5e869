"""The hand-over of one call's states from a worker process to the caller, side by side (CPU or GPU).

Two processes, as in vLLM: a worker that runs a call's steps (a busy GPU kernel, or a sleep on the CPU, of
``--step-ms`` each, standing in for the forward) and captures ``--layers`` states of every step's tokens, and the
caller that receives them and copies each state as speculators 0.4.0.1 does (``h.clone().cpu()``). Sides, each a
whole call timed in the caller, from asking for it to the last state copied:

- ``steps``: the steps alone, nothing captured or handed over: the floor.
- ``rpc``: what speculators does without vllm-compat: every step's captures kept, grouped per request at the end,
  moved to the host, pickled through a pipe (vLLM's message queue carries the same bytes), unpickled and copied.
- ``transport``: vllm-compat's hand-over: each step's rows copied to their place in a pinned slab while the next
  steps run, the slab's descriptor passed over a socket, the caller maps it and each ``clone()`` maps that state's
  bytes again (no copy).
- ``transport-copy``: the same with ``VLLM_COMPAT_STATES=copy`` (ordinary memory, copied by a few threads).

Beside them, ``d2h``: a plain copy of the call's bytes from the device into host memory already mapped and pinned
(on the CPU: into memory already mapped), measured in the worker: the bus's speed, what the goal is held against
(a call's hand-over costs at most 2x that, or is hidden behind the steps). Printed: seconds per call (median of
``--calls``) and each side's cost over ``steps``, all from one run, and what ``torch.save`` of one sample writes.

    python bench/handover.py                                 # 32 x 1024 tokens x 4 layers x 2048 hidden, bf16
    python bench/handover.py --tokens 256 --hidden 1024 --calls 5 --steps 2 --step-ms 20   # quicker, on a CPU
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import statistics
import subprocess
import sys
import textwrap
import time

WORKER = textwrap.dedent(
    """
    import json, os, pickle, sys, time, torch
    from vllm_compat import capture, transport
    from vllm_compat.adapters.transfer import hand_over_slab
    seqs, tokens, layers, hidden, steps, step_ms = map(float, sys.argv[1:7])
    seqs, tokens, layers, hidden, steps = map(int, (seqs, tokens, layers, hidden, steps))
    cuda = torch.cuda.is_available() and sys.argv[7] != "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    capture.HAND_OVER = hand_over_slab
    plan = [(f"req_0_{i}", tokens) for i in range(seqs)]
    per_step = -(-seqs // steps)
    g = torch.Generator().manual_seed(0)
    source = [torch.randn(per_step * tokens, hidden, generator=g).to(torch.bfloat16).to(device) for _ in range(layers)]
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); torch.cuda._sleep(1_000_000); end.record(); end.synchronize()
        cycles_per_ms = 1_000_000 / start.elapsed_time(end)
    def forward():
        if cuda:
            torch.cuda._sleep(int(step_ms * cycles_per_ms))
        else:
            time.sleep(step_ms / 1000)
        return [h.clone() for h in source]  # fresh captures, as speculators' forward makes them
    def sync():
        if cuda:
            torch.cuda.synchronize()
    nbytes = seqs * tokens * layers * hidden * 2
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    out = sys.stdout.buffer
    for line in sys.stdin:
        side = line.strip()
        stats = {}
        if side == "d2h":
            sync(); t = time.perf_counter(); host.view(torch.bfloat16).copy_(flat, non_blocking=True); sync()
            reply = None; stats["seconds"] = time.perf_counter() - t
        else:
            call = capture.CallCapture(plan, "0.4.0.1") if side.startswith("transport") else None
            kept = []
            for s in range(steps):
                rows = plan[s * per_step:(s + 1) * per_step]
                aux = forward()
                if call is not None:
                    call.store(aux, rows)
                elif side == "rpc":
                    kept.append((aux, rows))
            sync()
            t = time.perf_counter()
            if call is not None:
                reply = capture.hand_over(call)
                stats = transport.worker_stats()
            elif side == "rpc":
                reply = {}
                for aux, rows in kept:
                    for i, (rid, n) in enumerate(rows):
                        reply[rid] = [h[i * n:(i + 1) * n].clone().cpu() for h in aux]
            else:
                reply = None
            stats["exposed_seconds"] = time.perf_counter() - t
        data = pickle.dumps((reply, stats), protocol=pickle.HIGHEST_PROTOCOL)
        out.write(len(data).to_bytes(8, "little") + data)
        out.flush()
    """
)

SIDES = ("steps", "rpc", "transport", "transport-copy", "d2h")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4, help="steps per call (the call's sequences split evenly)")
    parser.add_argument("--step-ms", type=float, default=38.0, help="each step's stand-in forward")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--device", default="auto", help="auto (cuda if present) or cpu")
    parser.add_argument("--json", type=str, default=None, help="also write the numbers here")
    args = parser.parse_args()

    from vllm_compat import transport

    env = {**os.environ, transport.ENV_SOCKET: transport.receiver_address() or ""}
    argv = [str(v) for v in (args.seqs, args.tokens, args.layers, args.hidden, args.steps, args.step_ms, args.device)]
    worker = subprocess.Popen(  # run outside the checkout: its vllm_compat/ folder would shadow the installed one
        [sys.executable, "-c", WORKER, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd="/"
    )
    nbytes = args.seqs * args.tokens * args.layers * args.hidden * 2
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    worker_side: dict[str, list[dict]] = {side: [] for side in SIDES}
    sample = None
    try:
        for side in SIDES:
            if side == "transport-copy":
                os.environ[transport.ENV_MODE] = "copy"
            for _ in range(args.calls + 1):  # the first call of each side warms it up (slab, pool, caches)
                start = time.perf_counter()
                reply, stats = _ask(worker, side)
                if isinstance(reply, dict):
                    samples = [[h.clone().cpu() for h in reply[rid]] for rid in reply]
                    sample = samples[0]
                    del reply, samples
                seconds[side].append(time.perf_counter() - start)
                worker_side[side].append(stats)
            os.environ.pop(transport.ENV_MODE, None)
            seconds[side] = seconds[side][1:]
            worker_side[side] = worker_side[side][1:]
    finally:
        worker.stdin.close()
        worker.wait(timeout=60)
    median = {side: statistics.median(v) for side, v in seconds.items()}
    exposed = {side: statistics.median(s.get("exposed_seconds", 0.0) for s in worker_side[side]) for side in SIDES}
    d2h = statistics.median(s["seconds"] for s in worker_side["d2h"])
    print(
        f"one call: {args.seqs} x {args.tokens} tokens x {args.layers} layers x {args.hidden} hidden, bf16 = "
        f"{nbytes / 2**20:.0f} MiB in {args.steps} steps of {args.step_ms:g} ms; median of {args.calls} calls"
    )
    print(f"d2h (the call's bytes into mapped, pinned host memory): {d2h * 1e3:.1f} ms, {nbytes / d2h / 1e9:.1f} GB/s")
    print("| side | s per call | over steps | worker's exposed hand-over | exposed / d2h |")
    print("|---|---|---|---|---|")
    for side in ("steps", "rpc", "transport", "transport-copy"):
        over = median[side] - median["steps"]
        print(
            f"| {side} | {median[side]:.4f} | {over * 1e3:+.1f} ms | {exposed[side] * 1e3:.1f} ms | "
            f"{exposed[side] / d2h:.2f}x |"
        )
    saved = None
    if sample is not None:
        buf = io.BytesIO()
        import torch

        torch.save({"hidden_states": sample}, buf)
        own = sum(h.numel() * h.element_size() for h in sample)
        saved = len(buf.getvalue()) / own
        print(f"torch.save of one sample writes {saved:.3f}x its bytes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "seconds": seconds,
                    "worker": worker_side,
                    "d2h_seconds": d2h,
                    "saved_ratio": saved,
                },
                f,
                indent=1,
            )
    return 0


def _ask(worker: subprocess.Popen, side: str) -> tuple:
    worker.stdin.write(side.encode() + b"\n")
    worker.stdin.flush()
    size = int.from_bytes(worker.stdout.read(8), "little")
    return pickle.loads(worker.stdout.read(size))


if __name__ == "__main__":
    sys.exit(main())
