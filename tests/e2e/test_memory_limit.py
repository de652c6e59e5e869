"""Issue 33: a generator for a 16k-token context, whole (caller and workers), inside a 4 GiB memory cgroup.

Before, the worker made three slabs for the largest call the scheduler allows before the first call (2 GiB each
for a 256-hidden, 4-layer model at 16k tokens): the constructor returned, then the worker was OOM-killed and every
call failed with "vLLM's executor is shut down". Now what is made ahead fits the room there is, slabs follow the calls
that come, and results the caller drops give their memory back without another call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import child_env
from tests.e2e.memcg import memory_cgroup

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent
LIMIT = 4 << 30
TOLERANCE = 1e-4  # float32 on both sides, relative to the largest state (faults.Judge)
MOST_SPARES, OVERSIZE, GRACE_SLABS = 2, 2, 2  # vllm_compat.transport.slabs: what the worker keeps free at rest


def test_a_16k_context_generator_inside_a_4_gib_limit(tmp_path: Path) -> None:
    from tests.e2e.tiny_model import build_tiny_llama

    model = build_tiny_llama(tmp_path / "model", num_layers=4, hidden_size=256, max_positions=16384)
    out = tmp_path / "memory.json"
    env = child_env({"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))})
    with memory_cgroup(LIMIT) as cgroup:
        if cgroup is None:
            pytest.skip("no memory cgroup can be made here (needs root and a writable cgroup file system)")
        script = f"echo $$ > {cgroup.folder / 'cgroup.procs'} && exec {sys.executable} {HERE / 'memory_limit.py'}"
        done = subprocess.run(["sh", "-c", f"{script} --model {model} --out {out}"], env=env, capture_output=True,
                              text=True, timeout=900)  # fmt: skip
        peak, kills = cgroup.peak(), cgroup.oom_kills()
    assert done.returncode == 0 and out.exists(), f"exit {done.returncode}, OOM kills {kills}:\n{done.stderr[-4000:]}"
    record = json.loads(out.read_text())
    print(json.dumps({**record, "cgroup_peak": peak}))
    assert kills == 0 and record["workers_alive"], record
    assert record["installed"] and record["calls"] == 10 and record["worst"] < TOLERANCE, record
    assert 0 < record["slab_bytes_at_start"] <= LIMIT // 4, "made ahead within a quarter of the room there was"
    at_rest = (MOST_SPARES + GRACE_SLABS) * OVERSIZE * record["call_bytes"] + 4 * (2 << 20)  # spares, and more a while
    assert record["slab_bytes_after_dropping"] <= at_rest, f"kept after dropping every result: {record}"
    assert record["slab_bytes_after_later_calls"] <= at_rest, record
