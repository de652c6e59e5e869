"""The probes against real vLLM wheels: every drift they report is one we can point to in the source.

For each release below, ``make_plan(StaticView(wheel), ["0.3.0", "0.4.0.1"])`` must report exactly the
(probe, speculators line, variant) triples in ``EXPECTED_DRIFT`` as not baseline, and nothing it cannot
tell (no ``unknown``). Each triple carries a comment naming the line of that release's source that makes
it true (paths inside the wheel; check with ``unzip -p WHEEL vllm/path.py | sed -n 'A,Bp'``).

Adapters do not matter here: these tests judge what the probes observe (state and variant), not
whether an adapter covers it. Wheels come from ``fetch_release`` (cached in ``$VLLM_COMPAT_CACHE``).
"""

from __future__ import annotations

import pytest

from tests.drift import by_version, plan_getter
from vllm_compat.findings import State
from vllm_compat.plan import Plan

pytestmark = pytest.mark.wheels

V030, V040 = "0.3.0", "0.4.0.1"
LINES = (V030, V040)
Drift = tuple[str, str, str]  # (probe id, speculators line, variant)


def both(probe: str, variant: str) -> tuple[Drift, Drift]:
    """The same drift, seen by both speculators lines."""
    return (probe, V030, variant), (probe, V040, variant)


_UNIFORM = "import.v1.core.kv_cache_utils._get_kv_cache_groups_uniform_spec"
_FROM_GROUPS = "import.v1.core.kv_cache_utils.get_kv_cache_config_from_groups"
_UNIFY = "import.v1.core.kv_cache_utils.unify_hybrid_kv_cache_specs"

