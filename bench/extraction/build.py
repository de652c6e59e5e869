"""The ``build`` side: the random Llama, and the states check's references, once per model and prompts.

The references are transformers' forward of the checked sequences (``config.check_positions`` of the checked call)
on the model's own weights, first in the model's dtype (bf16: what transformers users get), then the same weights
cast to float32 (TF32 off): the float32 forward is what both bf16 paths are measured against. Forward hooks on the
decoder layers keep each checked layer's output. They are computed on the device the model runs on, here, before
any vLLM side starts (on an H200 a float32 forward of a few 8B-class sequences takes seconds), and kept next to the
model (``reference-KEY.pt``), so a rerun on the same model and prompts reuses them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

from .common import ROOT, load_project_file, log, prompt_calls
from .config import check_call, check_positions, checked_layers


def side_build(args: argparse.Namespace, out: Path, extra: dict) -> dict:
    shape = build_model(args, out)
    if not args.no_check:
        shape["reference"] = reference(args, out, shape)
    return shape


def build_model(args: argparse.Namespace, out: Path) -> dict:
    build_random_llama = load_project_file(ROOT / "tests" / "gpu" / "random_llama.py").build_random_llama

    wanted = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "vocab")}
    intermediate = args.intermediate or None  # None: the builder's default, 11/4 x hidden
    shape_file = Path(args.model_dir) / "shape.json"
    if shape_file.exists():
        shape = json.loads(shape_file.read_text())
        same = all(shape.get(k) == v for k, v in wanted.items()) and shape.get("dtype") == args.dtype
        if same and shape.get("intermediate") == (intermediate or 11 * args.hidden // 4):
            log(out, "build", f"reusing {args.model_dir}")
            return shape
    t0 = time.perf_counter()
    shape = build_random_llama(
        args.model_dir, **wanted, intermediate=intermediate, dtype=args.dtype, device=args.device, std=0.02
    )
    log(out, "build", f"built {shape['params'] / 1e6:.0f}M params on {args.device} in {time.perf_counter() - t0:.1f}s")
    return shape


def reference_key(args: argparse.Namespace, ids: list[list[int]], layers: list[int]) -> str:
    import torch
    import transformers

    what = [ids, layers, args.dtype, args.device, torch.__version__, transformers.__version__]
    return hashlib.sha1(json.dumps(what).encode()).hexdigest()[:12]


def reference(args: argparse.Namespace, out: Path, shape: dict) -> dict:
    """Compute (or reuse) the references; return where they are and how they were made."""
    import torch

    positions = check_positions(args)
    call = prompt_calls(args)[check_call(args)]
    ids = [call[p] for p in positions]
    layers = checked_layers(args, shape["layers"])
    path = Path(args.model_dir) / f"reference-{reference_key(args, ids, layers)}.pt"
    if path.exists():
        log(out, "build", f"reusing the references {path.name}")
        return {"path": str(path), **torch.load(path, weights_only=False)["info"]}
    t0 = time.perf_counter()
    states, info = forward_states(args, ids, layers)
    info |= {"positions": positions, "layers": layers, "seconds": round(time.perf_counter() - t0, 2)}
    torch.save({"ids": ids, "states": states, "info": info}, path)
    log(out, "build", f"references for sequences {positions}, layers {layers}: {info['seconds']}s ({info})")
    return {"path": str(path), **info}


def forward_states(args: argparse.Namespace, ids: list[list[int]], layers: list[int]) -> tuple[dict, dict]:
    """``{precision: [[layer output per layer] per sequence]}`` for the model's dtype and float32."""
    import torch
    import transformers
    from packaging.version import Version

    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    model = load_model(args.model_dir, {key: getattr(torch, args.dtype)}, args.device)
    captured: dict[int, torch.Tensor] = {}
    for layer in layers:
        model.model.layers[layer].register_forward_hook(
            lambda _m, _i, output, layer=layer: captured.__setitem__(
                layer, (output[0] if isinstance(output, tuple) else output)[0].detach().to("cpu", copy=True)
            )
        )

    def run(model) -> list[list[torch.Tensor]]:
        got = []
        with torch.no_grad():
            for seq in ids:
                captured.clear()
                model(torch.tensor([seq], device=args.device), logits_to_keep=1)
                got.append([captured[layer] for layer in layers])
        return got

    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    states = {args.dtype: run(model)}
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        model.float()  # the same weights, every operation in float32
        states["float32"] = run(model)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    info = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "device": args.device,
        "attn_implementation": model.config._attn_implementation,
        "precisions": list(states),
        "tf32_in_float32": False,
    }
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return states, info


def load_model(path: str, kwargs: dict, device: str):
    """transformers' model straight onto ``device`` where it can (an 8B-class model need not pass through host
    memory), else loaded on the CPU and moved."""
    from transformers import AutoModelForCausalLM

    if device != "cpu":
        try:
            return AutoModelForCausalLM.from_pretrained(path, device_map=device, **kwargs).eval()
        except Exception as exc:  # e.g. transformers releases whose device_map needs accelerate
            print(
                f"[bench] loading onto {device} directly: {type(exc).__name__}: {exc}; loading on the CPU", flush=True
            )
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device).eval()
