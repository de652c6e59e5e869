"""vllm.v1.core.sched: the Scheduler speculators drives by hand, and how it lays out a batch."""

from __future__ import annotations

from vllm_compat.probes._kit import LINES, V030, V040, call_probe, evidence

from vllm_compat.apiview import ApiView
from vllm_compat.findings import BASELINE, Observation, probe

call_probe(
    "scheduler.scheduler_kwargs",
    ["vllm.v1.core.sched.scheduler.Scheduler"],
    {
        V030: ["vllm_config", "kv_cache_config", "structured_output_manager"],
        V040: ["vllm_config", "kv_cache_config", "structured_output_manager", "block_size"],
    },
    "Scheduler(vllm_config, kv_cache_config, structured_output_manager[, block_size])",
)
call_probe(
    "scheduler.structured_output_manager_kwargs",
    ["vllm.v1.structured_output.StructuredOutputManager"],
    {key: ["vllm_config"] for key in LINES},
    "StructuredOutputManager(vllm_config=...)",
)


@probe(
    "scheduler.loop_surface",
    symbol="vllm.v1.core.sched.scheduler.Scheduler.schedule",
    summary="schedule(), add_request(), finish_requests(ids, FINISHED_ABORTED) keep their call shapes",
    expected=dict.fromkeys(
        LINES,
        "schedule() with no arguments, add_request(req), finish_requests(ids, status), FINISHED_ABORTED",
    ),
)
def loop_surface(view: ApiView) -> Observation:
    base = "vllm.v1.core.sched.scheduler.Scheduler"
    problems, where = [], []
    for method, takes in (("schedule", 0), ("add_request", 1), ("finish_requests", 2)):
        params = view.parameters(f"{base}.{method}")
        if params is None:
            problems.append(f"no {method}")
            continue
        where.append(evidence(view.locate(f"{base}.{method}")))
        required = [p for p in params if p.required]
        if len(required) > takes:
            problems.append(f"{method} now requires {', '.join(p.name for p in required)}")
    if view.locate("vllm.v1.request.RequestStatus.FINISHED_ABORTED") is None:
        problems.append("RequestStatus.FINISHED_ABORTED is gone")
    for field in ("num_scheduled_tokens", "total_num_scheduled_tokens"):
        if view.locate(f"vllm.v1.core.sched.output.SchedulerOutput.{field}") is None:
            problems.append(f"SchedulerOutput.{field} is gone")
    if problems:
        return Observation("changed", "; ".join(problems), tuple(where))
    return Observation(
        BASELINE, "schedule/add_request/finish_requests and SchedulerOutput fields as expected", tuple(where)
    )


@probe(
    "scheduler.batch_order",
    symbol="vllm.v1.worker.gpu_input_batch.InputBatch",
    summary="the rows of a step follow the order requests were added",
    expected={
        V030: "the concatenated states of all steps follow request-submission order (0.3.0 slices by position)",
        V040: "input_batch.req_id_to_index gives each request's row in the step (0.4.0.1 sorts by it)",
    },
    accepts={V040: {BASELINE, "reorders"}},
)
def batch_order(view: ApiView) -> Observation:
    """vLLM moves requests between batch rows (speculators issue #279)."""
    batch = "vllm.v1.worker.gpu_input_batch.InputBatch"
    if not view.has_module("vllm.v1.worker.gpu_input_batch"):
        return Observation("absent", "Model Runner V1's InputBatch is gone: there is no vllm.v1.worker.gpu_input_batch")
    members = view.members(batch)
    if members is None:
        return Observation.unknown(f"{batch} is not readable")
    init = view.source(f"{batch}.__init__")
    where = (evidence(view.locate(batch)),)
    if "req_id_to_index" not in members and (init is None or "self.req_id_to_index" not in init.text):
        return Observation("no_index", f"{batch} has no req_id_to_index", where)
    movers = sorted(m for m in ("condense", "swap_states") if m in members)
    if movers:
        return Observation(
            "reorders", f"requests change rows between steps ({', '.join(movers)}); req_id_to_index tracks them", where
        )
    return Observation(BASELINE, "requests keep their rows", where)


@probe(
    "scheduler.chunked_prefill",
    symbol="vllm.config.SchedulerConfig.enable_chunked_prefill",
    summary="a prompt is scheduled whole, in one step",
    expected={
        V030: "each request is prefilled in one step (0.3.0 aborts every scheduled request after its first step)",
        V040: "prompts may be split across steps (0.4.0.1 tracks computed tokens per request)",
    },
    accepts={V040: {BASELINE, "chunked"}},
)
def chunked_prefill(view: ApiView) -> Observation:
    dotted = "vllm.config.SchedulerConfig"
    params = view.parameters(dotted)
    if params is None:
        return Observation.unknown("SchedulerConfig is not readable")
    default = next((p.default for p in params if p.name == "enable_chunked_prefill"), None)
    where = evidence(view.locate(dotted), f"enable_chunked_prefill={default}")
    if default == "False":
        return Observation(BASELINE, "chunked prefill is off by default", (where,))
    post_init = view.source(f"{dotted}.__post_init__")
    if default == "None" and (post_init is None or "enable_chunked_prefill = True" not in post_init.text):
        # vLLM 0.11.0: None means "unset"; only EngineArgs turns it on. A hand-built SchedulerConfig keeps
        # chunked_prefill_enabled = None, and the V1 scheduler then never splits a waiting prompt.
        return Observation(BASELINE, "chunked prefill is unset (None): off for a hand-built SchedulerConfig", (where,))
    return Observation(
        "chunked",
        f"chunked prefill is on (enable_chunked_prefill={default}): a prompt longer than max_num_batched_tokens, "
        "or one that does not fit the step's token budget, is split across steps",
        (where,),
    )
