"""Which model runner the capture runs on: Model Runner V1 or V2, chosen by what this vLLM can do.

speculators' worker extension was written for Model Runner V1. vLLM 0.12.0 added Model Runner V2, made it the default
for more and more models (0.22.0 on) and will delete V1. vllm-compat captures states under either runner (the row
layout of a step: ``vllm_compat.batch_order``), so the choice here decides nothing about correctness as long as the
chosen runner's facts hold; it only has to be one whose facts do hold:

- each runner has a path of facts (``V1_FACTS``, ``V2_FACTS``: probe id -> the variants under which it works). A
  runner is usable when this vLLM has it and every fact of its path holds (an ``unknown`` fact does not hold);
- ``VLLM_COMPAT_MODEL_RUNNER=v1|v2`` asks for one runner; otherwise an explicit ``VLLM_USE_V2_MODEL_RUNNER=0|1``
  (the user's choice for vLLM) asks for one; otherwise (``auto``):
  where vLLM itself defaults to V1 (V2 opt-in, 0.12 to 0.21), V1; where V2 is vLLM's default and V1 still exists,
  ``PREFERRED`` first and the other runner if the preferred one's facts do not hold; where V1 is gone, V2;
- the chosen runner is pinned for the workers by its adapter (``model-runner-v1`` / ``model-runner-v2`` set
  ``VLLM_USE_V2_MODEL_RUNNER`` while speculators' constructor starts them), except where it is vLLM's own default
  runner anyway (V1 on releases where V2 is opt-in);
- where no asked-for runner is usable, there is no capture path: the runner finding is unhandled and names the facts
  that do not hold (fail closed).

The choice is made from observations and the environment only, so ``vllm-compat probe`` (a wheel, nothing imported)
and the generator's guard (the installed vLLM) make the same one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm_compat.findings import BASELINE, UNKNOWN, Observation

__all__ = [
    "ENV",
    "PREFERRED",
    "RUNNER_PROBE",
    "V1_FACTS",
    "V2_FACTS",
    "RunnerChoice",
    "choose",
    "facts_hold",
    "requested",
]

ENV = "VLLM_COMPAT_MODEL_RUNNER"  # v1 | v2 | auto (the default)
VLLM_ENV = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM's own switch, read where ENV does not ask for a runner
RUNNER_PROBE = "config.model_runner_default"
# Where vLLM defaults to V2 and V1 still exists, the runner tried first: V1, the faster for extraction as measured.
# On an H200 (vLLM 0.26.0, 886M bf16 Llama, calls of 32 x 1024 tokens, bench/extraction_throughput.py
# --model-runner v1 then v2, one host): a median extraction call took 0.152 s under V1 and 0.162 s under V2, while
# plain prefill took 0.147 s under V1 and 0.144 s under V2: V2 makes vLLM's own prefill 2 % faster and the
# hand-driven extraction 7 % slower. Both give the same states, bit for bit.
PREFERRED = "v1"
ADAPTERS = {"v1": "model-runner-v1", "v2": "model-runner-v2"}  # the adapter that pins each runner

V1_FACTS: Mapping[str, frozenset[str]] = {
    "model_runner.v1_attributes": frozenset({BASELINE}),
    "scheduler.batch_order": frozenset({BASELINE, "reorders"}),  # rows read from input_batch.req_ids either way
}
V2_FACTS: Mapping[str, frozenset[str]] = {
    "model_runner.v2_step_batch": frozenset({BASELINE}),
    "model_runner.v2_row_layout": frozenset({BASELINE}),
    "model_runner.v2_eager_forward": frozenset({BASELINE}),
    "model_runner.v2_request_states": frozenset({BASELINE}),
    "model_runner.v2_request_slots": frozenset({BASELINE}),  # slots freed by the finished ids a step carries
}
FACTS = {"v1": V1_FACTS, "v2": V2_FACTS}
RELATED = frozenset({RUNNER_PROBE, *V1_FACTS, *V2_FACTS})  # a choice needs all of them observed
_HAS_V1 = {BASELINE, "v2_opt_in", "v2_default"}
_HAS_V2 = {"v2_opt_in", "v2_default", "v2_only"}
_NAMES = {"v1": "Model Runner V1", "v2": "Model Runner V2"}


@dataclass(frozen=True)
class RunnerChoice:
    """The runner the capture runs on (None: no capture path), the adapter that pins it, and why."""

    runner: str | None
    adapter: str | None
    why: str
    blockers: tuple[str, ...] = ()  # probe ids whose facts kept a runner out (for naming, and the verdict)
    excluded: frozenset[str] = field(default_factory=frozenset)  # runner adapters not chosen: they cover nothing


def requested(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(``auto`` | ``v1`` | ``v2`` | ``invalid``, where it comes from) for this environment."""
    env = os.environ if environ is None else environ
    raw = (env.get(ENV) or "").strip().lower()
    if raw in {"v1", "v2"}:
        return raw, f"{ENV}={raw}"
    if raw not in {"", "auto"}:
        return "invalid", f"{ENV}={env.get(ENV)} (not v1, v2 or auto)"
    vllm = (env.get(VLLM_ENV) or "").strip().lower()
    if vllm in {"1", "true"}:
        return "v2", f"{VLLM_ENV}={env.get(VLLM_ENV)}"
    if vllm in {"0", "false"}:
        return "v1", f"{VLLM_ENV}={env.get(VLLM_ENV)}"
    return "auto", f"{ENV} unset"


