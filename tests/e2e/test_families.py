"""Model families end to end: speculators' generator, unchanged, under vllm-compat on a real vLLM engine.

For each family below, a tiny random checkpoint (tests/e2e/tiny_families.py) goes through the installed speculators
line's ``VllmHiddenStatesGenerator`` with ``import vllm_compat`` first, and every returned tensor is compared with
transformers' forward on the same weights (float32, max abs diff < 1e-4). First, the probes judge that family on the
installed vLLM: where they leave drift unhandled, the test expects the generator's constructor to refuse the model
(``UnhandledDrift``, before it loads) instead.

One call of a few mixed-length sequences per family keeps it fast (one engine start each). Some families need a
test-harness setting on vLLM's CPU build (the tiny model is run as vLLM would run it, only with what the CPU backend
offers): DeepSeek's MLA needs the float32-capable ``CPU_MLA`` backend (the AMX one takes bf16 weights only; releases
before 0.28 have no CPU MLA backend and run the same weights decompressed into plain attention, ``VLLM_MLA_DISABLE=1``:
the MoE, the decoder stack and its conventions are DeepSeek's, the attention kernel is not MLA's), and
vLLM's CPU rotary-embedding kernel, which rotates DeepSeek's interleaved (GPT-J style) q_pe wrongly, is swapped for
vLLM's own PyTorch rotary embedding (``custom_ops=["-rotary_embedding"]``). That kernel runs whenever custom ops are
on (the generator's hand-built VllmConfig, or plain vLLM with ``enforce_eager=True``, whose prompt logprobs are then
0.4 off transformers' as well); it is a vLLM CPU defect, not API drift.
Where a release's CPU attention runs sinks (gpt-oss) in bfloat16 only (vLLM 0.16's CPU build: "expected scalar
type BFloat16 but found Float"), the family runs again in bfloat16 and is compared with transformers' float32 forward
on the same weights rounded to bfloat16, within bfloat16's precision (``BF16_TOLERANCE``, relative to the largest
state), which still catches a wrong layer, order or sequence (errors of the states' own size). Its checkpoint then
routes every token to all experts (``Case.bf16_config``): a top-k choice between near-tied router logits is not
stable under bfloat16 rounding.
Multimodal wrappers (Kimi-K2.5 around DeepSeek-V3, Qwen3-VL around Qwen3; tests/e2e/tiny_families.py) have text
weights only and take text prompts: vLLM builds no vision tower (``ModelConfig(language_model_only=True)``; releases
without it, e.g. 0.16, get ``limit_mm_per_prompt`` of 0 for every modality, which skips the tower the same way).
Kimi-K2.5 runs with DeepSeek-V3's CPU settings and is compared with transformers' DeepSeek-V3 on the same weights.
A family whose vLLM model module does not import in this environment is skipped with the import error (Qwen3-VL
needs torchvision, which must match torch's build: the matrix installs vLLM's pin beside PyPI's torch, none beside a
``+cpu`` torch).
``VLLM_COMPAT_E2E_FAMILIES`` (comma-separated) picks the families to run; the default is all of them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import LAYERS, TOLERANCE, max_diff
from tests.e2e.report import record
from tests.e2e.tiny_families import TOKEN_RANGE

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent


@dataclass(frozen=True)
class Case:
    config_class: str  # the transformers config class the tiny checkpoint needs
    harness: dict[str, Any] = field(default_factory=dict)  # test-harness settings for the generator's VllmConfig
    bf16_config: dict[str, Any] = field(default_factory=dict)  # the tiny checkpoint's config when run in bfloat16
    module: str = ""  # vLLM's model module, imported in a fresh interpreter first (skip if it cannot be)
    tokens: tuple[int, int] = (4, 512)  # prompt token ids (the multimodal wrappers reserve 508-511)


_DEEPSEEK_CPU = {
    "attention_backend": "CPU_MLA",
    "custom_ops": ["-rotary_embedding"],
    "else_env": {"VLLM_MLA_DISABLE": "1"},
}
CASES = {
    "qwen3": Case("Qwen3Config"),
    # in bfloat16, every token goes to all 4 experts: a top-2 choice between near-tied router logits flips under
    # bfloat16 rounding (a gap of 2.5e-5 measured on the default checkpoint) and moves that token's state by its
    # own size; with all experts chosen the output is continuous in the router logits (their weights still differ)
    "gpt_oss": Case("GptOssConfig", bf16_config={"num_experts_per_tok": 4}),
    "deepseek_v3": Case("DeepseekV3Config", _DEEPSEEK_CPU),
    # DeepSeek-V3's checkpoint (MLA and MoE) under vLLM's Kimi-K2.5 wrapper, with local stand-ins for its remote code
    "kimi_k25": Case(
        "DeepseekV3Config",
        {**_DEEPSEEK_CPU, "language_model_only": True},
        module="vllm.model_executor.models.kimi_k25",
        tokens=TOKEN_RANGE,
    ),
    "qwen3_vl": Case(
        "Qwen3VLConfig",
        {"language_model_only": True},
        module="vllm.model_executor.models.qwen3_vl",
        tokens=TOKEN_RANGE,
    ),
}
SELECTED = [f for f in os.environ.get("VLLM_COMPAT_E2E_FAMILIES", ",".join(CASES)).split(",") if f]
BF16_ONLY = "expected scalar type BFloat16 but found Float"  # a CPU kernel that takes bfloat16 only
# bfloat16 keeps 8 significant bits (2**-8 = 0.4 %); four layers of rounding on vLLM's side, relative to the largest
# |state|. A wrong layer, order or sequence differs by the states' own size (100 %).
BF16_TOLERANCE = 3e-2


def _calls(tokens: tuple[int, int] = (4, 512)) -> list[list[list[int]]]:
    rng = random.Random(4321)
    return [[[rng.randrange(*tokens) for _ in range(n)] for n in (5, 37, 100, 11)]]


# Runs the generator as a user's script would (tests/e2e/extract.py), after the harness settings. A separate
# interpreter outside the checkout, so the installed vllm_compat is the one imported (also in vLLM's workers).
RUNNER = """
import importlib.util, json, os, sys
harness = json.loads(os.environ["FAMILY_HARNESS"])
if harness:
    import vllm_compat  # first, as in extract.py (which imports it again)
    from speculators.data_generation import vllm_hidden_states_generator as gen
    if harness.get("language_model_only"):  # text weights only: no vision tower
        import inspect
        original_model_config = gen.ModelConfig
        if "language_model_only" in inspect.signature(original_model_config).parameters:
            text_only = {"language_model_only": True}
        else:  # before language_model_only: a limit of 0 for every modality skips the towers
            text_only = {"limit_mm_per_prompt": {"image": 0, "video": 0, "audio": 0, "vision_chunk": 0}}
        gen.ModelConfig = lambda *a, **kw: original_model_config(*a, **{**kw, **text_only})
    extra = {}
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:
        AttentionBackendEnum = None
    # a backend this release does not have is left out: vLLM's own choice then says what it cannot run
    backend = harness.get("attention_backend")
    if backend and backend in getattr(AttentionBackendEnum, "__members__", {}):
        from vllm.config import AttentionConfig
        extra["attention_config"] = AttentionConfig(backend=backend)
    elif backend:  # e.g. no CPU MLA backend (before vLLM 0.28): what the release offers instead
        os.environ.update(harness.get("else_env", {}))
    if harness.get("custom_ops"):
        from vllm.config import CompilationConfig
        extra["compilation_config"] = CompilationConfig(custom_ops=harness["custom_ops"])
    original = gen.VllmConfig
    gen.VllmConfig = lambda *a, **kw: original(*a, **{**extra, **kw})
