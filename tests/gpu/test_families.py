"""Model families on a real GPU engine: the unchanged speculators generator vs transformers' bf16 forward.

tests/e2e/test_families.py runs the families on vLLM's CPU build, which cannot run some of them (MLA needs vLLM's
CPU_MLA backend, float32 only, from 0.28; attention sinks in bfloat16 only on older releases) and never exercises
the GPU kernels. Here each family's tiny random bfloat16 checkpoint (tests/gpu/family_models.py) goes through the
installed speculators line's ``VllmHiddenStatesGenerator`` with ``import vllm_compat`` first, on vLLM's CUDA build
in a subprocess (tests/gpu/extract_family.py), and every returned tensor is compared with transformers' bf16 forward
on the GPU (forward hooks on the same decoder layers) with tests/gpu/conftest.py's bound, plus that bound's power to
fail: every returned state shifted by one row must exceed it.

Families (``VLLM_COMPAT_GPU_FAMILIES``, comma-separated, picks; default all):

- ``deepseek_v3``: MLA, every layer dense, vLLM's ``TRITON_MLA`` backend (``VLLM_COMPAT_MLA_BACKEND`` overrides).
  On Hopper, vLLM 0.22's MLA runs prompts through its FlashAttention prefill (the only MLA prefill backend it
  offers for SM90) and decodes with the Triton kernel.
- ``deepseek_v3_moe``: the same with a routed MoE (vLLM's fused MoE, ``vllm._moe_C``).
- ``kimi_k25``: vLLM's Kimi-K2.5 wrapper around the ``deepseek_v3`` model, run ``language_model_only``.
- ``qwen3_vl``: the Qwen3-VL wrapper, ``language_model_only``; skipped where vLLM's qwen3_vl module does not
  import (checked in a fresh interpreter; e.g. an environment whose transformers processors need a missing
  torchvision).
- ``gpt_oss``: alternating sliding-window / full attention with sinks, a routed MoE in every layer.
- ``qwen3``: the plain case.

The non-MLA families take ``VLLM_COMPAT_ATTENTION_BACKEND`` (e.g. ``TRITON_ATTN``) like tests/gpu/test_extraction.py.
One engine start per family, one call of a few mixed-length sequences and a second call with more than ten.

Where a family needs binaries the installed vLLM lacks (a stripped install: no flash-attention ``.so``, no
``_moe_C``), the run is still made, and the test is skipped with vLLM's own error only if it failed *and* the
binary does not import (checked in a separate interpreter, ``import vllm._moe_C`` /
``import vllm.vllm_flash_attn._vllm_fa3_C``); a failure with the binaries present fails the test.

``VLLM_COMPAT_GPU_TESTS_ON_CPU=1`` (harness development on vLLM's CPU build, as in conftest.py): the MLA families
use what tests/e2e/test_families.py uses there (float32, ``CPU_MLA``, vLLM's PyTorch rotary embedding), compared
with transformers' float32 forward; it proves nothing about the GPU.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.conftest import (
    ABS_TOL,
    LAYERS,
    MAX_MODEL_LEN,
    ON_CPU,
    REL_TOL,
    child_env,
    compare,
    device,
    record,
)

pytestmark = pytest.mark.gpu
HERE = Path(__file__).parent
MLA_BACKEND = os.environ.get("VLLM_COMPAT_MLA_BACKEND", "TRITON_MLA")

# binary -> (module to import in a fresh interpreter, what it serves)
_BINARIES = {
    "moe": (("vllm._moe_C",), "vLLM's fused-MoE ops (vllm/_moe_C.abi3.so)"),
    "flash_attn": (
        ("vllm.vllm_flash_attn._vllm_fa3_C", "vllm.vllm_flash_attn._vllm_fa2_C"),
        "vLLM's FlashAttention (vllm/vllm_flash_attn/_vllm_fa*_C.abi3.so), its only MLA prefill on Hopper",
    ),
}


@dataclass(frozen=True)
class Case:
    mla: bool = False  # attention backend MLA_BACKEND (CPU: CPU_MLA in float32)
    language_model_only: bool = False  # multimodal wrapper with text weights only
    needs: tuple[str, ...] = ()  # keys of _BINARIES the GPU run needs
    module: str = ""  # vLLM's model module, imported in a fresh interpreter first (skip if it cannot be)
    config_class: str = ""  # transformers class the checkpoint needs


CASES = {
    "deepseek_v3": Case(mla=True, needs=("flash_attn",), config_class="DeepseekV3Config"),
    "deepseek_v3_moe": Case(mla=True, needs=("flash_attn", "moe"), config_class="DeepseekV3Config"),
    "kimi_k25": Case(
        mla=True,
        language_model_only=True,
        needs=("flash_attn",),
        module="vllm.model_executor.models.kimi_k25",
        config_class="DeepseekV3Config",
    ),
    "qwen3_vl": Case(
        language_model_only=True, module="vllm.model_executor.models.qwen3_vl", config_class="Qwen3VLConfig"
    ),
    "gpt_oss": Case(needs=("moe",), config_class="GptOssConfig"),
    "qwen3": Case(config_class="Qwen3Config"),
}
SELECTED = [f for f in os.environ.get("VLLM_COMPAT_GPU_FAMILIES", ",".join(CASES)).split(",") if f]


def family_calls() -> list[list[list[int]]]:
    """Two calls: five mixed lengths (2 .. 300 tokens); then 12 sequences (req_1_10 sorts before req_1_2)."""
    from tests.gpu.family_models import TOKEN_RANGE

    rng = random.Random(4321)

    def seq(n: int) -> list[int]:
        return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]

    return [
        [seq(5), seq(37), seq(300), seq(2), seq(11)],
        [seq(64), seq(3), seq(1000), *(seq(rng.randrange(2, 200)) for _ in range(9))],
    ]


def _import_error(modules: tuple[str, ...], cwd: Path) -> str | None:
    """None if one of ``modules`` imports in a fresh interpreter (outside the checkout), else the last error line."""
    errors = []
    for module in modules:
        done = subprocess.run(
            [sys.executable, "-c", f"import {module}"],
            capture_output=True,
            text=True,
            cwd=cwd,
            env=child_env(),
            timeout=300,
            check=False,
        )
        if done.returncode == 0:
            return None
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        errors.append(f"import {module}: {lines[-1] if lines else done.returncode}")
    return "; ".join(errors)


def _last_error(output: str) -> str:
    """The root error: the last exception a vLLM worker or engine core logged, else the last exception line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    found = [(line, m) for line in lines if (m := re.search(r"\b\w+(?:Error|Exception|Exit): .*", line))]
    in_worker = [pair for pair in found if re.search(r"Worker|EngineCore", pair[0])]
    if in_worker or found:
        return (in_worker or found)[-1][1].group(0)[:400]
    return lines[-1][:400] if lines else "?"


