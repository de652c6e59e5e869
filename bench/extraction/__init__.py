"""Hidden-state extraction throughput under vllm-compat beside plain vLLM prefill, vLLM's own extraction and
transformers: the package behind ``bench/extraction_throughput.py``.

One module per side, each readable alone: ``extract`` (speculators' generator with vllm-compat), ``prefill``
(plain ``LLM.generate``), ``native`` (vLLM's ``extract_hidden_states`` method and its connector), ``hf``
(transformers), ``build`` (the random model and the check's float32 references); ``check`` (the states check),
``summary`` (numbers and summary.md), ``harness`` (the order, the processes, the time budget), ``config`` (presets
and the command line), ``common`` (what the sides share). Nothing heavy is imported here: vLLM's spawned processes
re-import the entry script.
"""
