"""The hand-over of one call's states from a worker process to the caller, side by side, on the CPU.

Two processes, as in vLLM: a worker that holds a call's captured states (speculators 0.4.0.1's reply: a dict of
per-request lists of per-layer tensors) and the generator's process that receives them and copies each state as
speculators does (``h.clone().cpu()``). Sides, each timed from the worker's reply to the last copied state:

- ``rpc``: what speculators does without vllm-compat: the reply pickled with torch's pickler through a pipe (vLLM's
  message queue carries the same bytes), unpickled, then copied.
- ``shm``: vllm-compat's transport: the worker writes a fresh /dev/shm file, the caller maps it privately and each
  ``clone()`` maps that state's bytes again (no copy).
- ``shm+copy``: the same, with a real copy of every state in place of the private mapping (what ordinary clones
  cost on top of the transport).

Printed: seconds per call (median of ``--calls``), GB/s over the states' bytes, and the ratios rpc/shm and
(shm+copy)/shm, all from one run; then what a ``torch.save`` of one sample writes against that sample's bytes.

    python bench/handover.py                          # 32 sequences x 1024 tokens x 4 layers x 2048 hidden, bf16
    python bench/handover.py --tokens 256 --hidden 1024 --calls 5
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import statistics
import subprocess
import sys
import textwrap
import time

WORKER = textwrap.dedent(
    """
    import os, pickle, sys, torch
    from vllm_compat.adapters.transfer import pack
    seqs, tokens, layers, hidden = map(int, sys.argv[1:5])
    g = torch.Generator().manual_seed(0)
    captured = [torch.randn(seqs * tokens, hidden, generator=g).to(torch.bfloat16) for _ in range(layers)]
    states = {f"req_0_{i}": [h[i * tokens:(i + 1) * tokens].clone() for h in captured] for i in range(seqs)}
    out = sys.stdout.buffer
    for line in sys.stdin:
        side = line.strip()
        reply = states if side == "rpc" else pack(states)
        data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        out.write(len(data).to_bytes(8, "little") + data)
        out.flush()
    """
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()

    import torch

    nbytes = args.seqs * args.tokens * args.layers * args.hidden * 2
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, *map(str, (args.seqs, args.tokens, args.layers, args.hidden))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=os.path.dirname(os.path.abspath(__file__)),  # not the checkout's root: the installed vllm_compat
    )

    def receive(side: str):
        worker.stdin.write(f"{side}\n".encode())
        worker.stdin.flush()
        started = time.perf_counter()
        size = int.from_bytes(worker.stdout.read(8), "little")
        data = worker.stdout.read(size)
        return started, pickle.loads(data)

    def copy(reply, real: bool):
        if real:
            return {k: [h.as_subclass(torch.Tensor).clone() for h in v] for k, v in reply.items()}
        return {k: [h.clone().cpu() for h in v] for k, v in reply.items()}

    seconds: dict[str, list[float]] = {"rpc": [], "shm": [], "shm+copy": []}
    sample_ratio = 0.0
    for i in range(args.calls + 1):  # the first round warms up
        for side in seconds:
            started, reply = receive("rpc" if side == "rpc" else "shm")
            states = copy(reply, real=side != "shm")
            del reply
            elapsed = time.perf_counter() - started
            if i:
                seconds[side].append(elapsed)
            if side == "shm" and i == 1:
                buf = io.BytesIO()
                sample = states["req_0_0"]
                torch.save({"hidden_states": sample}, buf)
                sample_ratio = len(buf.getvalue()) / sum(h.numel() * h.element_size() for h in sample)
            del states
    worker.stdin.close()
    worker.wait()

    print(
        f"states per call: {args.seqs} x {args.tokens} tokens x {args.layers} layers x {args.hidden} hidden, bf16 = "
        f"{nbytes / 2**20:.0f} MiB; {args.calls} timed calls per side, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs"
    )
    print("| side | median s per call | GB/s |")
    print("|---|---|---|")
    medians = {side: statistics.median(values) for side, values in seconds.items()}
    for side, median in medians.items():
        print(f"| {side} | {median:.4f} | {nbytes / 1e9 / median:.2f} |")
    print(f"ratio_rpc_vs_shm: {medians['rpc'] / medians['shm']:.2f}")
    print(f"ratio_shm_copy_vs_shm: {medians['shm+copy'] / medians['shm']:.2f}")
    print(f"torch.save of one sample / its bytes: {sample_ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
