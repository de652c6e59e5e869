"""vllm.platforms / CPU attention: constraints that only bite on vLLM's CPU backend."""

from __future__ import annotations

import re

from vllm_compat.probes._kit import LINES, evidence

from vllm_compat.apiview import ApiView
from vllm_compat.findings import BASELINE, Observation, probe

CPU_ATTN = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"


@probe(
    "platform.cpu_block_size",
    symbol=f"{CPU_ATTN}.get_supported_kernel_block_sizes",
    summary="the CPU attention backend accepts speculators' block size of 16",
    expected=dict.fromkeys(LINES, "block_size=16 is valid (on the CPU backend too)"),
    accepts={key: {BASELINE, "multiple_of_16"} for key in LINES},
)
def cpu_block_size(view: ApiView) -> Observation:
    dotted = f"{CPU_ATTN}.get_supported_kernel_block_sizes"
    src = view.source(dotted)
    if src is None:
        return Observation(BASELINE, "the CPU attention backend declares no kernel block sizes")
    found = re.search(r"MultipleOf\((\d+)\)", src.text)
    where = evidence(view.locate(dotted))
    if found is None:
        return Observation.unknown("its kernel block sizes are not a MultipleOf(N)", where)
    n = int(found.group(1))
    if 16 % n == 0:
        return Observation(f"multiple_of_{n}" if n != 1 else BASELINE, f"kernel block sizes: MultipleOf({n})", (where,))
    return Observation(f"multiple_of_{n}", f"kernel block sizes: MultipleOf({n}); 16 is rejected", (where,))
