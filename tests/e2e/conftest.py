"""End-to-end fixtures: a tiny local Llama, deterministic prompts, and transformers' reference states.

These tests need a real vLLM and speculators in the running environment (the matrix runner builds one
environment per vLLM release); elsewhere they are skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
LAYERS = (0, 2, 3)  # first, a middle one, and the last of 4
TOLERANCE = 1e-4  # float32 on both sides
# vLLM's CPU platform runs dtype="auto" (speculators' choice) in bfloat16; transformers is the float32 reference. bf16
# keeps 8 significant bits (relative step 2**-8 = 0.0039): each of the 4 layers rounds its inputs, weights and outputs,
# and the residual stream carries the sum. The comparison is relative: per sample and layer, max |diff| over the
# largest |state|. Measured on the tiny chat Llama (vLLM 0.30.0, speculators 0.4.0.1, 36 samples): 0.018 at worst;
# a state of the neighbouring position, of another sequence or of the previous layer differs by 0.50 at least.
BF16_RELATIVE_TOLERANCE = 0.1


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _have("vllm") and _have("speculators"):
        return
    skip = pytest.mark.skip(reason="needs vLLM and speculators installed (see scripts/e2e_matrix.py)")
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(skip)


def prompts() -> list[list[list[int]]]:
    """Calls to generate(): mixed lengths; a second call; >10 sequences (ordering); more tokens than a step holds."""
    rng = random.Random(1234)

    def seq(n: int) -> list[int]:
        return [rng.randrange(4, 512) for _ in range(n)]

    return [
        [seq(5), seq(37), seq(100), seq(11)],
        [seq(64), seq(3), seq(20)],
        [seq(rng.randrange(2, 40)) for _ in range(12)],
        [seq(500) for _ in range(20)],  # 10000 tokens > the 8192-token step budget: prompts split across steps
    ]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.e2e.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), num_layers=4)


@pytest.fixture(scope="session")
def calls() -> list[list[list[int]]]:
    return prompts()


@pytest.fixture(scope="session")
def reference(tiny_model: Path, calls: list[list[list[int]]]) -> dict[tuple[int, ...], list[Any]]:
    """transformers' residual stream after each layer in LAYERS, per distinct sequence (float32)."""
    return transformers_states(tiny_model, calls)


def transformers_states(
    model_path: Path, calls: list[list[list[int]]], layers: tuple[int, ...] = LAYERS
) -> dict[tuple[int, ...], list[Any]]:
    """transformers' residual stream after each layer in ``layers``, per distinct sequence of ``calls`` (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    captured: dict[int, Any] = {}
    for layer in layers:
        model.model.layers[layer].register_forward_hook(
            lambda _m, _i, out, layer=layer: captured.__setitem__(layer, out[0] if isinstance(out, tuple) else out)
        )
    refs: dict[tuple[int, ...], list[Any]] = {}
    with torch.no_grad():
        for call in calls:
            for ids in call:
                if tuple(ids) not in refs:
                    model(torch.tensor([ids]))
                    refs[tuple(ids)] = [captured[layer][0].clone() for layer in layers]
    return refs


@dataclass
class Extraction:
    returncode: int
    stderr: str
    data: dict[str, Any] | None


def child_env(extra: dict[str, str] | None = None, kv_cache_gib: int = 1) -> dict[str, str]:
    """The environment of an extraction subprocess: offline, spawned workers, vllm-compat not disabled."""
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **(extra or {}),
    }
    env.pop("VLLM_COMPAT_DISABLE", None)
    return env


def run_extract(
    model: Path,
    calls: list[list[list[int]]],
    tmp: Path,
    *,
    compat: bool = True,
    env: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
    layers: str | None = None,
) -> Extraction:
    """Run tests/e2e/extract.py in a fresh interpreter, as a user's script would run (``layers``: comma-separated
    ids or ``default``; LAYERS unless given)."""
    calls_file = tmp / "calls.json"
    calls_file.write_text(json.dumps(calls))
    out = tmp / "out.pt"
    cmd = [
        sys.executable,
        str(HERE / "extract.py"),
        "--model",
        str(model),
        "--calls",
        str(calls_file),
        "--layers",
        layers or ",".join(map(str, LAYERS)),
        "--out",
        str(out),
        "--dtype",
        "float32",
    ]
    cmd += extra_args or []
    if not compat:
        cmd.append("--no-compat")
    full_env = child_env(env)
    if not compat:
        full_env["VLLM_COMPAT_DISABLE"] = "1"
    done = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=900, check=False)
    data = None
    if done.returncode == 0 and out.exists():
        import torch

        data = torch.load(out, weights_only=False)
    return Extraction(done.returncode, done.stderr[-6000:], data)


def max_diff(outputs: list[list[dict[str, Any]]], calls: list[list[list[int]]], reference: dict) -> float:
    """Largest |vLLM - transformers| over every call, sequence and layer; asserts order and shapes on the way."""
    worst = 0.0
    for call, results in zip(calls, outputs, strict=True):
        assert len(results) == len(call)
        for ids, result in zip(call, results, strict=True):
            assert result["input_ids"].tolist() == ids, "results are not in input order"
            states = result["hidden_states"]
            assert len(states) == len(LAYERS)
            for got, want in zip(states, reference[tuple(ids)], strict=True):
                assert tuple(got.shape) == tuple(want.shape), f"shape {tuple(got.shape)} != {tuple(want.shape)}"
                worst = max(worst, (got.float() - want.float()).abs().max().item())
    return worst
