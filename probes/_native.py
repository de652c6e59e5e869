"""The native line's building blocks: speculators 0.5 to 0.9, which run vLLM's own hidden-state extraction.

speculators 0.5 dropped the in-process generator. Its ``scripts/launch_vllm.py`` starts ``vllm serve`` with
``--speculative_config '{"method": "extract_hidden_states", "num_speculative_tokens": 1, "draft_model_config":
{"hf_config": {"eagle_aux_hidden_state_layer_ids": [...]}}}'`` and a ``--kv_transfer_config`` naming a hidden-states
KV connector; its client sends ``/v1/completions`` (from 0.6 also ``/v1/chat/completions``) with ``max_tokens=1`` and
``return_token_ids``, and reads the saved file's path from ``kv_transfer_params``. What differs between releases,
read from their code (the package index's wheels, and the repository's scripts at their tags):

- 0.5.x: ``ExampleHiddenStatesConnector`` only; ``/v1/completions``; reads ``kv_transfer_params["hidden_states_path"]``.
- 0.6.x: also ``/v1/chat/completions`` (``add_generation_prompt=False``, ``return_token_ids``) and the response's
  ``prompt_token_ids``; the launch script adds ``--no-enable-chunked-prefill``.
- 0.7.x: the chat request also sends ``continue_final_message``; the launch script takes backends from a vendored
  copy of hs-connectors' ``transfer.py`` that registers only the ``file`` backend (``ExampleHiddenStatesConnector``),
  so no hs-connectors code runs inside vLLM.
- 0.8.x: requires hs-connectors 0.8.x (``file`` and ``mooncake`` backends; the mooncake connector is loaded by vLLM
  through ``kv_connector_module_path`` and imports vLLM internals); the client also accepts ``handle`` in
  ``kv_transfer_params``; preprocessing renders chat prompts through ``/v1/chat/completions/render``.
- 0.9.0: requires hs-connectors 0.9.0, which adds the ``fp8`` backend: a subclass of ``ExampleHiddenStatesConnector``
  that overrides its private ``_write_tensors``. speculators 0.9.0 itself imports no vLLM.

A line here is named ``native-0.X``; the plan judges it like the in-process lines (``0.3.0``, ``0.4.0.1``). The native
line has one adapter, for vLLM's CPU platform: ``native-connector-on-cpu`` (adapters/native_connector.py) makes
ExampleHiddenStatesConnector's CUDA-only copy off its cache (vLLM 0.22.0 on: ``native.connector.device_copy``)
synchronous there, in `vllm serve`'s own processes, which vllm-compat reaches when the server is started under
``vllm-compat run`` (or ``VLLM_COMPAT_AUTO=1``). Any other drift is reported unhandled, and what to do is pin a vLLM
release that passes. No native probe depends on an adapter: the probes read vLLM's code as shipped, and the adapter
takes its shape from the same reading (``cuda_only_uses``).
"""

from __future__ import annotations

N05, N06, N07, N08, N09 = "native-0.5", "native-0.6", "native-0.7", "native-0.8", "native-0.9"
NATIVE_LINES = (N05, N06, N07, N08, N09)
CHAT = (N06, N07, N08, N09)  # lines whose client also sends /v1/chat/completions
HSC = (N08, N09)  # lines that run hs-connectors' connectors inside vLLM (mooncake; fp8 from 0.9)

# line -> the hs-connectors release it runs inside vLLM (None: no hs-connectors code runs there)
HS_CONNECTORS: dict[str, str | None] = {N05: None, N06: None, N07: None, N08: "0.8.x", N09: "0.9.0"}

CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
EXAMPLE = f"{CONNECTOR_MODULE}.ExampleHiddenStatesConnector"
BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
BASE = f"{BASE_MODULE}.KVConnectorBase_V1"