# release -> every finding that is not baseline. Comments cite the release's own source.
EXPECTED_DRIFT: dict[str, set[Drift]] = {
    # speculators 0.3.0 was built against 0.11.0: only the batch-order bug (speculators #279) is left.
    "0.11.0": {
        ("scheduler.batch_order", V030, "reorders"),  # vllm/v1/worker/gpu_input_batch.py:500 swap_states, :580 condense
        # speculators 0.4.0.1 needs newer vLLM:
        # vllm/config/scheduler.py:26 SchedulerConfig has no is_encoder_decoder field
        ("config.scheduler_config_kwargs", V040, "rejects=is_encoder_decoder"),
        # vllm/v1/core/sched/scheduler.py:45-52 Scheduler.__init__ has no block_size
        ("scheduler.scheduler_kwargs", V040, "rejects=block_size"),
        ("kv_cache.config_from_groups_kwargs", V040, "requires=kv_cache_specs"),  # vllm/v1/core/kv_cache_utils.py:1006
        # no vllm/utils/hashing.py; vllm/utils/__init__.py:3365
        ("import.utils.hashing.get_hash_fn_by_name", V040, "module_moved"),
        # vllm/v1/executor/multiproc_executor.py:173, no sample_tokens
        ("executor.execute_model_protocol", V040, "single_phase"),
        ("executor.unique_reply_shape", V040, "list"),  # vllm/v1/executor/multiproc_executor.py:271 `return responses`
        ("model.embedding_method", V040, "get_input_embeddings"),  # vllm/model_executor/models/llama.py:378
    },
    "0.11.1": {
        ("scheduler.batch_order", V030, "reorders"),  # vllm/v1/worker/gpu_input_batch.py:501 swap_states, :608 condense
        # vllm/config/scheduler.py:74 enable_chunked_prefill: bool = True
        ("scheduler.chunked_prefill", V030, "chunked"),
        # vllm/v1/core/sched/scheduler.py:58 block_size: int
        ("scheduler.scheduler_kwargs", V030, "requires=block_size"),
        # vllm/v1/executor/multiproc_executor.py:265 sample_tokens
        ("executor.execute_model_protocol", V030, "two_phase"),
        # vllm/v1/executor/multiproc_executor.py:346 responses[0] if ...
        ("executor.unique_reply_shape", V030, "single"),
        ("model.embedding_method", V030, "embed_input_ids"),  # vllm/model_executor/models/llama.py:427 embed_input_ids
        ("kv_cache.config_from_groups_kwargs", V040, "requires=kv_cache_specs"),  # vllm/v1/core/kv_cache_utils.py:1004
    },
    # speculators 0.4.0.1 was built against 0.12.0 to 0.16.0: nothing drifts for it in 0.12.0.
    "0.12.0": {
        ("scheduler.batch_order", V030, "reorders"),  # vllm/v1/worker/gpu_input_batch.py:495 swap_states, :602 condense
        ("scheduler.chunked_prefill", V030, "chunked"),  # vllm/config/scheduler.py:78
        ("scheduler.scheduler_kwargs", V030, "requires=block_size"),  # vllm/v1/core/sched/scheduler.py:63
        # vllm/config/scheduler.py:37 InitVar[bool]
        ("config.scheduler_config_kwargs", V030, "requires=is_encoder_decoder"),
        ("config.prefix_caching_default", V030, "on"),  # vllm/config/cache.py:76 enable_prefix_caching: bool = True
        # vllm/v1/core/kv_cache_utils.py:1050-1054
        ("kv_cache.config_from_groups_kwargs", V030, "rejects=kv_cache_specs"),
        ("executor.execute_model_protocol", V030, "two_phase"),  # vllm/v1/executor/multiproc_executor.py:268
        ("executor.unique_reply_shape", V030, "single"),  # vllm/v1/executor/multiproc_executor.py:349
        ("model.embedding_method", V030, "embed_input_ids"),  # vllm/model_executor/models/llama.py:413
    },
    "0.14.0": {
        ("scheduler.batch_order", V030, "reorders"),  # vllm/v1/worker/gpu_input_batch.py:523, :626
        ("scheduler.chunked_prefill", V030, "chunked"),  # vllm/config/scheduler.py:78
        ("scheduler.scheduler_kwargs", V030, "requires=block_size"),  # vllm/v1/core/sched/scheduler.py:71
        ("config.scheduler_config_kwargs", V030, "requires=is_encoder_decoder"),  # vllm/config/scheduler.py:37
        ("config.prefix_caching_default", V030, "on"),  # vllm/config/cache.py:77
        ("kv_cache.config_from_groups_kwargs", V030, "rejects=kv_cache_specs"),  # vllm/v1/core/kv_cache_utils.py:1069
        ("executor.execute_model_protocol", V030, "two_phase"),  # vllm/v1/executor/multiproc_executor.py:266
        ("executor.unique_reply_shape", V030, "single"),  # vllm/v1/executor/multiproc_executor.py:347
        ("model.embedding_method", V030, "embed_input_ids"),  # vllm/model_executor/models/llama.py:421
        # vllm/config/scheduler.py:133 async_scheduling: bool = Field(default=None);
        # vllm/config/vllm.py:588-628 VllmConfig.__post_init__ resolves None to True
        *both("config.async_scheduling_default", "auto"),
    },
    "0.16.0": {
        ("scheduler.batch_order", V030, "reorders"),  # vllm/v1/worker/gpu_input_batch.py:523, :626
        ("scheduler.chunked_prefill", V030, "chunked"),  # vllm/config/scheduler.py:76
        ("scheduler.scheduler_kwargs", V030, "requires=block_size"),  # vllm/v1/core/sched/scheduler.py:69
        ("config.scheduler_config_kwargs", V030, "requires=is_encoder_decoder"),  # vllm/config/scheduler.py:35
        ("config.prefix_caching_default", V030, "on"),  # vllm/config/cache.py:76
        ("kv_cache.config_from_groups_kwargs", V030, "rejects=kv_cache_specs"),  # vllm/v1/core/kv_cache_utils.py:1069
        ("executor.execute_model_protocol", V030, "two_phase"),  # vllm/v1/executor/multiproc_executor.py:282
        ("executor.unique_reply_shape", V030, "single"),  # vllm/v1/executor/multiproc_executor.py:363
        ("model.embedding_method", V030, "embed_input_ids"),  # vllm/model_executor/models/llama.py:398
        *both("config.async_scheduling_default", "auto"),  # vllm/config/scheduler.py:131 Field(default=None)
    },
    "0.17.0": {
        ("scheduler.batch_order", V030, "reorders"),  # vllm/v1/worker/gpu_input_batch.py:523, :626
        ("scheduler.chunked_prefill", V030, "chunked"),  # vllm/config/scheduler.py:83
        ("scheduler.scheduler_kwargs", V030, "requires=block_size"),  # vllm/v1/core/sched/scheduler.py:69
        ("config.scheduler_config_kwargs", V030, "requires=is_encoder_decoder"),  # vllm/config/scheduler.py:35
        ("config.prefix_caching_default", V030, "on"),  # vllm/config/cache.py:76
        ("kv_cache.config_from_groups_kwargs", V030, "rejects=kv_cache_specs"),  # vllm/v1/core/kv_cache_utils.py:1076
        ("executor.execute_model_protocol", V030, "two_phase"),  # vllm/v1/executor/multiproc_executor.py:296
        ("executor.unique_reply_shape", V030, "single"),  # vllm/v1/executor/multiproc_executor.py:377
        ("model.embedding_method", V030, "embed_input_ids"),  # vllm/model_executor/models/llama.py:398
        # vllm/config/scheduler.py:138 bool | None = Field(default=None)
        *both("config.async_scheduling_default", "auto"),
        # vllm/v1/request.py:60-66 Request.__init__(request_id, prompt_token_ids, sampling_params, pooling_params,
        # client_index=0, ...): eos_token_id is gone (only a deprecated read-only property, :182-189)
        *both("request.request_kwargs", "rejects=eos_token_id"),
    },
    "0.23.0": {
        ("scheduler.batch_order", V030, "reorders"),  # vllm/v1/worker/gpu_input_batch.py:566, :683
        ("scheduler.chunked_prefill", V030, "chunked"),  # vllm/config/scheduler.py:84
        ("scheduler.scheduler_kwargs", V030, "requires=block_size"),  # vllm/v1/core/sched/scheduler.py:71
        ("config.scheduler_config_kwargs", V030, "requires=is_encoder_decoder"),  # vllm/config/scheduler.py:35
        ("config.prefix_caching_default", V030, "on"),  # vllm/config/cache.py:92
        ("kv_cache.config_from_groups_kwargs", V030, "rejects=kv_cache_specs"),  # vllm/v1/core/kv_cache_utils.py:1247
        ("executor.execute_model_protocol", V030, "two_phase"),  # vllm/v1/executor/multiproc_executor.py:319
        ("executor.unique_reply_shape", V030, "single"),  # vllm/v1/executor/multiproc_executor.py:396
        ("model.embedding_method", V030, "embed_input_ids"),  # vllm/model_executor/models/llama.py:392
        *both("config.async_scheduling_default", "auto"),  # vllm/config/scheduler.py:146 bool | None = None
        *both("request.request_kwargs", "rejects=eos_token_id"),  # vllm/v1/request.py:60-70
        *both("config.model_runner_default", "v2_default"),  # vllm/config/vllm.py:519 VllmConfig.use_v2_model_runner
    },
    "0.27.0": {
        ("scheduler.batch_order", V030, "reorders"),  # vllm/v1/worker/gpu_input_batch.py:586, :708
        ("scheduler.chunked_prefill", V030, "chunked"),  # vllm/config/scheduler.py:74
        ("scheduler.scheduler_kwargs", V030, "requires=block_size"),  # vllm/v1/core/sched/scheduler.py:75
        ("config.scheduler_config_kwargs", V030, "requires=is_encoder_decoder"),  # vllm/config/scheduler.py:35
        ("config.prefix_caching_default", V030, "on"),  # vllm/config/cache.py:93
        ("kv_cache.config_from_groups_kwargs", V030, "rejects=kv_cache_specs"),  # vllm/v1/core/kv_cache_utils.py:1361
        ("executor.execute_model_protocol", V030, "two_phase"),  # vllm/v1/executor/multiproc_executor.py:333
        ("executor.unique_reply_shape", V030, "single"),  # vllm/v1/executor/multiproc_executor.py:410
        ("model.embedding_method", V030, "embed_input_ids"),  # vllm/model_executor/models/llama.py:397
        *both("config.async_scheduling_default", "auto"),  # vllm/config/scheduler.py:148
        *both("request.request_kwargs", "rejects=eos_token_id"),  # vllm/v1/request.py:60
        *both("config.model_runner_default", "v2_default"),  # vllm/config/vllm.py:578
        # vllm/v1/executor/abstract.py:118-120 initialize_from_config only; :122 separate compile_or_warm_up_model()
        *both("executor.warmup_in_initialize", "separate"),
    },
    "0.29.0": {
        ("scheduler.batch_order", V030, "reorders"),  # vllm/v1/worker/gpu_input_batch.py:584, :706
        ("scheduler.chunked_prefill", V030, "chunked"),  # vllm/config/scheduler.py:105
        ("scheduler.scheduler_kwargs", V030, "requires=block_size"),  # vllm/v1/core/sched/scheduler.py:80
        ("config.scheduler_config_kwargs", V030, "requires=is_encoder_decoder"),  # vllm/config/scheduler.py:35
        ("config.prefix_caching_default", V030, "on"),  # vllm/config/cache.py:138
        ("kv_cache.config_from_groups_kwargs", V030, "rejects=kv_cache_specs"),  # vllm/v1/core/kv_cache_utils.py:1407
        ("executor.execute_model_protocol", V030, "two_phase"),  # vllm/v1/executor/multiproc_executor.py:353
        ("executor.unique_reply_shape", V030, "single"),  # vllm/v1/executor/multiproc_executor.py:442
        ("model.embedding_method", V030, "embed_input_ids"),  # vllm/model_executor/models/llama.py:397
        *both("config.async_scheduling_default", "auto"),  # vllm/config/scheduler.py:179
        *both("request.request_kwargs", "rejects=eos_token_id"),  # vllm/v1/request.py:60
        *both("config.model_runner_default", "v2_default"),  # vllm/config/vllm.py:645
        *both("executor.warmup_in_initialize", "separate"),  # vllm/v1/executor/abstract.py:124
        # vllm/v1/core/kv_cache_utils.py:1435 layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        *both("kv_cache.layout_precondition", "layout_required"),
        # vllm/v1/attention/backends/cpu_attn.py:61 return [MultipleOf(32)]
        *both("platform.cpu_block_size", "multiple_of_32"),
    },
    "0.33.0": {
        ("scheduler.batch_order", V030, "reorders"),  # vllm/v1/worker/gpu_input_batch.py:580, :698
        ("scheduler.chunked_prefill", V030, "chunked"),  # vllm/config/scheduler.py:134
        ("scheduler.scheduler_kwargs", V030, "requires=block_size"),  # vllm/v1/core/sched/scheduler.py:92
        ("config.scheduler_config_kwargs", V030, "requires=is_encoder_decoder"),  # vllm/config/scheduler.py:34
        ("config.prefix_caching_default", V030, "on"),  # vllm/config/cache.py:257
        ("kv_cache.config_from_groups_kwargs", V030, "rejects=kv_cache_specs"),  # vllm/v1/core/kv_cache_planning.py:642
        ("executor.execute_model_protocol", V030, "two_phase"),  # vllm/v1/executor/multiproc_executor.py:419
        ("executor.unique_reply_shape", V030, "single"),  # vllm/v1/executor/multiproc_executor.py:550
        ("model.embedding_method", V030, "embed_input_ids"),  # vllm/model_executor/models/llama.py:403
        *both("config.async_scheduling_default", "auto"),  # vllm/config/scheduler.py:211
        *both("request.request_kwargs", "rejects=eos_token_id"),  # vllm/v1/request.py:61-72
        *both("config.model_runner_default", "v2_default"),  # vllm/config/vllm.py:731
        *both("executor.warmup_in_initialize", "separate"),  # vllm/v1/executor/abstract.py:133
        *both("kv_cache.layout_precondition", "layout_required"),  # vllm/v1/core/kv_cache_planning.py:676
        *both("platform.cpu_block_size", "multiple_of_32"),  # vllm/v1/attention/backends/cpu_attn.py:66
        # The planning helpers left kv_cache_utils (which neither defines nor re-exports them) for
        # vllm/v1/core/kv_cache_planning.py:314, :642 and :853.
        *both(_UNIFORM, "moved"),
        *both(_FROM_GROUPS, "moved"),
        *both(_UNIFY, "moved"),
    },
    # Model Runner V1 deleted (no vllm/v1/worker/gpu_model_runner.py, gpu_input_batch.py); extensible KV cache
    "0.34.0": {
        ("scheduler.chunked_prefill", V030, "chunked"),  # vllm/config/scheduler.py:23
        ("scheduler.scheduler_kwargs", V030, "requires=block_size"),  # vllm/v1/core/sched/scheduler.py:86
        ("config.scheduler_config_kwargs", V030, "requires=is_encoder_decoder"),  # vllm/config/scheduler.py:23
        ("config.prefix_caching_default", V030, "on"),  # vllm/config/cache.py:181
        ("kv_cache.config_from_groups_kwargs", V030, "rejects=kv_cache_specs"),  # vllm/v1/core/kv_cache_planning.py:685
        ("executor.execute_model_protocol", V030, "two_phase"),  # vllm/v1/executor/multiproc_executor.py:443
        ("executor.unique_reply_shape", V030, "single"),  # vllm/v1/executor/multiproc_executor.py:471
        ("model.embedding_method", V030, "embed_input_ids"),  # vllm/model_executor/models/llama.py:403
        *both("config.async_scheduling_default", "auto"),  # vllm/config/scheduler.py:23
        *both("request.request_kwargs", "rejects=eos_token_id"),  # vllm/v1/request.py:63
        *both("config.model_runner_default", "v2_only"),  # vllm/v1/worker/gpu/model_runner.py:206, no V1 module
        *both("model_runner.v1_attributes", "absent"),  # no vllm/v1/worker/gpu_model_runner.py
        *both("scheduler.batch_order", "absent"),  # no vllm/v1/worker/gpu_input_batch.py
        *both("executor.warmup_in_initialize", "separate"),  # vllm/v1/executor/abstract.py:130, :134
        *both("kv_cache.layout_precondition", "layout_required"),  # vllm/v1/core/kv_cache_planning.py:685
        *both("platform.cpu_block_size", "multiple_of_32"),  # vllm/v1/attention/backends/cpu_attn.py:63
        *both(_UNIFORM, "moved"),  # vllm/v1/core/kv_cache_planning.py:360
        *both(_FROM_GROUPS, "moved"),  # vllm/v1/core/kv_cache_planning.py:685
        *both(_UNIFY, "moved"),  # vllm/v1/core/kv_cache_planning.py:897
        # vllm/config/cache.py:395 enable_extensible_kv_cache = Field(default=None), resolved to True on CUDA/ROCm by
        # vllm/config/vllm.py:3180 VllmConfig._resolve_extensible_kv_cache (inside `if requested is None:`)
        *both("kv_cache.commitment", "on_by_default"),
    },
}

