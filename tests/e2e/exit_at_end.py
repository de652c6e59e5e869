"""A user's extraction script that leaves its generator alive until the interpreter exits (a module-level name), with
vllm-compat imported first: prints the time its last line ran, then exits normally."""

from __future__ import annotations

import sys
import time

if __name__ == "__main__":
    import vllm_compat  # noqa: F401, I001  (before speculators)
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    generator = VllmHiddenStatesGenerator(sys.argv[1], layer_ids=[0, 2, 3], max_model_len=256)
    results = generator.generate([[5, 6, 7, 8, 9], [10, 11, 12]])
    print(f"states {[len(r['hidden_states']) for r in results]}", flush=True)
    print(f"last line at {time.time()}", flush=True)
