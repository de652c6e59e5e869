"""Tiny, randomly initialised checkpoints of the model families vllm-compat probes (see probes/model.py).

Each builder writes a float32 safetensors checkpoint, ``config.json`` and the word-level tokenizer of
``tests.e2e.tiny_model`` to one folder, loadable offline by transformers and vLLM. The shapes are the smallest
vLLM's CPU build accepts (head sizes of 32 and up for its attention backends).

Two multimodal wrappers (text weights and text prompts; also written in bfloat16 by tests/gpu/family_models.py):

- ``kimi_k25``: ``model_type: kimi_k25`` (vLLM reads it with its own ``KimiK25Config``) wrapping the
  ``deepseek_v3`` text model, the same weights under ``language_model.``; a vision config but no vision weights
  (vLLM is run with ``language_model_only``). The real checkpoint ships remote code that the folder needs even for
  text: ``AutoConfig`` (speculators 0.3.0 reads the layer count with it) and ``AutoImageProcessor`` (vLLM's
  Kimi-K2.5 processing info loads it whenever the model runner asks whether the model takes multimodal input);
  small local stand-ins take their place (``trust_remote_code=True`` is speculators' own setting; no hub).
  transformers has no Kimi-K2.5 class: its reference is the DeepSeek-V3 language model on the same weights
  (the ``<folder>-text`` checkpoint built beside it, ``reference_dir``).
- ``qwen3_vl``: transformers' ``Qwen3VLForConditionalGeneration`` around the tiny Qwen3 text model (a one-block
  vision tower is saved too; vLLM is run with ``language_model_only``); the reference is that class's forward on
  text-only input ids (its M-RoPE then rotates as plain RoPE).

Prompts for the wrappers keep clear of the token ids their configs reserve (``TOKEN_RANGE``).

Usage::

    python -m tests.e2e.tiny_families FAMILY OUT_DIR [--num-layers 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.e2e.tiny_model import TINY_VOCAB_SIZE, _build_tokenizer, build_tiny_llama

__all__ = ["BUILDERS", "TOKEN_RANGE", "build_tiny", "decoder_layers", "reference_dir", "wrap_kimi_k25"]

MAX_POSITIONS = 4096  # at least speculators' default max_model_len (2048)
# Prompt token ids: clear of the special tokens (0-3) and of the ids the multimodal configs reserve (508-511)
TOKEN_RANGE = (4, 500)
MM_TOKENS = {"image_token_id": 508, "video_token_id": 509, "vision_start_token_id": 510, "vision_end_token_id": 511}


def _common(tokenizer: Any, num_layers: int) -> dict[str, Any]:
    return {
        "num_hidden_layers": num_layers,
        "vocab_size": TINY_VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITIONS,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
    }


def _qwen3(tokenizer: Any, num_layers: int) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        **_common(tokenizer, num_layers),
    )


def _deepseek_v3(tokenizer: Any, num_layers: int) -> Any:
    """MLA attention (low-rank q and kv, split rope/nope heads) and a routed MoE after one dense layer."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=512,  # vLLM's float32 CPU MLA backend takes only a 576-wide latent cache: 512 + rope 64
        q_lora_rank=32,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        **_common(tokenizer, num_layers),
    )
    # What DeepSeek-V3's own config.json says and transformers implies: sigmoid scores, a correction bias (vLLM
    # creates ``e_score_correction_bias`` only for ``noaux_tc``)
    config.topk_method = "noaux_tc"
    config.scoring_func = "sigmoid"
    return config


def _gpt_oss(tokenizer: Any, num_layers: int) -> Any:
    """Alternating sliding-window and full attention (with sinks), a routed MoE in every layer."""
    from transformers import GptOssConfig

    return GptOssConfig(
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(num_layers)],
        **_common(tokenizer, num_layers),
    )


def qwen3_vl_config(tokenizer: Any, num_layers: int) -> Any:
    """The tiny Qwen3 text model inside Qwen3-VL (interleaved M-RoPE), with a one-block vision tower."""
    from transformers import Qwen3VLConfig

    text = _qwen3(tokenizer, num_layers).to_dict()
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
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **MM_TOKENS)


_CONFIGS: dict[str, Callable[[Any, int], Any]] = {
    "qwen3": _qwen3,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
}

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


def wrap_kimi_k25(text: Path, out: Path) -> Path:
    """vLLM's Kimi-K2.5 layout in ``out`` around the DeepSeek-V3 checkpoint in ``text`` (its weights and dtype)."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    text_config = json.loads((text / "config.json").read_text())
    dtype = text_config.get("dtype") or text_config.get("torch_dtype") or "float32"
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
        "media_placeholder_token_id": MM_TOKENS["image_token_id"],
        "pad_token_id": text_config.get("pad_token_id", 0),
        "bos_token_id": text_config.get("bos_token_id"),
        "eos_token_id": text_config.get("eos_token_id"),
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "dtype": dtype,
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


def reference_dir(family: str, model: Path) -> Path:
    """The folder transformers loads for the reference: the checkpoint itself, or Kimi-K2.5's text model."""
    return model.parent / f"{model.name}-text" if family == "kimi_k25" else model


def decoder_layers(family: str, model: Any) -> Any:
    """transformers' decoder layers (the modules whose outputs vLLM's captured states are compared with)."""
    if family == "qwen3_vl":
        return model.model.language_model.layers
    return model.model.layers


def spread_weights(model: Any) -> None:
    """Spread the weights a little more than the default init (std 0.02), so that each layer visibly changes the
    residual stream; norms, biases and the MoE routers keep their initialisation."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1 and "gate.weight" not in name and "router" not in name:
                param.normal_(mean=0.0, std=0.1)


def build_tiny(
    family: str, path: str | Path, *, num_layers: int = 4, seed: int = 0, overrides: dict[str, Any] | None = None
) -> Path:
    """Write a tiny random float32 checkpoint of ``family`` (a key of ``BUILDERS``) and its tokenizer to ``path``.

    ``overrides``: config attributes set on top of the family's (not for ``llama``; for ``kimi_k25``, on its
    DeepSeek-V3 text model).
    """
    if family == "llama":
        return build_tiny_llama(path, num_layers=num_layers, seed=seed)
    out = Path(path)
    if family == "kimi_k25":  # the deepseek_v3 checkpoint (MLA and MoE) beside it, wrapped
        text = build_tiny(
            "deepseek_v3", reference_dir(family, out), num_layers=num_layers, seed=seed, overrides=overrides
        )
        return wrap_kimi_k25(text, out)
    import torch

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(TINY_VOCAB_SIZE, MAX_POSITIONS)
    config = (qwen3_vl_config if family == "qwen3_vl" else _CONFIGS[family])(tokenizer, num_layers)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    if family == "qwen3_vl":
        from transformers import Qwen3VLForConditionalGeneration

        model = Qwen3VLForConditionalGeneration(config).to(torch.float32).eval()
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    spread_weights(model)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


BUILDERS = ("llama", *_CONFIGS, "kimi_k25", "qwen3_vl")


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=BUILDERS)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_tiny(args.family, args.out_dir, num_layers=args.num_layers, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
