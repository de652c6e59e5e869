"""speculators' own scripts on a GPU, run as a user runs them, and every saved sample judged against transformers.

    python tests/gpu/user_scripts.py --scripts SPECULATORS_CHECKOUT/scripts --work DIR --out REPORT.json \\
        [--conversations 160 --batch-size 32 --hidden 2048 --layers 16]

Builds a random bf16 Llama on the GPU (tests/gpu/random_llama.py, with a chat template) and a ShareGPT-style file of
long conversations (600 to 1900 words), then runs, each as ``python -m vllm_compat.cli run -- python SCRIPT ...``
and otherwise unchanged: ``data_generation_offline.py`` (its defaults, ``--batch-size`` as given: 32 sequences of
about 1300 tokens a call need more KV blocks than vLLM 0.34's warm-up commits), ``build_vocab_mapping.py`` and
``train.py`` (one epoch, which must complete and save a checkpoint within ``--train-seconds``). The attention
backend is whatever the environment makes vLLM choose (a host without flash-attention binaries sets TRITON_ATTN
from outside the scripts). A run passes only with no exit-time noise (nanobind leak reports, resource_tracker
warnings) in any script's output.

The judgement, per saved sample and per layer it lists: the states vLLM saved (bf16) and transformers' bf16 forward
of the same ids, each against transformers' float32 forward of the same weights, as max|x - ref32| / max|ref32|.
A layer passes when vLLM's worst error over every sample is at most ``--factor`` times transformers' bf16 worst
error over the same samples plus 1e-3 (as the bench's states check judges): bf16 rounding differs from sample to
sample, and one sample's last layer at 1.8x transformers' own error on that sample is noise, not drift. The states
of the next layer (or the previous, for the last) must fail the same bound, so a mislabelled layer cannot pass.
Samples over the bound taken alone are counted, for the record.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHAT_TEMPLATE = "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"


def log(msg: str) -> None:
    print(f"[user_scripts {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_model(path: Path, hidden: int, layers: int, vocab: int, device: str = "cuda") -> dict:
    sys.path.insert(0, str(HERE.parents[1]))
    from transformers import AutoTokenizer

    from tests.gpu.random_llama import build_random_llama

    shape = build_random_llama(path, hidden=hidden, layers=layers, heads=hidden // 128, kv_heads=max(1, hidden // 512),
                               vocab=vocab, max_positions=4096, device=device)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return shape


def conversations(path: Path, count: int, vocab: int) -> Path:
    rng = random.Random(11)

    def text(n: int) -> str:
        return " ".join(f"w{rng.randrange(0, vocab - 8)}" for _ in range(n))

    rows = [
        {"conversations": [{"from": "human", "value": text(rng.randrange(20, 120))},
                           {"from": "gpt", "value": text(rng.randrange(600, 1900))}]}
        for _ in range(count)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_script(name: str, script: Path, args: list[str], work: Path, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "vllm_compat.cli", "run", "--", sys.executable, str(script), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log(f"{name}: {' '.join(cmd[4:])}")
    t0 = time.perf_counter()
    logfile = work / f"{name}.log"
    with logfile.open("w") as out:
        try:
            rc = subprocess.run(
                cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = round(time.perf_counter() - t0, 1)
    text = logfile.read_text(errors="replace")
    tail = text[-1500:]
    noise = sum(("nanobind: leaked" in line or "resource_tracker" in line) for line in text.splitlines())
    log(f"{name}: rc={rc} in {seconds} s; exit-noise lines {noise}\n{tail[-600:]}")
    return {"rc": rc, "seconds": seconds, "timed_out": rc is None, "tail": tail, "exit_noise_lines": noise}


def judge(model: Path, data: Path, factor: float, device: str = "cuda") -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    config = json.loads((data / "data_config.json").read_text())
    layer_ids = _layer_ids(config)
    models = {
        d: AutoModelForCausalLM.from_pretrained(model, dtype=d).to(device).eval()
        for d in (torch.float32, torch.bfloat16)
    }
    files = sorted(data.glob("data_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    worst = {"vllm": [0.0] * len(layer_ids), "hf_bf16": [0.0] * len(layer_ids), "other_layer": [0.0] * len(layer_ids)}
    over_alone, saved_bytes, state_bytes = [], 0, 0
    for f in files:
        sample = torch.load(f, weights_only=True)
        ids = sample["input_ids"].to(device).view(1, -1)
        refs = {d: _layer_outputs(m, ids, layer_ids) for d, m in models.items()}
        saved_bytes += f.stat().st_size
        state_bytes += sum(t.numel() * t.element_size() for t in sample["hidden_states"])
        for k, got in enumerate(sample["hidden_states"]):
            ref32 = refs[torch.float32][k]
            scale = ref32.abs().max().item()
            err_v = (got.to(device).float() - ref32).abs().max().item() / scale
            err_t = (refs[torch.bfloat16][k].float() - ref32).abs().max().item() / scale
            worst["vllm"][k] = max(worst["vllm"][k], err_v)
            worst["hf_bf16"][k] = max(worst["hf_bf16"][k], err_t)
            if err_v > factor * err_t + 1e-3:
                over_alone.append({"file": f.name, "layer": layer_ids[k], "vllm": err_v, "hf_bf16": err_t})
            j = k + 1 if k + 1 < len(layer_ids) else k - 1
            if layer_ids[k] != layer_ids[j]:
                other = refs[torch.float32][j]
                err_o = (got.to(device).float() - other).abs().max().item() / other.abs().max().item()
                worst["other_layer"][k] = max(worst["other_layer"][k], err_o)
            else:
                worst["other_layer"][k] = float("inf")  # a repeated id: no neighbour to mistake it for
    bound = [factor * t + 1e-3 for t in worst["hf_bf16"]]
    failed = [layer_ids[k] for k, v in enumerate(worst["vllm"]) if v > bound[k]]
    mislabelled = [layer_ids[k] for k, o in enumerate(worst["other_layer"]) if files and o <= bound[k]]
    return {
        "samples": len(files), "layer_ids": layer_ids, "failed": failed, "mislabelled_layer_passes": mislabelled,
        "worst_per_layer": worst, "bound_per_layer": bound, "samples_over_the_bound_alone": len(over_alone),
        "over_the_bound_alone": over_alone[:20],
        "files_over_state_bytes": round(saved_bytes / max(state_bytes, 1), 3),
    }  # fmt: skip


def _layer_ids(config: dict) -> list[int]:
    for key in ("layer_ids", "hidden_states_layer_ids"):
        for where in (config, config.get("generation", {}), config.get("hidden_states", {})):
            if isinstance(where, dict) and key in where:
                return list(where[key])
    raise KeyError(f"no layer ids in data_config.json: {sorted(config)}")


def _layer_outputs(model, ids, layer_ids: list[int]) -> list:
    """The residual stream after each decoder layer in ``layer_ids`` (hooks: the last one is taken before the norm)."""
    import torch

    seen: dict[int, torch.Tensor] = {}
    hooks = [
        model.model.layers[i].register_forward_hook(
            lambda _m, _a, out, i=i: seen.__setitem__(i, (out[0] if isinstance(out, tuple) else out)[0].float())
        )
        for i in sorted(set(layer_ids))
    ]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return [seen[i] for i in layer_ids]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scripts", type=Path, required=True, help="speculators' scripts/ folder, at its release tag")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--conversations", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=32, help="0: the script's own default")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--factor", type=float, default=1.5)
    parser.add_argument("--train-seconds", type=int, default=400)
    args = parser.parse_args()
    work, args.scripts = args.work.resolve(), args.scripts.resolve()
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"scripts": str(args.scripts), "batch_size": args.batch_size}

    def save() -> None:
        args.out.write_text(json.dumps(report, indent=2))

    model, data = work / "model", work / "data"
    report["model"] = build_model(model, args.hidden, args.layers, args.vocab)
    train_file = conversations(work / "conversations.jsonl", args.conversations, args.vocab)
    report["generate"] = run_script(
        "generate", args.scripts / "data_generation_offline.py",
        ["--target-model-path", str(model), "--train-data-path", str(train_file), "--output-dir", str(data),
         *(["--batch-size", str(args.batch_size)] if args.batch_size else [])],
        work, 1200,
    )  # fmt: skip
    save()
    if report["generate"]["rc"] != 0:
        return 1
    report["judged"] = judge(model, data, args.factor)
    log(f"judged: {json.dumps(report['judged'])[:1500]}")
    save()
    report["vocab"] = run_script(
        "vocab", args.scripts / "build_vocab_mapping.py",
        ["--token-freq-path", str(work / "token_freq.pt"), "--draft-vocab-size", "8000", "--target-model-path",
         str(model), "--output-path", str(work / "vocab")],
        work, 600,
    )  # fmt: skip
    save()
    if report["vocab"]["rc"] == 0:
        report["train"] = run_script(
            "train", args.scripts / "train.py",
            ["--verifier-name-or-path", str(model), "--data-path", str(data), "--save-path", str(work / "ckpt"),
             "--epochs", "1", "--d2t-path", str(work / "vocab/d2t.npy"), "--t2d-path", str(work / "vocab/t2d.npy")],
            work, args.train_seconds,
        )  # fmt: skip
        log_text = (work / "train.log").read_text(errors="replace")
        # train.py logs its metrics to --log-dir, not the console; the epoch's end and the checkpoint are the proof
        report["train"]["epoch_completed"] = "Training epoch 1/1 completed" in log_text
        report["train"]["checkpoint_files"] = (
            sorted(str(f.relative_to(work)) for f in (work / "ckpt").rglob("*") if f.is_file())
            if (work / "ckpt").exists()
            else []
        )
        save()
    judged = report["judged"]
    ok = judged["samples"] > 0 and not judged["failed"] and not judged["mislabelled_layer_passes"]
    noisy = sum(report[k]["exit_noise_lines"] for k in ("generate", "vocab", "train") if k in report)
    report["ok"] = (
        ok
        and not noisy
        and report["vocab"]["rc"] == 0
        and (
            report.get("train", {}).get("rc") == 0
            and report["train"]["epoch_completed"]
            and bool(report["train"]["checkpoint_files"])
        )
    )
    save()
    log(f"USER_SCRIPTS {'PASS' if report['ok'] else 'FAIL'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