def _harness_args(case: Case) -> list[str]:
    args = ["--language-model-only"] if case.language_model_only else []
    if ON_CPU:
        if case.mla:  # tests/e2e/test_families.py's CPU settings for DeepSeek
            args += ["--dtype", "float32", "--attention-backend", "CPU_MLA", "--custom-ops", "-rotary_embedding"]
        return args
    backend = MLA_BACKEND if case.mla else os.environ.get("VLLM_COMPAT_ATTENTION_BACKEND")
    return args + (["--attention-backend", backend] if backend else [])


def _reference(family: str, model: Path, calls: list[list[list[int]]], float32_only: bool) -> dict[str, dict]:
    """transformers' residual stream after each layer in LAYERS, per sequence, in bf16 and float32 (CPU tensors).

    Loaded in the dtype it runs in (not cast afterwards: that would cast the RoPE ``inv_freq`` buffer too).
    With ``float32_only`` (the CPU harness's float32 MLA runs) the float32 forward stands in for both.
    """
    import torch
    import transformers

    from tests.gpu.family_models import decoder_layers, reference_dir

    cls = transformers.Qwen3VLForConditionalGeneration if family == "qwen3_vl" else transformers.AutoModelForCausalLM
    refs: dict[str, dict] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if name == "bf16" and float32_only:
            refs["bf16"] = refs["fp32"]
            break
        hf = cls.from_pretrained(reference_dir(family, model), dtype=dtype).to(device()).eval()
        captured: dict[int, Any] = {}
        layers = decoder_layers(family, hf)
        for layer in LAYERS:
            layers[layer].register_forward_hook(
                lambda _m, _i, out, layer=layer, sink=captured: sink.__setitem__(
                    layer, out[0] if isinstance(out, tuple) else out
                )
            )
        refs[name] = {}
        with torch.no_grad():
            for call in calls:
                for ids in call:
                    if tuple(ids) not in refs[name]:
                        hf(input_ids=torch.tensor([ids], device=device()), logits_to_keep=1)
                        refs[name][tuple(ids)] = [captured[layer][0].cpu() for layer in LAYERS]
        del hf
    if device() == "cuda":
        torch.cuda.empty_cache()
    return refs


