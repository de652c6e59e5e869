"""Tiny random bfloat16 checkpoints of the model families, and how transformers runs each one (the reference).

The configurations are tests/e2e/tiny_families.py's (the same shapes: DeepSeek-V3's MLA keeps the 512 + 64 latent
that vLLM's MLA kernels are built for, with R1's 128/64/128 head split), written in bfloat16 so that vLLM's
``dtype="auto"`` runs them in bfloat16 as it would a real checkpoint. Variants:

- ``deepseek_v3``: every layer dense (``first_k_dense_replace = num_hidden_layers``): MLA without the fused MoE
  kernels (``vllm._moe_C``), which a stripped vLLM install may lack; ``deepseek_v3_moe``: layer 0 dense, the others
  a routed MoE (tiny_families.py's configuration).
- ``kimi_k25``: tests/e2e/tiny_families.py's Kimi-K2.5 wrapper (local stand-ins for its remote code) around the
  dense ``deepseek_v3`` text model, in bfloat16; its reference is the DeepSeek-V3 language model on the same weights
  (the ``<folder>-text`` checkpoint built beside it).
- ``qwen3_vl``: tests/e2e/tiny_families.py's Qwen3-VL (``Qwen3VLForConditionalGeneration`` around the tiny Qwen3
  text model, a one-block vision tower; vLLM is run with ``language_model_only``); the reference is that class's
  forward on text-only input ids (its M-RoPE then rotates as plain RoPE).
- ``gpt_oss``, ``qwen3``: tiny_families.py's configurations.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.e2e.tiny_families import (
    _CONFIGS,
    MAX_POSITIONS,
    TOKEN_RANGE,
    decoder_layers,
    qwen3_vl_config,
    reference_dir,
    spread_weights,
    wrap_kimi_k25,
)
from tests.e2e.tiny_model import TINY_VOCAB_SIZE, _build_tokenizer

__all__ = ["TOKEN_RANGE", "build", "decoder_layers", "reference_dir"]


def _save(model: Any, tokenizer: Any, out: Path) -> Path:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"  # what vLLM's dtype="auto" reads, either spelling
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _causal_lm(family: str, out: Path, num_layers: int, seed: int, *, dense: bool = False) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = _build_tokenizer(TINY_VOCAB_SIZE, MAX_POSITIONS)
    config = _CONFIGS[family](tokenizer, num_layers)
    if dense:
        config.first_k_dense_replace = num_layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    spread_weights(model)
    return _save(model, tokenizer, out)


def _kimi_k25(out: Path, num_layers: int, seed: int) -> Path:
    """vLLM's Kimi-K2.5 layout around the dense bfloat16 DeepSeek-V3 checkpoint built next to it."""
    text = _causal_lm("deepseek_v3", reference_dir("kimi_k25", out), num_layers, seed, dense=True)
    return wrap_kimi_k25(text, out)


def _qwen3_vl(out: Path, num_layers: int, seed: int) -> Path:
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    tokenizer = _build_tokenizer(TINY_VOCAB_SIZE, MAX_POSITIONS)
    config = qwen3_vl_config(tokenizer, num_layers)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).to(torch.float32).eval()
    spread_weights(model)
    return _save(model, tokenizer, out)


def build(family: str, out: str | Path, *, num_layers: int = 4, seed: int = 0) -> Path:
    """Write the tiny bfloat16 checkpoint of ``family`` (a key of tests/gpu/test_families.py's CASES) to ``out``."""
    out = Path(out)
    if family == "kimi_k25":
        return _kimi_k25(out, num_layers, seed)
    if family == "qwen3_vl":
        return _qwen3_vl(out, num_layers, seed)
    if family in ("deepseek_v3", "deepseek_v3_moe"):
        return _causal_lm("deepseek_v3", out, num_layers, seed, dense=family == "deepseek_v3")
    return _causal_lm(family, out, num_layers, seed)
