"""Tiny, randomly initialised checkpoints of the model families vllm-compat probes (see probes/model.py).

Each builder writes a float32 safetensors checkpoint, ``config.json`` and the word-level tokenizer of
``tests.e2e.tiny_model`` to one folder, loadable offline by transformers and vLLM. The shapes are the smallest
vLLM's CPU build accepts (head sizes of 32 and up for its attention backends).

Usage::

    python -m tests.e2e.tiny_families FAMILY OUT_DIR [--num-layers 4] [--seed 0]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.e2e.tiny_model import TINY_VOCAB_SIZE, _build_tokenizer, build_tiny_llama

__all__ = ["BUILDERS", "build_tiny"]

MAX_POSITIONS = 4096  # at least speculators' default max_model_len (2048)


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


_CONFIGS: dict[str, Callable[[Any, int], Any]] = {
    "qwen3": _qwen3,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
}


def build_tiny(
    family: str, path: str | Path, *, num_layers: int = 4, seed: int = 0, overrides: dict[str, Any] | None = None
) -> Path:
    """Write a tiny random float32 checkpoint of ``family`` (a key of ``BUILDERS``) and its tokenizer to ``path``.

    ``overrides``: config attributes set on top of the family's (not for ``llama``).
    """
    if family == "llama":
        return build_tiny_llama(path, num_layers=num_layers, seed=seed)
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(TINY_VOCAB_SIZE, MAX_POSITIONS)
    config = _CONFIGS[family](tokenizer, num_layers)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    # Spread the weights a little more than the default init (std 0.02), so that each layer visibly changes the
    # residual stream; norms, biases and the MoE routers keep their initialisation.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1 and "gate.weight" not in name and "router" not in name:
                param.normal_(mean=0.0, std=0.1)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


BUILDERS = ("llama", *_CONFIGS)


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