spec = importlib.util.spec_from_file_location("vllm_compat_e2e_extract", os.environ["FAMILY_EXTRACT"])
extract = importlib.util.module_from_spec(spec)
spec.loader.exec_module(extract)
sys.argv = ["extract.py", *sys.argv[1:]]
sys.exit(extract.main())
"""


def _plan_for(family: str, cwd: Path) -> dict[str, Any]:
    """The installed vLLM judged for one family and the installed speculators line (LiveView, as the guard does)."""
    script = (
        "import json\n"
        "from vllm_compat.apiview.live import LiveView\n"
        "from vllm_compat.plan import make_plan\n"
        "from vllm_compat.versions import installed_version, speculators_line\n"
        "line = speculators_line(installed_version('speculators'))\n"
        f"plan = make_plan(LiveView(), (line,), families=[{family!r}])\n"
        "print(json.dumps({'ok': plan.ok, 'unhandled': sorted({f.probe for f in plan.unhandled})}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=cwd, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _reference(
    family: str, model: Path, calls: list[list[list[int]]], weights: str = "float32"
) -> dict[tuple[int, ...], list[Any]]:
    """transformers' float32 forward; ``weights="bfloat16"``: on the weights rounded to bfloat16, as vLLM loads them.

    Kimi-K2.5: transformers' DeepSeek-V3 on the same weights (tiny_families.reference_dir).
    """
    import torch
    import transformers

    from tests.e2e.tiny_families import decoder_layers, reference_dir

    cls = transformers.Qwen3VLForConditionalGeneration if family == "qwen3_vl" else transformers.AutoModelForCausalLM
    hf = cls.from_pretrained(reference_dir(family, model), torch_dtype=torch.float32).eval()
    if weights != "float32":
        with torch.no_grad():
            for param in hf.parameters():
                param.copy_(param.to(getattr(torch, weights)).float())
    captured: dict[int, Any] = {}
    layers = decoder_layers(family, hf)
    for layer in LAYERS:
        layers[layer].register_forward_hook(
            lambda _m, _i, out, layer=layer: captured.__setitem__(layer, out[0] if isinstance(out, tuple) else out)
        )
    refs: dict[tuple[int, ...], list[Any]] = {}
    with torch.no_grad():
        for call in calls:
            for ids in call:
                hf(input_ids=torch.tensor([ids]))
                refs[tuple(ids)] = [captured[layer][0].clone() for layer in LAYERS]
    return refs


@pytest.mark.parametrize("family", [f for f in CASES if f in SELECTED])
def test_family_states_match_transformers(family: str, tmp_path: Path) -> None:
    case = CASES[family]
    import transformers

    if not hasattr(transformers, case.config_class):
        pytest.skip(f"transformers {transformers.__version__} has no {case.config_class}")
    if case.module and (error := _import_error(case.module, tmp_path)):
        record(f"family_{family}", f"skipped: vLLM's model module does not import here: {error}")
        pytest.skip(f"vLLM's {case.module} does not import here: {error}")
    from tests.e2e.tiny_families import build_tiny

    model = build_tiny(family, tmp_path / family, num_layers=4)
    calls = _calls(case.tokens)
    (tmp_path / "calls.json").write_text(json.dumps(calls))
    verdict = _plan_for(family, tmp_path)
    cmd = [sys.executable, "-c", RUNNER, "--model", str(model), "--calls", str(tmp_path / "calls.json")]
    cmd += ["--layers", ",".join(map(str, LAYERS)), "--out", str(tmp_path / "out.pt")]
    env = {
        **os.environ,
        "FAMILY_HARNESS": json.dumps(case.harness),
        "FAMILY_EXTRACT": str(HERE / "extract.py"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    env.pop("VLLM_COMPAT_DISABLE", None)
    dtype = "float32"
    done = subprocess.run(
        [*cmd, "--dtype", dtype], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False
    )
    if verdict["ok"] and done.returncode != 0 and BF16_ONLY in done.stdout + done.stderr:
        dtype = "bfloat16"  # this CPU build runs the family's attention in bfloat16 only: compare at its precision
        model = build_tiny(family, tmp_path / f"{family}-bf16", num_layers=4, overrides=case.bf16_config)
        cmd[cmd.index("--model") + 1] = str(model)
        done = subprocess.run(
            [*cmd, "--dtype", dtype], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False
        )
    if not verdict["ok"]:  # the probes say this vLLM cannot serve the family: refused before the model loads
        assert done.returncode != 0
        assert "UnhandledDrift" in done.stderr and "before the model loads" in done.stderr, done.stderr[-3000:]
        for probe in verdict["unhandled"]:
            assert probe in done.stderr
        record(f"family_{family}", f"refused before loading: {', '.join(verdict['unhandled'])}")
        return
    output = done.stdout + done.stderr  # vLLM's workers log their errors on stdout
    if done.returncode != 0 and family != "qwen3" and _cpu_backend_limit(output):
        why = _last_error(output) + ("" if dtype == "float32" else f" (in bfloat16; in float32: {BF16_ONLY})")
        record(f"family_{family}", f"vLLM's CPU build cannot run it: {why}")
        pytest.skip(f"vLLM's CPU build cannot run {family}: {why}")
    assert done.returncode == 0, output[-6000:]
    import torch

    data = torch.load(tmp_path / "out.pt", weights_only=False)
    assert data["vllm_dtype"] == f"torch.{dtype}"
    reference = _reference(family, model, calls, weights=dtype)
    diff = max_diff(data["outputs"], calls, reference)
    if dtype == "float32":
        record(f"family_{family}_max_abs_diff", diff)
        assert diff < TOLERANCE
        return
    scale = max(state.abs().max().item() for states in reference.values() for state in states)
    print(f"{family} in {dtype}: max abs diff {diff:.4g}, largest |state| {scale:.4g}, relative {diff / scale:.4g}")
    record(f"family_{family}_{dtype}_max_abs_diff", diff)
    record(f"family_{family}_{dtype}_relative_diff", diff / scale)
    assert diff < BF16_TOLERANCE * scale


def _import_error(module: str, cwd: Path) -> str | None:
    """None if ``module`` imports in a fresh interpreter (outside the checkout), else its last error line."""
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, cwd=cwd, timeout=300, check=False
    )
    if done.returncode == 0:
        return None
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    return lines[-1][:300] if lines else f"exit {done.returncode}"


def _last_error(output: str) -> str:
    """The root error: the last exception a vLLM worker logged, else the last exception line, else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    found = [(line, m) for line in lines if (m := re.search(r"\b\w+(?:Error|Exception): .*", line))]
    in_worker = [pair for pair in found if "Worker pid=" in pair[0] or "Worker-" in pair[0]]
    if in_worker or found:
        return (in_worker or found)[-1][1].group(0)[:300]
    return lines[-1][:300] if lines else "?"