# release -> findings that must be there and baseline (the variant included): facts close to a drift.
EXPECTED_BASELINE: dict[str, set[Drift]] = {
    "0.11.0": {
        # vllm/config/scheduler.py:80 enable_chunked_prefill = None; only EngineArgs turns it on
        # (vllm/engine/arg_utils.py:1548), and vllm/v1/core/sched/scheduler.py:431-435 then never splits a prompt.
        ("scheduler.chunked_prefill", V030, "baseline"),
        ("scheduler.scheduler_kwargs", V030, "baseline"),  # vllm/v1/core/sched/scheduler.py:45-52
        ("config.prefix_caching_default", V030, "off"),  # vllm/config/cache.py:70 Optional[bool] = None
        ("config.async_scheduling_default", V030, "off"),  # vllm/config/scheduler.py:138 = False
        ("executor.unique_reply_shape", V030, "list"),  # vllm/v1/executor/multiproc_executor.py:271
        ("model.embedding_method", V030, "get_input_embeddings"),  # vllm/model_executor/models/llama.py:378
        ("kv_cache.config_from_groups_kwargs", V030, "baseline"),  # vllm/v1/core/kv_cache_utils.py:1004-1007
        ("config.model_runner_default", V030, "baseline"),  # no vllm/v1/worker/gpu/ yet
        ("model_runner.v2_async_output", V040, "absent"),  # no vllm/v1/worker/gpu/ yet
    },
    "0.11.1": {
        # vllm/config/scheduler.py:85 max_model_len: InitVar[int] = 8192, :91 is_encoder_decoder: InitVar[bool] = False
        ("config.scheduler_config_kwargs", V030, "baseline"),
        ("config.scheduler_config_kwargs", V040, "baseline"),
        ("config.prefix_caching_default", V030, "off"),  # vllm/config/cache.py:77 bool | None = None
        ("import.utils.hashing.get_hash_fn_by_name", V040, "baseline"),  # vllm/utils/hashing.py:49
    },
    "0.12.0": {
        ("config.async_scheduling_default", V040, "off"),  # vllm/config/scheduler.py:131 = False
        ("config.model_runner_default", V040, "v2_opt_in"),  # vllm/v1/worker/gpu/model_runner.py exists, env opt-in
        ("kv_cache.config_from_groups_kwargs", V040, "baseline"),  # vllm/v1/core/kv_cache_utils.py:1050-1054
        ("scheduler.scheduler_kwargs", V040, "baseline"),  # vllm/v1/core/sched/scheduler.py:63
        ("executor.unique_reply_shape", V040, "single"),  # vllm/v1/executor/multiproc_executor.py:349
        ("scheduler.batch_order", V040, "reorders"),  # 0.4.0.1 sorts rows by input_batch.req_id_to_index
    },
    "0.16.0": {
        ("request.request_kwargs", V040, "baseline"),  # vllm/v1/request.py:65 eos_token_id: int | None
        ("executor.warmup_in_initialize", V040, "baseline"),  # vllm/v1/executor/abstract.py:112-118
    },
    "0.22.0": {
        # vllm/v1/worker/gpu/model_runner.py:138 use_async_scheduling: V2 reads the flag itself (async output stays off)
        ("model_runner.v2_async_output", V040, "changed"),
    },
    "0.23.0": {
        ("platform.cpu_block_size", V040, "multiple_of_16"),  # vllm/v1/attention/backends/cpu_attn.py:59 MultipleOf(16)
    },
    "0.26.0": {
        # vllm/v1/executor/multiproc_executor.py:958 handle_output: the output thread where async scheduling is on
        ("model_runner.v2_async_output", V040, "baseline"),
    },
    "0.33.0": {
        # vllm/v1/core/kv_cache_utils.py:953 get_request_block_hasher(hash_block_size, caching_hash_fn,
        # num_hash_lookahead_tokens: int = 0): it stayed in kv_cache_utils, and 0.4.0.1's 2 positional args still fit
        ("import.v1.core.kv_cache_utils.get_request_block_hasher", V040, "baseline"),
        ("request.block_hasher_factory", V040, "baseline"),
        ("import.v1.core.kv_cache_utils.init_none_hash", V040, "baseline"),  # vllm/v1/core/kv_cache_utils.py:146
        ("kv_cache.config_from_groups_kwargs", V040, "baseline"),  # vllm/v1/core/kv_cache_planning.py:642
        ("import.utils.hashing.get_hash_fn_by_name", V040, "baseline"),  # vllm/utils/hashing.py:84
        ("kv_cache.commitment", V040, "baseline"),  # vllm/config/cache.py: no enable_extensible_kv_cache yet
        ("engine.startup_steps", V040, "baseline"),  # vllm/v1/engine/core.py:250 every executor step reviewed
    },
    "0.34.0": {
        # vllm/v1/engine/core.py:272: extend_kv_cache, disable_extensible_kv_cache, ... each reviewed
        ("engine.startup_steps", V030, "baseline"),
        ("engine.startup_steps", V040, "baseline"),
        ("model_runner.v2_async_output", V030, "baseline"),  # vllm/v1/executor/multiproc_executor.py:1161
    },
}