@pytest.mark.parametrize("family", [f for f in CASES if f in SELECTED])
def test_family_states_match_transformers(family: str, tmp_path: Path) -> None:
    case = CASES[family]
    import transformers

    if not hasattr(transformers, case.config_class):
        pytest.skip(f"transformers {transformers.__version__} has no {case.config_class}")
    if case.module and (error := _import_error((case.module,), tmp_path)):
        record(f"family {family}", f"skipped: vLLM's model module does not import here: {error}")
        pytest.skip(f"vLLM's {case.module} does not import here: {error}")
    from tests.gpu.family_models import build

    model = build(family, tmp_path / family, num_layers=4)
    calls = family_calls()
    (tmp_path / "calls.json").write_text(json.dumps(calls))
    out = tmp_path / "out.pt"
    cmd = [
        sys.executable,
        str(HERE / "extract_family.py"),
        "--model",
        str(model),
        "--calls",
        str(tmp_path / "calls.json"),
    ]
    cmd += ["--layers", ",".join(map(str, LAYERS)), "--out", str(out), "--max-model-len", str(MAX_MODEL_LEN)]
    cmd += _harness_args(case)
    done = subprocess.run(cmd, env=child_env(), cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False)
    output = done.stdout + done.stderr  # vLLM's workers log their errors on stdout
    if done.returncode != 0:
        why = _last_error(output)
        missing = {} if ON_CPU else {k: e for k in case.needs if (e := _import_error(_BINARIES[k][0], tmp_path))}
        if missing:
            lacking = "; ".join(f"{_BINARIES[k][1]} missing ({e})" for k, e in missing.items())
            record(f"family {family}", f"skipped: vLLM failed: {why} -- {lacking}")
            pytest.skip(f"{family}: vLLM failed with {why!r}; this vLLM install lacks {lacking}")
        pytest.fail(f"{family}: the extraction failed: {why}\n{output[-6000:]}")
    import torch

    data = torch.load(out, weights_only=False)
    float32_run = data["vllm_dtype"] == "torch.float32"
    assert data["vllm_dtype"] == "torch.bfloat16" or (ON_CPU and case.mla and float32_run), data["vllm_dtype"]
    outputs = data["outputs"]
    if float32_run:  # the CPU harness's float32 MLA run: compared in bf16 against the float32 forward
        for results in outputs:
            for result in results:
                result["hidden_states"] = [t.to(torch.bfloat16) for t in result["hidden_states"]]
    cmp = compare(outputs, calls, _reference(family, model, calls, float32_run))
    record(f"family {family}", cmp.as_dict())
    record(f"family {family} init_seconds", round(data["init_seconds"], 1))
    record(f"family {family} worker_applied", sorted(data["workers"][0]["applied"]) if data["workers"] else None)
    assert cmp.tensors == sum(map(len, calls)) * len(LAYERS)
    assert cmp.worst_ratio <= 1.0, (
        f"max|diff| exceeds {REL_TOL} * max|ref| + {ABS_TOL} (worst ratio {cmp.worst_ratio:.2f}, {cmp.as_dict()})"
    )
    assert cmp.shifted_min_ratio > 1.0, f"the tolerance would not catch a one-row shift ({cmp.as_dict()})"
    if not float32_run:  # vLLM's bf16 is as close to the float32 forward as transformers' bf16 (within 2x, mean)
        assert cmp.vllm_vs_fp32_mean_rel <= 2 * cmp.hf_bf16_vs_fp32_mean_rel + 1e-3, cmp.as_dict()
    assert data["workers"], "no worker answered"
    for worker in data["workers"]:
        assert worker["installed"], worker