def _cpu_backend_limit(stderr: str) -> bool:
    """An engine start that failed because vLLM's CPU build lacks a kernel or backend the family needs."""
    signs = (
        "NotImplementedError",
        "not supported on CPU",
        "Unsupported",
        "CPU_MLA",  # releases without the CPU MLA backend
        "No valid",
        BF16_ONLY,  # CPU attention with sinks in bfloat16 only (vLLM 0.22; 0.16 runs it in bfloat16 above)
        # vLLM 0.22's float32 CPU MoE builds a CustomOp at forward time (fused_moe/cpu_fused_moe.py:53); plain vLLM
        # fails the same way
        "Current vLLM config is not set",
    )
    return any(sign in stderr for sign in signs)


def test_live_and_static_views_agree_on_the_families(tmp_path: Path) -> None:
    """LiveView and StaticView (the installed files, read with ast) agree on every family that imports here."""
    if not importlib.util.find_spec("vllm"):
        pytest.skip("needs vLLM")
    script = """
import json
from pathlib import Path
import vllm
from vllm_compat.apiview.live import LiveView
from vllm_compat.apiview.static import StaticView
from vllm_compat.plan import make_plan
site = Path(vllm.__file__).resolve().parent.parent
out = {}
for name, view in (("live", LiveView()), ("static", StaticView(site))):
    plan = make_plan(view, ("0.3.0", "0.4.0.1"), families="all")
    out[name] = {f"{f.probe}@{f.speculators}": [str(f.state), f.variant, f.evidence, f.observed] for f in plan.findings}
print(json.dumps(out))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    plans = json.loads(done.stdout.strip().splitlines()[-1])
    for key, static in plans["static"].items():
        live = plans["live"][key]
        if live[0] == "unknown" and "does not import here" in live[3]:
            continue  # a family module this environment cannot import (e.g. Qwen3-VL without torchvision)
        assert live[:3] == static[:3], key
