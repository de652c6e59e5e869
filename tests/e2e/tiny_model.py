"""Build a tiny, randomly initialised Llama checkpoint that loads fully offline.

The checkpoint (float32 safetensors + ``config.json``) and a matching fast
tokenizer are written to one directory, so that ``AutoConfig``,
``AutoTokenizer`` and ``AutoModelForCausalLM`` as well as vLLM can load it by
path, with no hub access.

Usage::

    python -m tests.e2e.tiny_model OUT_DIR [--num-layers 4] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["TINY_VOCAB_SIZE", "build_tiny_llama"]

#: Vocabulary size shared by the model and its tokenizer.
TINY_VOCAB_SIZE = 512

_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")


def _build_tokenizer(vocab_size: int, max_length: int):  # -> transformers.PreTrainedTokenizerFast
    """Return a word-level fast tokenizer whose vocabulary has ``vocab_size`` ids.

    Ids 0-3 are ``<unk>``, ``<s>`` (bos), ``</s>`` (eos) and ``<pad>``; the rest
    are the words ``w0``, ``w1``, ... split on whitespace.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_SPECIAL_TOKENS)}
    for i in range(vocab_size - len(_SPECIAL_TOKENS)):
        vocab[f"w{i}"] = len(vocab)

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A",
        pair="<s> $A <s> $B",
        special_tokens=[("<s>", vocab["<s>"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=max_length,
        model_input_names=["input_ids", "attention_mask"],
    )


def build_tiny_llama(
    path: str | Path,
    *,
    num_layers: int = 4,
    seed: int = 0,
    head_dim: int = 32,
    max_positions: int = 4096,
    hidden_size: int = 64,
) -> Path:
    """Write a tiny random float32 Llama model and its tokenizer to ``path``.

    Args:
        path: Output directory (created if missing; existing files are replaced).
        num_layers: Number of decoder layers.
        seed: Seed for the random weights, so that a build is reproducible.
        head_dim: Attention head size.  Set explicitly (hidden_size / heads would
            be 16) because vLLM's CPU attention backend supports head sizes of
            32 and up only ("Unsupported CPU attention configuration: head_dim=16").
        max_positions: ``max_position_embeddings``; at least speculators' default max_model_len (2048).
        hidden_size: the residual stream's width (bigger states per token for the tests that need many bytes).

    Returns:
        The output directory as a :class:`~pathlib.Path`.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer(TINY_VOCAB_SIZE, max_positions)
    config = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        vocab_size=TINY_VOCAB_SIZE,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    # Spread the weights a little more than the default init (std 0.02), so that
    # the layers' outputs differ visibly from their inputs.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(mean=0.0, std=0.1)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="output directory")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--head-dim", type=int, default=32)
    args = parser.parse_args(argv)
    out = build_tiny_llama(args.out_dir, num_layers=args.num_layers, seed=args.seed, head_dim=args.head_dim)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