def facts_hold(
    facts: Mapping[str, frozenset[str]], observations: Mapping[str, Observation], line: str
) -> tuple[bool, list[str]]:
    """Whether every fact holds for ``line``, and a phrase for each that does not (``probe: variant``)."""
    failing = []
    for probe_id, accepted in facts.items():
        try:
            obs: Observation | None = observations[probe_id]  # a lazy mapping observes on first use (plan.py)
        except KeyError:
            obs = None
        variant = obs.variant_for(line) if obs is not None else UNKNOWN
        if variant not in accepted:
            failing.append(f"{probe_id} is {variant}" + ("" if obs is not None else " (not observed)"))
    return not failing, failing


def choose(
    observations: Mapping[str, Observation], line: str, environ: Mapping[str, str] | None = None
) -> RunnerChoice:
    """The runner for ``line`` given the observations of ``RELATED`` and the environment (see the module docs)."""
    want, source = requested(environ)
    default = observations.get(RUNNER_PROBE)
    variant = default.variant_for(line) if default is not None else UNKNOWN
    if want == "invalid":
        return RunnerChoice(None, None, f"{source}: no runner chosen", (RUNNER_PROBE,), frozenset(ADAPTERS.values()))
    if variant == UNKNOWN:
        why = "could not tell which model runner this vLLM uses"
        return RunnerChoice(None, None, why, (RUNNER_PROBE,), frozenset(ADAPTERS.values()))
    if variant == "unpinned":
        why = f"this vLLM ignores {VLLM_ENV}: vllm-compat cannot pin the runner its capture runs on"
        return RunnerChoice(None, None, why, (RUNNER_PROBE,), frozenset(ADAPTERS.values()))
    exists = {"v1": variant in _HAS_V1, "v2": variant in _HAS_V2}
    if want in {"v1", "v2"}:
        order, reason = [want], f"asked for by {source}"
    elif variant == "v2_default":
        order = [PREFERRED, "v2" if PREFERRED == "v1" else "v1"]
        reason = f"{_NAMES[PREFERRED]} preferred where both runners exist ({source})"
    elif variant == "v2_only":
        order, reason = ["v2"], "the only runner this vLLM runs"
    else:  # baseline, v2_opt_in: vLLM's default is V1 and V2 is experimental there: never taken on its own
        order, reason = ["v1"], f"vLLM's default runner here ({source})"
    refused: list[str] = []
    blockers: list[str] = []
    for runner in order:
        if not exists[runner]:
            refused.append(f"this vLLM has no {_NAMES[runner]} ({RUNNER_PROBE} is {variant})")
            blockers.append(RUNNER_PROBE)
            continue
        ok, failing = facts_hold(FACTS[runner], observations, line)
        if not ok:
            refused.append(f"{_NAMES[runner]}: {', '.join(failing)}")
            blockers += [f.split(" ", 1)[0] for f in failing]
            continue
        vllm_default = "v1" if variant in {BASELINE, "v2_opt_in"} else "v2"
        pinned = None if runner == "v1" and vllm_default == "v1" else ADAPTERS[runner]
        why = f"vllm-compat runs {_NAMES[runner]}: {reason}"
        if refused:
            why += f"; not {'; '.join(refused)}"
        excluded = frozenset(a for r, a in ADAPTERS.items() if r != runner)
        return RunnerChoice(runner, pinned, why, tuple(dict.fromkeys(blockers)), excluded)
    why = f"no model runner whose facts hold ({reason}): {'; '.join(refused)}"
    other = [r for r in ("v1", "v2") if exists[r] and r not in order]
    if want in {"v1", "v2"} and other:
        why += f"; what to do: unset {source.split('=')[0]} (or set it to {other[0]}), the runner this vLLM has"
    return RunnerChoice(None, None, why, tuple(dict.fromkeys(blockers)), frozenset(ADAPTERS.values()))
