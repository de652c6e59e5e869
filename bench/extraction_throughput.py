"""Hidden-state extraction throughput under vllm-compat beside plain vLLM prefill, vLLM's own extraction, transformers.

The sides run on the same random Llama, the same prompts and the same batching, each in a process of its own (vLLM
spawns its workers and re-imports this script), one after the other; each builds its engine once and runs every
``--repeat`` round of timed calls on it:

- ``extract``: speculators' unchanged ``VllmHiddenStatesGenerator`` with ``import vllm_compat`` first; per call the
  engine steps, the hand-over RPC and what follows it, and the worker's hand-over statistics.
- ``prefill``: plain ``LLM.generate`` with ``max_tokens=1`` on the engine settings the generator ended up with (the
  same KV-cache size, attention backend and model runner).
- ``native`` / ``native_disk``: vLLM's own ``extract_hidden_states`` with ``ExampleHiddenStatesConnector``, timed
  until every states file is written (/dev/shm, or disk).
- ``hf``: transformers' forward with ``output_hidden_states=True`` (not run unless asked).

The states check: the build side computes transformers' forward of a few sequences of the last timed call in the
model's dtype and in float32 (the same weights); ``extract`` and ``native`` keep those sequences' states; per layer
the summary says how far vLLM's bf16 and transformers' bf16 each are from float32 (pass: vLLM's error at most
``--check-factor`` times transformers'), and compares ``native`` with ``extract`` bit for bit.

Presets (``--preset``; any size flag overrides one value): ``default``, a 1B-class Llama (hidden 2048, 16 layers,
8 calls of 32 x 1024 tokens); ``large``, an 8B-class one (hidden 4096, 32 layers, intermediate 14336, vocab 128256,
8 calls of 16 x 2048 tokens); ``small`` (``--small``), for a CPU (hidden 256, 4 layers, 3 calls of 8 x 256).

    python bench/extraction_throughput.py --out DIR --attention-backend TRITON_ATTN --repeat 3   # GPU, 1B-class
    python bench/extraction_throughput.py --out DIR --preset large --attention-backend TRITON_ATTN --repeat 2
    python bench/extraction_throughput.py --out DIR --attention-backend TRITON_ATTN --model-runner v1,v2 \\
        --sides extract,prefill                                                               # both model runners
    python bench/extraction_throughput.py --out DIR --small                                  # CPU: anyone can run it

DIR/progress.log gets the progress lines as they happen, DIR/sides.log every side's whole output, DIR/results.json
the numbers (every call of every side), DIR/summary.md the tables; the last two are rewritten after every side.
``--time-budget SECONDS`` cuts rounds so that the whole command fits. The random model (and the check's references)
go to ``--model-dir`` (default: a temp folder), not to DIR. The code: bench/extraction/ (one module per side).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # vLLM's spawned processes import this file as __mp_main__: nothing may run then
    here = str(Path(__file__).resolve().parent)  # bench/ (python -P leaves it off sys.path); never the project root
    if here not in sys.path:
        sys.path.insert(0, here)
    from extraction.harness import main

    sys.exit(main(sys.argv[1:], __doc__.splitlines()[0]))
