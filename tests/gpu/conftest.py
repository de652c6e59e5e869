"""GPU end-to-end fixtures: a random bf16 Llama built on the GPU, prompts, and transformers' bf16 reference states.

The tests here are tests/e2e on a real GPU engine: unchanged speculators code with ``import vllm_compat`` first,
vLLM's CUDA build, bfloat16 on both sides. They are skipped unless a CUDA device, vLLM and speculators are present.
``VLLM_COMPAT_GPU_TESTS_ON_CPU=1`` runs them on vLLM's CPU build instead (bf16 there too), to develop the harness on
a machine without a GPU; it proves nothing about the GPU. ``VLLM_COMPAT_ATTENTION_BACKEND`` (e.g. ``TRITON_ATTN``)
is passed to the harness's ``--attention-backend`` (a host without flash-attention binaries needs ``TRITON_ATTN``).

Tolerance. bfloat16 keeps 8 significant bits (about 2.4 decimal digits): one rounding of a value x is off by up to
|x| * 2**-8 (0.4 %). vLLM and transformers run the same weights through different kernels (fused residual-add +
RMSNorm, Triton or flash attention against SDPA, other GEMM tiling and accumulation order), so each side rounds
differently at every op, and the differences propagate through the layers. Measured on this model against the same
forward in float32 (vLLM's CPU build, bf16): transformers' bf16 is up to 1.3 % of max|ref| off, vLLM's bf16 just as
much, independently, so their difference can approach the sum. The bound for each returned tensor (one sequence,
one layer) is

    max|vLLM - transformers| <= REL_TOL * max|transformers| + ABS_TOL      (REL_TOL = 3e-2, ABS_TOL = 1e-3)

i.e. about eight bf16 roundings of the largest entry, compared in float32. Beside it, each run reports the
float32-accumulated mean error sum|diff| / sum|ref| over every element, and checks against the float32 forward that
vLLM's bf16 is as accurate as transformers' bf16 (mean error within 2x). The bound still separates right from
wrong: a state taken from another sequence, layer or position (the failure the ordering adapters prevent) is off
by the size of the states themselves, and each run checks that every returned state shifted by one position fails
it (on the CPU build such a shift is 25x the bound).
"""

from __future__ import annotations

import functools
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

from tests.e2e.conftest import child_env as e2e_child_env

HERE = Path(__file__).parent
LAYERS = (0, 2, 3)  # first, a middle one, and the last of 4
REL_TOL = 3e-2
ABS_TOL = 1e-3
VOCAB = 4096
MAX_MODEL_LEN = 2048
ON_CPU = os.environ.get("VLLM_COMPAT_GPU_TESTS_ON_CPU", "") == "1"


def record(name: str, value: object) -> None:
    """Print a result line and add it to the JSON report at ``VLLM_COMPAT_GPU_REPORT`` (if set)."""
    name = f"speculators {speculators_version()}: {name}"
    print(f"{name}: {value}")
    report = os.environ.get("VLLM_COMPAT_GPU_REPORT")
    if report:
        path = Path(report)
        data = json.loads(path.read_text()) if path.exists() else {}
        data[name] = value
        path.write_text(json.dumps(data, indent=2))


# The e2e suite's subprocess environment, with a larger CPU KV cache for these larger models (CPU mode).
child_env = functools.partial(e2e_child_env, kv_cache_gib=2)