# (release, probe, line) -> text the evidence must contain: the file (and line) the finding points to.
EXPECTED_EVIDENCE: dict[tuple[str, str, str], str] = {
    ("0.11.0", "import.utils.hashing.get_hash_fn_by_name", V040): "vllm/utils/__init__.py:3365",
    ("0.11.1", "executor.unique_reply_shape", V030): "vllm/v1/executor/multiproc_executor.py:286",
    ("0.17.0", "request.request_kwargs", V040): "vllm/v1/request.py:",
    ("0.27.0", "executor.warmup_in_initialize", V030): "vllm/v1/executor/abstract.py:122",
    ("0.29.0", "kv_cache.layout_precondition", V040): "vllm/v1/core/kv_cache_utils.py:1407",
    ("0.33.0", _FROM_GROUPS, V030): "vllm/v1/core/kv_cache_planning.py:642",
    ("0.33.0", "kv_cache.layout_precondition", V030): "vllm/v1/core/kv_cache_planning.py:642",
    ("0.33.0", "platform.cpu_block_size", V040): "vllm/v1/attention/backends/cpu_attn.py:",
    ("0.34.0", "kv_cache.commitment", V040): "vllm/config/vllm.py:3180",
    ("0.34.0", "engine.startup_steps", V030): "vllm/v1/engine/core.py:272",
    ("0.34.0", "model_runner.v2_async_output", V040): "vllm/v1/executor/multiproc_executor.py:",
}

