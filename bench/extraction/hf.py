"""The ``hf`` side: transformers' forward with ``output_hidden_states=True`` and ``logits_to_keep=1``.

Batched to the same token budget per forward as vLLM's step (``max_num_batched_tokens``), copying the same layers'
states to the CPU. The model is loaded once; every round of timed calls runs on it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .build import load_model
from .common import Partial, Rounds, log, memory_report, prompt_calls, reset_peak, tokens_of


def side_hf(args: argparse.Namespace, out: Path, extra: dict, partial: Partial) -> dict:
    import torch
    import transformers
    from packaging.version import Version

    name, layers = extra["name"], extra["layers"]
    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    model = load_model(args.model_dir, {key: getattr(torch, args.dtype)}, args.device)
    cuda = args.device == "cuda"
    batch = max(1, extra["max_num_batched_tokens"] // args.seq_len)
    result = partial.result
    result |= {
        "sequences_per_forward": batch,
        "transformers": transformers.__version__,
        "attn_implementation": model.config._attn_implementation,
        "warmup": [],
        "rounds": [],
    }

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def one_call(call: list[list[int]]) -> dict:
        sync()
        start = time.perf_counter()
        forward = 0.0
        delivered = []
        for b in range(0, len(call), batch):
            ids = torch.tensor(call[b : b + batch], device=args.device)
            f0 = time.perf_counter()
            output = model(ids, output_hidden_states=True, logits_to_keep=1)
            sync()
            forward += time.perf_counter() - f0
            on_cpu = [output.hidden_states[layer + 1].cpu() for layer in layers]
            delivered += [[h[j] for h in on_cpu] for j in range(ids.shape[0])]
        if len(delivered) != len(call):
            raise RuntimeError(f"{len(delivered)} sequences' states for {len(call)} prompts")
        return {"seconds": time.perf_counter() - start, "forward_seconds": forward}

    calls = prompt_calls(args)
    with torch.no_grad():
        for i in range(args.warmup_calls):
            result["warmup"].append(one_call(calls[i]))
        reset_peak()
        rounds = Rounds(extra.get("rounds", args.repeat), extra.get("deadline"))
        for r in rounds:
            done: list[dict] = []
            result["rounds"].append({"calls": done})
            for j, call in enumerate(calls[args.warmup_calls :]):
                done.append(one_call(call))
                partial.write()
                log(
                    out,
                    name,
                    f"round {r + 1} call {j}: {tokens_of(call)} tokens in {done[-1]['seconds']:.3f}s "
                    f"(forward {done[-1]['forward_seconds']:.3f}s)",
                )
        result["stopped"] = rounds.stopped
    result["memory"] = memory_report()
    return result