def speculators_version() -> str:
    """The speculators the tests run against (the first on sys.path, as in the extraction process)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("speculators")
    except PackageNotFoundError:
        return "absent"


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _cuda_devices() -> int:
    if not _have("torch"):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if "gpu" in item.keywords]
    if not ours:
        return
    if not (_have("vllm") and _have("speculators")):
        reason = "needs vLLM and speculators installed"
    elif not ON_CPU and _cuda_devices() == 0:
        reason = "needs a CUDA device"
    else:
        return
    for item in ours:
        item.add_marker(pytest.mark.skip(reason=reason))


def device() -> str:
    return "cpu" if ON_CPU else "cuda"


def prompts() -> list[list[list[int]]]:
    """Calls to generate(): mixed lengths; a second call; >10 sequences (ordering); more tokens than a step holds."""
    rng = random.Random(4321)

    def seq(n: int) -> list[int]:
        return [rng.randrange(4, VOCAB) for _ in range(n)]

    long_call = [seq(700) for _ in range(24)] + [seq(MAX_MODEL_LEN - 1)]
    return [
        [seq(5), seq(37), seq(300), seq(2), seq(11)],
        [seq(64), seq(3), seq(1000)],
        [seq(rng.randrange(2, 300)) for _ in range(12)],  # req_2_10 sorts before req_2_2 as a string
        long_call,  # 18847 tokens > the 8192-token step budget: prompts split across steps
    ]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.gpu.random_llama import build_random_llama

    path = tmp_path_factory.mktemp("random-llama")
    build_random_llama(path, hidden=1024, layers=4, heads=8, kv_heads=4, vocab=VOCAB, std=0.02, device=device())
    return path


@pytest.fixture(scope="session")
def calls() -> list[list[list[int]]]:
    return prompts()


def _load(model_dir: Path, dtype: Any) -> Any:
    """transformers' model in ``dtype``, loaded as such: ``.to(bfloat16)`` after loading would also cast the RoPE
    ``inv_freq`` buffer, and a bf16 ``inv_freq`` puts positions beyond a few hundred tens of percent off."""
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM

    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return AutoModelForCausalLM.from_pretrained(model_dir, **{key: dtype}).to(device()).eval()


@pytest.fixture(scope="session")
def reference(model_dir: Path, calls: list[list[list[int]]]) -> dict[str, dict[tuple[int, ...], list[Any]]]:
    """transformers' residual stream after each layer in LAYERS, per distinct sequence (kept on the CPU).

    ``"bf16"``: the reference the bound applies to; ``"fp32"``: the same forward in float32, to report how far
    each side's bf16 is from it. Forward hooks on the decoder layers (not ``output_hidden_states``, whose last
    entry is after the final norm, while vLLM's capture of the last layer is before it).
    """
    import torch

    refs: dict[str, dict[tuple[int, ...], list[Any]]] = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        model = _load(model_dir, dtype)
        captured: dict[int, Any] = {}
        for layer in LAYERS:
            model.model.layers[layer].register_forward_hook(
                lambda _m, _i, out, layer=layer, sink=captured: sink.__setitem__(
                    layer, out[0] if isinstance(out, tuple) else out
                )
            )
        refs[name] = {}
        with torch.no_grad():
            for call in calls:
                for ids in call:
                    if tuple(ids) not in refs[name]:
                        model(torch.tensor([ids], device=device()), logits_to_keep=1)
                        refs[name][tuple(ids)] = [captured[layer][0].cpu() for layer in LAYERS]
        del model
    if device() == "cuda":
        torch.cuda.empty_cache()  # the engine under test wants 80 % of the device
    return refs


@dataclass
class Extraction:
    returncode: int
    stderr: str
    data: dict[str, Any] | None


def run_extract(
    model: Path,
    calls: list[list[list[int]]],
    tmp: Path,
    *,
    compat: bool = True,
    env: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
) -> Extraction:
    """Run tests/gpu/extract.py (tests/e2e/extract.py plus the attention backend) in a fresh interpreter."""
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
        ",".join(map(str, LAYERS)),
        "--out",
        str(out),
        "--max-model-len",
        str(MAX_MODEL_LEN),
    ]
    backend = os.environ.get("VLLM_COMPAT_ATTENTION_BACKEND")
    if backend and not ON_CPU:
        cmd += ["--attention-backend", backend]
    if not compat:
        cmd.append("--no-compat")
    cmd += extra_args or []
    full_env = child_env(env)
    if not compat:
        full_env["VLLM_COMPAT_DISABLE"] = "1"
    done = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=900, check=False)
    data = None
    if done.returncode == 0 and out.exists():
        import torch

        data = torch.load(out, weights_only=False)
    return Extraction(done.returncode, done.stderr[-6000:], data)


@dataclass
class Comparison:
    """How the returned states compare with transformers', over every call, sequence and layer."""

    tensors: int = 0
    max_abs_diff: float = 0.0  # vs transformers bf16, over all tensors
    worst_ratio: float = 0.0  # max over tensors of max|diff| / (REL_TOL * max|ref| + ABS_TOL); must stay <= 1
    worst_rel: float = 0.0  # max over tensors of max|diff| / max|ref|
    mean_rel: float = 0.0  # sum|diff| / sum|ref| over every element (float32 values, float64 sums)
    max_ref: float = 0.0
    shifted_min_ratio: float = float("inf")  # min over tensors of the same ratio for states shifted by one row
    # distance to transformers' float32 forward: vLLM bf16 and transformers bf16 side by side
    vllm_vs_fp32_worst_rel: float = 0.0
    vllm_vs_fp32_mean_rel: float = 0.0
    hf_bf16_vs_fp32_worst_rel: float = 0.0
    hf_bf16_vs_fp32_mean_rel: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def compare(outputs: list[list[dict[str, Any]]], calls: list[list[list[int]]], reference: dict) -> Comparison:
    """Compare every returned tensor with the references; asserts order, count, shape and dtype on the way."""
    import torch

    cmp = Comparison()
    sums = dict.fromkeys(("diff", "ref", "vllm32", "hf32", "ref32"), 0.0)
    for call, results in zip(calls, outputs, strict=True):
        assert len(results) == len(call)
        for ids, result in zip(call, results, strict=True):
            assert result["input_ids"].tolist() == ids, "results are not in input order"
            states = result["hidden_states"]
            assert len(states) == len(LAYERS)
            pairs = zip(states, reference["bf16"][tuple(ids)], reference["fp32"][tuple(ids)], strict=True)
            for got, want, truth in pairs:
                assert tuple(got.shape) == tuple(want.shape), f"shape {tuple(got.shape)} != {tuple(want.shape)}"
                assert got.dtype == torch.bfloat16, f"vLLM returned {got.dtype}"
                got32, want32, truth32 = got.float(), want.float(), truth.float()
                diff = (got32 - want32).abs()
                peak = want32.abs().max().item()
                bound = REL_TOL * peak + ABS_TOL
                cmp.tensors += 1
                cmp.max_abs_diff = max(cmp.max_abs_diff, diff.max().item())
                cmp.worst_ratio = max(cmp.worst_ratio, diff.max().item() / bound)
                cmp.worst_rel = max(cmp.worst_rel, diff.max().item() / peak)
                cmp.max_ref = max(cmp.max_ref, peak)
                peak32 = truth32.abs().max().item()
                vllm32, hf32 = (got32 - truth32).abs(), (want32 - truth32).abs()
                cmp.vllm_vs_fp32_worst_rel = max(cmp.vllm_vs_fp32_worst_rel, vllm32.max().item() / peak32)
                cmp.hf_bf16_vs_fp32_worst_rel = max(cmp.hf_bf16_vs_fp32_worst_rel, hf32.max().item() / peak32)
                sums["diff"] += diff.sum(dtype=torch.float64).item()
                sums["ref"] += want32.abs().sum(dtype=torch.float64).item()
                sums["vllm32"] += vllm32.sum(dtype=torch.float64).item()
                sums["hf32"] += hf32.sum(dtype=torch.float64).item()
                sums["ref32"] += truth32.abs().sum(dtype=torch.float64).item()
                if got.shape[0] > 1:  # what a one-row misattribution would look like
                    shifted = (got32[1:] - want32[:-1]).abs().max().item()
                    cmp.shifted_min_ratio = min(cmp.shifted_min_ratio, shifted / bound)
    cmp.mean_rel = sums["diff"] / sums["ref"]
    cmp.vllm_vs_fp32_mean_rel = sums["vllm32"] / sums["ref32"]
    cmp.hf_bf16_vs_fp32_mean_rel = sums["hf32"] / sums["ref32"]
    return cmp