RELEASES = by_version(EXPECTED_DRIFT)


@pytest.fixture(scope="module")
def plan_for():
    """release -> its Plan, computed once per module run."""
    return plan_getter(LINES)


def _drift(plan: Plan) -> set[Drift]:
    return {(f.probe, f.speculators, f.variant) for f in plan.findings if f.state is not State.BASELINE}


@pytest.mark.parametrize("release", RELEASES)
def test_drift_set_is_exactly_the_table(plan_for, release: str) -> None:
    plan = plan_for(release)
    assert plan.vllm_version == release
    assert plan.source == "static"
    found, expected = _drift(plan), EXPECTED_DRIFT[release]
    assert found == expected, (
        f"vLLM {release}: reported but not in the table: {sorted(found - expected)}; "
        f"in the table but not reported: {sorted(expected - found)}"
    )


@pytest.mark.parametrize("release", RELEASES)
def test_every_finding_is_decided(plan_for, release: str) -> None:
    """On a real release every probe can tell: baseline or drifted, never unknown."""
    plan = plan_for(release)
    undecided = [(f.probe, f.speculators, f.observed) for f in plan.findings if f.state is State.UNKNOWN]
    assert not undecided
    assert {f.state for f in plan.findings} <= {State.BASELINE, State.DRIFTED}
    # each drift was judged for the line it names, and every probe was judged for each line it applies to
    assert {f.speculators for f in plan.findings} == set(LINES)


@pytest.mark.parametrize("release", sorted(EXPECTED_BASELINE))
def test_key_baseline_facts(plan_for, release: str) -> None:
    plan = plan_for(release)
    baseline = {(f.probe, f.speculators, f.variant) for f in plan.findings if f.state is State.BASELINE}
    missing = EXPECTED_BASELINE[release] - baseline
    assert not missing, f"vLLM {release}: expected baseline, not found as such: {sorted(missing)}"


@pytest.mark.parametrize(("release", "probe", "line"), sorted(EXPECTED_EVIDENCE))
def test_evidence_points_to_the_source(plan_for, release: str, probe: str, line: str) -> None:
    plan = plan_for(release)
    (finding,) = [f for f in plan.findings if f.probe == probe and f.speculators == line]
    assert EXPECTED_EVIDENCE[(release, probe, line)] in finding.evidence
