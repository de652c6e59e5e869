"""Tiny random bfloat16 checkpoints of the model families, and how transformers runs each one (the reference).

The configurations are tests/e2e/tiny_families.py's (the same shapes: DeepSeek-V3's MLA keeps the 512 + 64 latent
that vLLM's MLA kernels are built for, with R1's 128/64/128 head split), written in bfloat16 so that vLLM's
``dtype="auto"`` runs them in bfloat16 as it would a real checkpoint. Variants:

- ``deepseek_v3``: every layer dense (``first_k_dense_replace = num_hidden_layers``): MLA without the fused MoE
  kernels (``vllm._moe_C``), which a stripped vLLM install may lack; ``deepseek_v3_moe``: layer 0 dense, the others
  a routed MoE (tiny_families.py's configuration).
- ``kimi_k25``: ``model_type: kimi_k25`` (vLLM reads it with its own ``KimiK25Config``) wrapping the
  ``deepseek_v3`` text model, the same weights under ``language_model.``; a vision config but no vision weights
  (vLLM is run with ``language_model_only``). The real checkpoint ships remote code that the folder needs even for
  text: ``AutoConfig`` (speculators 0.3.0 reads the layer count with it) and ``AutoImageProcessor`` (vLLM's
  Kimi-K2.5 processing info loads it whenever the model runner asks whether the model takes multimodal input);
  small local stand-ins take their place (``trust_remote_code=True`` is speculators' own setting; no hub).
  transformers has no Kimi-K2.5 class: its reference is the DeepSeek-V3 language model on the same weights
  (the ``<folder>-text`` checkpoint built beside it).
- ``qwen3_vl``: transformers' ``Qwen3VLForConditionalGeneration`` around the tiny Qwen3 text model (a one-block
  vision tower is saved too; vLLM is run with ``language_model_only``); the reference is that class's forward on
  text-only input ids (its M-RoPE then rotates as plain RoPE).
- ``gpt_oss``, ``qwen3``: tiny_families.py's configurations.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tests.e2e.tiny_families import _CONFIGS, MAX_POSITIONS
from tests.e2e.tiny_model import TINY_VOCAB_SIZE, _build_tokenizer

__all__ = ["TOKEN_RANGE", "build", "decoder_layers", "reference_dir"]

# Prompt token ids: clear of the special tokens (0-3) and of the ids the multimodal configs reserve (508-511)
TOKEN_RANGE = (4, 500)
_MM_TOKENS = {"image_token_id": 508, "video_token_id": 509, "vision_start_token_id": 510, "vision_end_token_id": 511}


def _spread(model: Any) -> None:
    """tests/e2e/tiny_families.py's initialisation: std 0.1 for matrices; norms, biases and routers as created."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1 and "gate.weight" not in name and "router" not in name:
                param.normal_(mean=0.0, std=0.1)


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
    _spread(model)
    return _save(model, tokenizer, out)


_KIMI_CONFIG_PY = '''"""Stand-in for Kimi-K2.5's configuration remote code (text model and layer count only)."""
from transformers import DeepseekV3Config, PretrainedConfig


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"

    def __init__(self, text_config=None, vision_config=None, **kwargs):
        if not isinstance(text_config, PretrainedConfig):
            text_config = DeepseekV3Config(**(text_config or {}))
        self.text_config = text_config
        self.vision_config = vision_config or {}
        super().__init__(**kwargs)
'''

_KIMI_IMAGE_PROCESSOR_PY = '''"""Stand-in for Kimi-K2.5's image processor remote code (text prompts only)."""
from transformers.image_processing_utils import BaseImageProcessor


class KimiK25ImageProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, num_frames_per_chunk=4, **kwargs):
        super().__init__(**kwargs)
        self.num_frames_per_chunk = num_frames_per_chunk

    def media_tokens_calculator(self, media):
        return 1

    def preprocess(self, *args, **kwargs):
        raise NotImplementedError("text-only stand-in: no images")
'''


def _kimi_k25(out: Path, num_layers: int, seed: int) -> Path:
    """vLLM's Kimi-K2.5 layout around the dense DeepSeek-V3 checkpoint built next to it."""
    from safetensors.torch import load_file, save_file

    text = _causal_lm("deepseek_v3", reference_dir("kimi_k25", out), num_layers, seed, dense=True)
    out.mkdir(parents=True, exist_ok=True)
    text_config = json.loads((text / "config.json").read_text())
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
        "text_config": text_config,
        "vision_config": {  # never built (language_model_only); small in case a release reads its sizes
            "patch_size": 14,
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "hidden_size": 64,
            "intermediate_size": 128,
            "mm_hidden_size": 64,
        },
        "media_placeholder_token_id": _MM_TOKENS["image_token_id"],
        "pad_token_id": text_config.get("pad_token_id", 0),
        "bos_token_id": text_config.get("bos_token_id"),
        "eos_token_id": text_config.get("eos_token_id"),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "configuration_kimi_k25.py").write_text(_KIMI_CONFIG_PY)
    (out / "image_processing_kimi_k25.py").write_text(_KIMI_IMAGE_PROCESSOR_PY)
    processor = {
        "auto_map": {"AutoImageProcessor": "image_processing_kimi_k25.KimiK25ImageProcessor"},
        "image_processor_type": "KimiK25ImageProcessor",
        "num_frames_per_chunk": 4,
        # what vLLM's own Kimi-K2.5 vision processor (later releases, which use it instead) reads at construction
        "media_proc_cfg": {
            "patch_size": 14,
            "merge_kernel_size": [2, 2],
            "temporal_merge_kernel_size": 4,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
    }
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    weights = load_file(text / "model.safetensors")
    save_file({f"language_model.{name}": t for name, t in weights.items()}, out / "model.safetensors", {"format": "pt"})
    for path in text.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(path, out / path.name)
    return out


def _qwen3_vl(out: Path, num_layers: int, seed: int) -> Path:
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = _build_tokenizer(TINY_VOCAB_SIZE, MAX_POSITIONS)
    text = _CONFIGS["qwen3"](tokenizer, num_layers).to_dict()
    head_dim = text["head_dim"]
    sections = [head_dim // 4, head_dim // 8, head_dim // 8]  # M-RoPE (t, h, w), half the head dim in all
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections, "mrope_interleaved": True}
    text.update(rope_parameters=rope, rope_scaling=rope)
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": text["hidden_size"],
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0],
    }
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **_MM_TOKENS)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).to(torch.float32).eval()
    _spread(model)
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


def reference_dir(family: str, model: Path) -> Path:
    """The folder transformers loads for the reference: the checkpoint itself, or Kimi-K2.5's text model."""
    return model.parent / f"{model.name}-text" if family == "kimi_k25" else model


def decoder_layers(family: str, model: Any) -> Any:
    """transformers' decoder layers (the modules whose outputs vLLM's captured states are compared with)."""
    if family == "qwen3_vl":
        return model.model.language_model.layers
    return model.model.layers
