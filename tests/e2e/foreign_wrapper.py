"""A tracer wraps speculators' generator on top of vllm-compat, then the script runs uninstall() and install().

Run by tests/e2e/test_foreign_wrapper.py in a fresh interpreter. The tracer is a real wrapt wrapper, as ddtrace or
OpenTelemetry apply them, on ``generate`` and ``__init__`` (both carry adapters). Saves the outputs of the calls,
how many wrappers each method carries before and after, and what ``status()`` said, to ``--out`` (torch.save).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

METHODS = ("generate", "__init__")


def chain_length(cls: type, name: str) -> int:
    """How many wrappers ``cls.name`` carries (each one's ``__wrapped__`` leads to the next)."""
    current, count = cls.__dict__[name], 0
    while hasattr(current, "__wrapped__"):
        current, count = current.__wrapped__, count + 1
    return count


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--calls", required=True)
    parser.add_argument("--layers", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import vllm_compat  # noqa: I001  (before speculators, as in a user's script)
    import wrapt
    from extract import _force_dtype
    from speculators.data_generation import vllm_hidden_states_generator as gen_module

    cls = gen_module.VllmHiddenStatesGenerator
    ours = {name: chain_length(cls, name) for name in METHODS}
    traced: list[str] = []

    def tracer(wrapped, instance, a, kw):
        traced.append(wrapped.__name__)
        return wrapped(*a, **kw)

    for name in METHODS:
        wrapt.wrap_function_wrapper(gen_module, f"VllmHiddenStatesGenerator.{name}", tracer)
    vllm_compat.uninstall()
    after_uninstall = vllm_compat.status()
    vllm_compat.install()
    after_install = vllm_compat.status()
    _force_dtype(gen_module, "float32")
    with open(args.calls) as f:
        calls = json.load(f)
    generator = cls(model_path=args.model, layer_ids=[int(x) for x in args.layers.split(",")], max_model_len=2048)
    outputs = [generator.generate(call) for call in calls]
    generator.executor.shutdown()

    import torch

    torch.save(
        {
            "outputs": outputs,
            "ours": ours,
            "after": {name: chain_length(cls, name) for name in METHODS},
            "traced": traced,
            "applied_before": sorted(after_install["applied"]),
            "after_uninstall": {k: after_uninstall.get(k) for k in ("applied", "pass_through")},
            "after_install": {k: after_install.get(k) for k in ("applied", "pass_through")},
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.exit(main())
