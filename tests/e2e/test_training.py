"""The training step end to end: speculators' offline EAGLE-3 pipeline, unchanged, under ``vllm-compat run``.

Three stages, each a fresh ``vllm-compat run -- python train_pipeline.py STAGE`` (tests/e2e/train_pipeline.py follows
speculators' data_generation_offline.py, build_vocab_mapping.py and train.py): preprocess a conversation file with
speculators' own preprocessing, extract hidden states with speculators' generator on a real vLLM engine and save one
``.pt`` per sample, build the draft vocabulary mapping, then run speculators' EAGLE-3 trainer for one epoch
(optimizer steps, validation, checkpoint) on that data. The saved hidden states are checked against transformers on
the same weights; the trainer must change the draft model's weights and write a checkpoint that loads back.

Data generation runs twice: in float32 with one call of more than 32 sequences (states within 1e-4 of transformers'),
and on the script's own defaults (``dtype="auto"``, i.e. bfloat16 on vLLM's CPU platform, ``--batch-size`` 8,
``--tensor-parallel-size`` ``torch.accelerator.device_count()``, 0 here), compared with a bfloat16 tolerance.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import BF16_RELATIVE_TOLERANCE, TOLERANCE
from tests.e2e.report import record

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent
PIPELINE = HERE / "train_pipeline.py"
LAYER_IDS = (0, 1, 2, 3)  # three auxiliary layers for EAGLE-3's fusion, then the last one (the verifier's states)
DRAFT_VOCAB = 64
CHAT_TEMPLATE = "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
CONFIG_ADAPTERS = {"speculator-config-init", "speculator-config-schema", "speculator-config-validate"}
SAMPLES = 36  # one call of them all: more than the 32 sequences speculators' scheduler runs at once
SCRIPT_BATCH_SIZE = 8  # data_generation_offline.py's default --batch-size


def _transformers_major() -> int:
    from vllm_compat.versions import installed_version

    version = installed_version("transformers")
    return version.major if version else 0


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a chat template, which speculators' preprocessing requires."""
    from transformers import AutoTokenizer

    from tests.e2e.tiny_model import build_tiny_llama

    path = build_tiny_llama(tmp_path_factory.mktemp("tiny-chat-llama"), num_layers=4)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def conversations(path: Path, count: int = SAMPLES) -> Path:
    """A ShareGPT-style JSONL file (the format speculators' preprocessing reads), words of the tiny vocabulary."""
    rng = random.Random(7)

    def text(n: int) -> str:
        return " ".join(f"w{rng.randrange(0, 500)}" for _ in range(n))

    rows = [
        {"conversations": [{"from": "human", "value": text(rng.randrange(4, 20))}, {"from": "gpt", "value": text(n)}]}
        for n in (rng.randrange(8, 40) for _ in range(count))
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_stage(
    stage: str, args: list[str], work: Path, *, compat: bool = True
) -> tuple[subprocess.CompletedProcess, dict]:
    """``vllm-compat run -- python train_pipeline.py --report R STAGE ARGS`` in a fresh process tree."""
    report = work / f"{stage}{'' if compat else '-plain'}.json"
    report.unlink(missing_ok=True)
    script = [sys.executable, str(PIPELINE), "--report", str(report), stage, *args]
    cmd = [sys.executable, "-m", "vllm_compat.cli", "run", "--", *script] if compat else script
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(work / "hf-datasets"),
    }
    env.pop("VLLM_COMPAT_DISABLE", None)
    done = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=1200, check=False)
    data = json.loads(report.read_text()) if report.exists() else {}
    return done, data


