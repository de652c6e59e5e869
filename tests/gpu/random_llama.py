"""Build a randomly initialised Llama checkpoint, on the device it will run on, that loads fully offline.

Used by the GPU end-to-end tests (a small model) and by ``bench/extraction_throughput.py`` (a 1B-class one:
hidden 2048, 16 layers, vocabulary 32000). The weights are drawn on ``device`` (a CUDA device builds a 1B-class
model in seconds), cast to ``dtype`` and written as safetensors next to ``config.json`` and a word-level fast
tokenizer, so that transformers and vLLM both load the folder by path with no hub access.

    python -m tests.gpu.random_llama OUT_DIR [--hidden 2048 --layers 16 --vocab 32000 --device cuda]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["build_random_llama", "count_params"]


def _tokenizer(vocab_size: int, max_length: int):  # -> transformers.PreTrainedTokenizerFast
    """A word-level tokenizer with exactly ``vocab_size`` ids (0-3: unk, bos, eos, pad; then w0, w1, ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(("<unk>", "<s>", "</s>", "<pad>"))}
    for i in range(vocab_size - len(vocab)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=max_length,
    )


def build_random_llama(
    path: str | Path,
    *,
    hidden: int = 1024,
    layers: int = 4,
    heads: int = 8,
    kv_heads: int = 4,
    intermediate: int | None = None,
    vocab: int = 4096,
    max_positions: int = 4096,
    dtype: str = "bfloat16",
    device: str = "cuda",
    std: float = 0.02,
    seed: int = 0,
) -> dict:
    """Write a random Llama to ``path``; return its shape and parameter counts (also saved as ``shape.json``).

    ``std`` is the weights' standard deviation. ``head_dim`` is ``hidden // heads`` (128 for both defaults
    used in this project, a size every vLLM attention backend supports).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(vocab, max_positions)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate or 11 * hidden // 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(mean=0.0, std=std)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    shape = {
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": hidden // heads,
        "intermediate": config.intermediate_size,
        "vocab": vocab,
        "dtype": dtype,
        **count_params(model),
    }
    (out / "shape.json").write_text(json.dumps(shape, indent=2))
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return shape


def count_params(model) -> dict:
    """Total parameters, and the ones a prefill token multiplies through (all but the embedding and LM head)."""
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    return {"params": total, "params_per_token": total - embed - head, "lm_head_params": head}


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--std", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = build_random_llama(
        args.out_dir,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        dtype=args.dtype,
        device=args.device,
        std=args.std,
        seed=args.seed,
    )
    print(json.dumps(shape))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
