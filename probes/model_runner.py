"""vllm.v1.worker: the worker and model-runner attributes the worker extension reads."""

from __future__ import annotations

from vllm_compat.probes._kit import LINES, evidence, parse_source

from vllm_compat.apiview import ApiView
from vllm_compat.findings import BASELINE, Observation, probe

RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
BATCH = "vllm.v1.worker.gpu_input_batch.InputBatch"


@probe(
    "model_runner.v1_attributes",
    symbol=f"{RUNNER}.input_batch",
    summary="the V1 runner has model, input_batch.req_ids/req_id_to_index/num_reqs and execute_model()",
    expected=dict.fromkeys(LINES, "model_runner.model and model_runner.input_batch.req_id_to_index exist"),
)
def v1_attributes(view: ApiView) -> Observation:
    parsed = parse_source(view, f"{RUNNER}.__init__")
    if parsed is None:
        return Observation.unknown(f"{RUNNER}.__init__ is not readable")
    _tree, loc = parsed
    text = view.source(f"{RUNNER}.__init__").text  # type: ignore[union-attr]
    batch_init = view.source(f"{BATCH}.__init__")
    batch_text = (batch_init.text if batch_init else "") + " ".join(view.members(BATCH) or ())
    missing = [f"self.{a}" for a in ("input_batch",) if f"self.{a}" not in text]
    missing += [f"InputBatch.{m}" for m in ("req_ids", "req_id_to_index", "num_reqs") if m not in batch_text]
    if view.locate(f"{RUNNER}.load_model") is None:
        missing.append("load_model (which sets self.model)")
    params = [p.name for p in view.parameters(f"{RUNNER}.execute_model") or ()]
    if not params or params[0] != "scheduler_output":
        missing.append("execute_model(scheduler_output, ...)")
    if missing:
        return Observation("changed", "missing: " + ", ".join(missing), (evidence(loc),))
    return Observation(
        BASELINE,
        "input_batch, InputBatch.req_ids/req_id_to_index/num_reqs, execute_model (scheduler_output, ...)",
        (evidence(loc), evidence(view.locate(BATCH))),
    )