@pytest.fixture(scope="module")
def pipeline(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if importlib.util.find_spec("datasets") is None:
        pytest.skip("speculators' preprocessing and vocabulary code need the `datasets` package")
    work = tmp_path_factory.mktemp("train-pipeline")
    data, freq = work / "data", work / "token_freq.pt"
    runs: dict[str, Any] = {"work": work, "data": data, "model": chat_model}
    done, report = run_stage(
        "generate",
        [
            "--target-model-path", str(chat_model),
            "--train-data-path", str(conversations(work / "conversations.jsonl")),
            "--output-dir", str(data),
            "--layer-ids", *map(str, LAYER_IDS),
            "--seq-length", "256",
            "--batch-size", str(SAMPLES),
            "--token-freq-path", str(freq),
            "--dtype", "float32",
        ],
        work,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    runs["generate"] = report
    runs["generate_log"] = done.stderr
    vocab = work / "vocab"
    done, report = run_stage(
        "vocab",
        ["--token-freq-path", str(freq), "--draft-vocab-size", str(DRAFT_VOCAB), "--target-vocab-size", "512",
         "--output-path", str(vocab)],
        work,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    runs["vocab"] = report
    runs["vocab_dir"] = vocab
    runs["train_args"] = [
        "--verifier-name-or-path", str(chat_model),
        "--data-path", str(data),
        "--save-path", str(work / "checkpoints"),
        "--d2t-path", str(vocab / "d2t.npy"),
        "--t2d-path", str(vocab / "t2d.npy"),
        "--device", "cpu",
        "--attention", "dense",
    ]  # fmt: skip
    done, report = run_stage("train", [*runs["train_args"], "--check-attention"], work)
    assert done.returncode == 0, done.stderr[-6000:]
    runs["train"] = report
    return runs


def compare_samples(data: Path, model_path: Path) -> tuple[float, float]:
    """Every saved sample against transformers (float32) on the same weights: the largest absolute difference, and
    the largest relative one (per sample and layer: max |diff| / max |state|). Checks the sample's layout on the way."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    captured: dict[int, torch.Tensor] = {}
    for layer in LAYER_IDS:  # each decoder layer's output: the residual stream (the last one before the final norm)
        model.model.layers[layer].register_forward_hook(
            lambda _m, _i, out, layer=layer: captured.__setitem__(layer, out[0] if isinstance(out, tuple) else out)
        )
    worst = worst_relative = 0.0
    for path in sorted(data.glob("data_*.pt")):
        sample = torch.load(path, weights_only=True)
        assert set(sample) == {"input_ids", "hidden_states", "loss_mask"}
        n = sample["input_ids"].shape[0]
        assert sample["loss_mask"].shape == (n,) and 0 < int(sample["loss_mask"].sum()) < n  # assistant turns only
        assert len(sample["hidden_states"]) == len(LAYER_IDS)
        with torch.no_grad():
            model(sample["input_ids"][None])
        for layer, got in zip(LAYER_IDS, sample["hidden_states"], strict=True):
            want = captured[layer][0]
            assert got.shape == want.shape == (n, 64)
            diff = (got.float() - want).abs().max().item()
            worst = max(worst, diff)
            worst_relative = max(worst_relative, diff / want.abs().max().item())
    return worst, worst_relative


def summary_lines(log: str) -> list[str]:
    """The guard's one summary line per process, from a stage's stderr."""
    return [line for line in log.splitlines() if "vllm_compat" in line and "vllm-compat: vLLM " in line]


def test_samples_are_saved_as_speculators_saves_them(pipeline: dict[str, Any]) -> None:
    generated = pipeline["generate"]
    assert generated["status"]["installed"], "vllm-compat was not active in the script"
    assert generated["workers"] and all(w["installed"] for w in generated["workers"]), generated["workers"]
    assert all(w["pid"] != generated["pid"] for w in generated["workers"])
    assert generated["vllm_dtype"] == "torch.float32"
    assert generated["layer_ids"] == list(LAYER_IDS)
    assert generated["calls"] == [SAMPLES], "one generate() call of more than 32 sequences"
    assert len(summary_lines(pipeline["generate_log"])) == 1, pipeline["generate_log"][-3000:]

    files = sorted(pipeline["data"].glob("data_*.pt"))
    assert len(files) == generated["samples"] == SAMPLES
    assert (pipeline["data"] / "data_config.json").exists()
    assert (pipeline["data"] / "sample_lengths.json").exists() == (generated["line"] == "0.4.0.1")
    worst, _relative = compare_samples(pipeline["data"], pipeline["model"])
    record("training_samples_max_abs_diff", worst)
    assert worst < TOLERANCE


@pytest.fixture(scope="module")
def script_defaults(pipeline: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The data-generation stage on the script's defaults: no --dtype, --batch-size or --tensor-parallel-size."""
    work = tmp_path_factory.mktemp("script-defaults")
    data = work / "data"
    done, report = run_stage(
        "generate",
        [
            "--target-model-path", str(pipeline["model"]),
            "--train-data-path", str(pipeline["work"] / "conversations.jsonl"),
            "--output-dir", str(data),
            "--layer-ids", *map(str, LAYER_IDS),
            "--token-freq-path", str(work / "token_freq.pt"),
        ],
        work,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    return {"report": report, "log": done.stderr, "data": data}


def test_the_scripts_defaults(pipeline: dict[str, Any], script_defaults: dict[str, Any]) -> None:
    """dtype="auto" (bfloat16 on vLLM's CPU platform), batches of 8, tensor_parallel_size from the accelerator count."""
    import torch

    generated, log = script_defaults["report"], script_defaults["log"]
    assert generated["status"]["installed"]
    assert generated["vllm_dtype"] == "torch.bfloat16"
    full, rest = divmod(SAMPLES, SCRIPT_BATCH_SIZE)
    assert generated["calls"] == [SCRIPT_BATCH_SIZE] * full + ([rest] if rest else [])
    assert generated["tensor_parallel_size_asked"] == torch.accelerator.device_count()
    assert generated["tensor_parallel_size"] == max(1, torch.accelerator.device_count())
    if generated["tensor_parallel_size_asked"] == 0:
        assert "cpu-tensor-parallel-zero" in generated["status"]["applied"]
        assert "tensor_parallel_size=0" in log and "using 1" in log
    lines = summary_lines(log)
    assert len(lines) == 1, log[-3000:]
    assert f"line {generated['line']}, judged from its code" in lines[0] and "0 unhandled" in lines[0]
    assert len(list(script_defaults["data"].glob("data_*.pt"))) == generated["samples"] == SAMPLES
    # the run's metadata is written to its end, on a host without the accelerator torch was built for too
    metadata = (script_defaults["data"] / "data_config.json").read_text()
    if torch.accelerator.current_accelerator(check_available=True) is None:
        assert "cpu only" in metadata.lower(), metadata[:2000]
        if torch.accelerator.current_accelerator() is not None and generated["line"] == "0.4.0.1":
            assert "accelerator-name-without-driver" in generated["status"]["applied"]
    worst, relative = compare_samples(script_defaults["data"], pipeline["model"])
    record("script_defaults_bf16_max_abs_diff", worst)
    record("script_defaults_bf16_max_relative_diff", relative)
    assert relative < BF16_RELATIVE_TOLERANCE


def test_vocabulary_mapping(pipeline: dict[str, Any]) -> None:
    import numpy as np

    assert pipeline["vocab"]["d2t"] == [DRAFT_VOCAB] and pipeline["vocab"]["t2d"] == [512]
    d2t, t2d = np.load(pipeline["vocab_dir"] / "d2t.npy"), np.load(pipeline["vocab_dir"] / "t2d.npy")
    assert int(t2d.sum()) == DRAFT_VOCAB
    assert sorted((np.arange(DRAFT_VOCAB) + d2t).tolist()) == np.flatnonzero(t2d).tolist()


def test_speculators_trainer_steps_and_saves(pipeline: dict[str, Any]) -> None:
    trained = pipeline["train"]
    record("training_steps", trained["steps"])
    record("training_loss", [m["loss"] for m in trained["train_metrics"]])
    record("training_seconds", trained["seconds"])
    record("training_applied", sorted(trained["status"].get("applied", {})))
    assert trained["status"]["installed"]
    assert trained["attention_max_abs_diff"] < 1e-5, "the dense stand-in differs from FlexAttention"
    assert trained["steps"] >= 1
    assert trained["train_metrics"] and all(math.isfinite(m["loss"]) for m in trained["train_metrics"])
    assert trained["val_files"] >= 1 and trained["val_metrics"]
    assert {"fc.weight", "lm_head.weight"} <= set(trained["changed"])
    assert set(trained["changed"]) == set(trained["trainable"]), "some trainable weights did not move"
    assert {"config.json", "model.safetensors"} <= set(trained["checkpoint_files"])
    reloaded = {"class": "Eagle3SpeculatorConfig", "draft_vocab_size": DRAFT_VOCAB, "hidden_size": 64}
    assert trained["reloaded"] == reloaded
    applied = set(trained["status"]["applied"])
    if _transformers_major() >= 5:
        assert applied >= CONFIG_ADAPTERS
    else:
        assert not applied & CONFIG_ADAPTERS


# Builds and saves a speculators EAGLE-3 config, as the training script and the trainer's checkpoint do, with one of
# the speculator-config adapters switched off (its apply() made a no-op before vllm-compat installs).
WITHOUT_ONE = """
import os, sys, tempfile
os.environ["VLLM_COMPAT_DISABLE"] = "1"
import vllm_compat
from vllm_compat.adapter import load_adapters
off = sys.argv[1]
if off != "none":
    load_adapters()[off].apply = lambda self, module: None
vllm_compat.install()
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from transformers import LlamaConfig
stage = "build"
try:
    config = Eagle3SpeculatorConfig(transformer_layer_config=LlamaConfig(hidden_size=64), draft_vocab_size=8)
    stage = "save"
    config.save_pretrained(tempfile.mkdtemp())
    stage = "ok"
except Exception as exc:
    print(stage, type(exc).__name__, str(exc).splitlines()[0])
    sys.exit(1)
print("ok")
"""


@pytest.mark.parametrize(
    ("off", "fails_at"),
    [
        ("none", "ok"),
        ("speculator-config-init", "build AttributeError"),
        ("speculator-config-schema", "build PydanticUserError"),
        ("speculator-config-validate", "save TypeError"),
    ],
)
def test_each_config_adapter_is_needed(off: str, fails_at: str, tmp_path: Path) -> None:
    """Under transformers 5, each speculator-config adapter is what makes its step work; under 4 none is needed."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_COMPAT_DISABLE"}
    done = subprocess.run(  # cwd: not the checkout, whose vllm_compat/ folder would shadow the installed package
        [sys.executable, "-c", WITHOUT_ONE, off],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    got = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    if _transformers_major() < 5:
        assert got == "ok", got
    else:
        assert got.startswith(fails_at), got


def test_training_without_vllm_compat(pipeline: dict[str, Any]) -> None:
    """Without vllm-compat, speculators' training breaks exactly where transformers 5 is installed."""
    done, _report = run_stage("train", pipeline["train_args"], pipeline["work"], compat=False)
    last = [line for line in done.stderr.strip().splitlines() if line.strip()][-1:]
    record("training_without_compat", "passes" if done.returncode == 0 else f"fails: {last[0] if last else ''}")
    if _transformers_major() >= 5:
        assert done.returncode != 0
    else:
        assert done.returncode == 0, done.stderr[-3000:]
