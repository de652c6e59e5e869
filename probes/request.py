"""vllm.v1.request and the block hasher: how speculators builds each prefill request."""

from __future__ import annotations

from vllm_compat.probes._kit import LINES, V030, V040, call_probe

_REQUEST_030 = [
    "request_id",
    "prompt_token_ids",
    "sampling_params",
    "pooling_params",
    "eos_token_id",
    "arrival_time",
]

call_probe(
    "request.request_kwargs",
    ["vllm.v1.request.Request"],
    {V030: _REQUEST_030, V040: [*_REQUEST_030, "block_hasher"]},
    "Request(request_id, prompt_token_ids, sampling_params, pooling_params, eos_token_id, arrival_time"
    "[, block_hasher])",
)
call_probe(
    "request.sampling_params_kwargs",
    ["vllm.sampling_params.SamplingParams"],
    {key: ["max_tokens", "temperature"] for key in LINES},
    "SamplingParams(max_tokens=1, temperature=0.0)",
)
call_probe(
    "request.block_hasher_factory",
    [
        "vllm.v1.core.kv_cache_utils.get_request_block_hasher",
        "vllm.v1.core.kv_cache_planning.get_request_block_hasher",
    ],
    {V040: []},
    "get_request_block_hasher(block_size, hash_fn) positionally",
    positional_by_line={V040: 2},
)
call_probe(
    "request.init_none_hash",
    ["vllm.v1.core.kv_cache_utils.init_none_hash", "vllm.v1.core.kv_cache_planning.init_none_hash"],
    {V040: []},
    "init_none_hash(hash_fn) positionally",
    positional_by_line={V040: 1},
)
call_probe(
    "request.hash_fn_by_name",
    ["vllm.utils.hashing.get_hash_fn_by_name", "vllm.utils.get_hash_fn_by_name"],
    {V040: []},
    "get_hash_fn_by_name(name) positionally",
    positional_by_line={V040: 1},
)
