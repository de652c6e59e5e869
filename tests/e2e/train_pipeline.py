"""speculators' offline EAGLE-3 pipeline, three stages as its three scripts run them; it never imports vllm_compat.

The end-to-end training test runs each stage as ``vllm-compat run -- python train_pipeline.py STAGE ...``, the way a
user runs speculators' own scripts unchanged. Each stage calls the speculators functions its script calls, in the
same order, with the same arguments and the script's defaults (those of the installed release's scripts, 0.3.0 or
0.4.0.1, where they differ):

- ``generate``: scripts/data_generation_offline.py: ``logging.basicConfig(INFO)``; ``load_and_preprocess_dataset``
  (tokenise a conversation file with the chat template, loss masks, token frequencies); the resume point from the
  files already saved; ``VllmHiddenStatesGenerator(model_path, layer_ids, max_model_len=seq_length,
  gpu_memory_utilization, tensor_parallel_size)`` with ``--tensor-parallel-size`` defaulting to
  ``torch.accelerator.device_count()`` (0 on a CPU host) and ``--batch-size`` to 8; one ``generate()`` call per
  batch; each sample saved as ``data_{i}.pt`` (``input_ids``, ``hidden_states`` one tensor per layer, ``loss_mask``)
  on a pool of 4 threads; ``sample_lengths.json`` (0.4.0.1); ``DataGenerationConfig.from_generator`` ->
  ``data_config.json``. vLLM computes in the model's dtype, ``dtype="auto"`` (bfloat16 on vLLM's CPU platform);
- ``vocab``: scripts/build_vocab_mapping.py: ``build_vocab_mappings_from_distribution`` -> ``d2t.npy``, ``t2d.npy``
  in the ``--output-path`` folder;
- ``train``: scripts/train.py: the draft layer config from the verifier's, then for 0.3.0 ``Eagle3SpeculatorConfig``
  and ``Eagle3DraftModel`` built by hand, for 0.4.0.1 ``set_seed``, ``SpeculatorModel.registry["eagle3"]
  .from_training_args(...)`` and ``get_trainer_kwargs(...)`` with the script's argument defaults;
  ``Eagle3SampleFileDataset`` with the multipack batch sampler and speculators' collate function,
  ``Trainer(...).run_training()`` (optimizer steps, validation, checkpoint).

What differs from those scripts, each a test-harness choice forced by running on a 2-core CPU, not by vLLM:

- ``--dtype float32`` (generate, when given) keeps vLLM's CPU backend from computing a float32 checkpoint in
  bfloat16, so saved states can be compared with transformers at 1e-4 (as tests/e2e/extract.py does); without it the
  script's ``dtype="auto"`` runs and the comparison uses a bfloat16 tolerance;
- ``--num-preprocessing-workers`` defaults to 1 (the script's 8 worker processes on 2 cores);
- ``--device cpu`` (train): speculators' trainer moves the model and batches to ``local_rank``, a CUDA device; here
  ``TrainerConfig(local_rank="cpu")``;
- ``--attention dense`` (train): torch's FlexAttention, which speculators' draft model uses
  (``simple_flex_attention``), has no backward pass on CPU. The draft layers use a dense equivalent registered here:
  speculators' own ``block_mask_to_dense_attention_mask`` of the same BlockMask, then scaled dot-product attention.
  ``--check-attention`` compares the two on the masks the model builds (forward only, which FlexAttention runs on
  CPU) and records the difference;
- data loaders without worker processes (the script's 12, pinned memory, persistent workers); speculators' metric
  loggers replaced by a handler that keeps the metrics; one epoch; tiny model, sequence and vocabulary sizes;

Not a harness choice: on a host without the accelerator torch was built for (PyPI's plain ``torch`` wheel, a CUDA
build, beside vLLM's CPU build), speculators 0.4.0.1's ``DataGenerationConfig.from_generator`` fails asking for the
GPU's name; vllm-compat's ``accelerator-name-without-driver`` makes the metadata say "CPU ONLY" there, and this
stage runs speculators' code as it is.

Each stage writes what it did to ``--report`` (JSON), including ``vllm_compat.status()`` when vllm-compat is active in
the process (read from ``sys.modules``: the script does not import it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path


def compat_status() -> dict:
    module = sys.modules.get("vllm_compat")
    return module.status() if module is not None else {}


def write_report(path: str | None, data: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2, default=str))


# -- stage 1: scripts/data_generation_offline.py ------------------------------------------------------------------
MAX_IO_WORKERS = 4  # the script's thread pool for saving samples


def generate(args: argparse.Namespace) -> dict:
    import torch
    from datasets import config as datasets_config
    from speculators.data_generation.config_generator import DataGenerationConfig
    from speculators.data_generation.preprocessing import load_and_preprocess_dataset
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    started = time.perf_counter()
    # main(): preprocess (cached by datasets), with the script's arguments
    dataset, _tokenizer = load_and_preprocess_dataset(
        target_model_path=args.target_model_path,
        train_data_path=args.train_data_path,
        seq_length=args.seq_length,
        build_dataset_num_proc=args.num_preprocessing_workers,
        seed=args.seed,
        max_samples=args.max_samples,
        token_freq_path=args.token_freq_path,
        cache_dir=args.hf_cache_dir,
        assistant_pattern=args.assistant_pattern,
        turn_dropout=args.turn_dropout,
    )
    if args.dtype:
        _force_dtype(args.dtype)
    # generate_and_save_hidden_states(): resume point, generator, batches, saves on a thread pool, lengths, config
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    start_file_idx = _find_last_checkpoint(output_dir)
    lengths_path = output_dir / "sample_lengths.json"
    sample_lengths = json.loads(lengths_path.read_text()) if start_file_idx > 0 and lengths_path.exists() else {}
    num_samples = len(dataset)
    start_sample_idx = start_file_idx - args.start_idx
    generator = VllmHiddenStatesGenerator(
        model_path=args.target_model_path,
        layer_ids=args.layer_ids,
        max_model_len=args.seq_length,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    initialised = time.perf_counter()
    file_idx, calls = start_file_idx, []
    with ThreadPoolExecutor(max_workers=MAX_IO_WORKERS) as thread_executor:
        futures = []
        for i in range(start_sample_idx, num_samples, args.batch_size):
            batch = dataset[i : min(i + args.batch_size, num_samples)]
            batch_loss_mask = batch["loss_mask"]
            results = generator.generate(batch["input_ids"])
            calls.append(len(results))
            for j, result in enumerate(results):
                input_len = len(result["input_ids"])
                sample_lengths[str(file_idx)] = input_len
                sample = {
                    "input_ids": result["input_ids"],
                    "hidden_states": [h.contiguous() for h in result["hidden_states"]],
                    "loss_mask": batch_loss_mask[j][:input_len],
                }
                futures.append(thread_executor.submit(torch.save, sample, output_dir / f"data_{file_idx}.pt"))
                file_idx += 1
        for future in as_completed(futures):
            future.result()
    if _line() == "0.4.0.1":  # 0.3.0's script keeps no sample lengths
        lengths_path.write_text(json.dumps(sample_lengths, indent=2))
    config = DataGenerationConfig.from_generator(
        generator=generator,
        train_data_path=args.train_data_path,
        seq_length=args.seq_length,
        cache_dir=str(args.hf_cache_dir if args.hf_cache_dir else datasets_config.HF_DATASETS_CACHE),
        num_samples=num_samples,
        max_samples=args.max_samples,
        seed=args.seed,
    )
    (output_dir / "data_config.json").write_text(json.dumps(config.to_dict(), indent=2))
    workers = generator.executor.collective_rpc(_worker_report)
    vllm_dtype = str(generator.vllm_config.model_config.dtype)
    generator.executor.shutdown()
    return {
        "samples": file_idx - start_file_idx,
        "calls": calls,
        "layer_ids": list(generator.layer_ids),
        "vllm_dtype": vllm_dtype,
        "tensor_parallel_size_asked": args.tensor_parallel_size,
        "tensor_parallel_size": generator.tensor_parallel_size,
        "line": _line(),
        "preprocess_seconds": initialised - started,
        "seconds": time.perf_counter() - started,
        "workers": workers,
    }


def _find_last_checkpoint(output_dir: Path) -> int:
    """The script's resume point: one past the highest ``data_{i}.pt`` already saved."""
    indices = [int(p.stem[5:]) for p in output_dir.glob("data_*.pt") if p.stem[5:].isdigit()]
    return max(indices) + 1 if indices else 0


def _line() -> str:
    """Which release's scripts to follow: 0.4.0.1's train.py builds the draft model through
    ``SpeculatorModel.from_training_args``, which 0.3.0 lacks."""
    from speculators.model import SpeculatorModel

    return "0.4.0.1" if hasattr(SpeculatorModel, "from_training_args") else "0.3.0"


def _worker_report(worker) -> dict:
    """Runs inside each vLLM worker: what vllm-compat did there (it was started by the bootstrap, not imported)."""
    module = sys.modules.get("vllm_compat")
    return {**(module.status() if module else {}), "pid": os.getpid()}


def _force_dtype(dtype: str) -> None:
    from speculators.data_generation import vllm_hidden_states_generator as module

    original = module.ModelConfig

    def model_config(*args, **kwargs):
        kwargs["dtype"] = dtype
        return original(*args, **kwargs)

    module.ModelConfig = model_config


# -- stage 2: scripts/build_vocab_mapping.py ------------------------------------------------------------------------
def vocab(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import AutoConfig

    token_freq_path = Path(args.token_freq_path)
    if not token_freq_path.exists():
        raise FileNotFoundError(f"Token frequency file not found: {token_freq_path}")
    token_freq_dict = torch.load(token_freq_path, weights_only=True)
    if (args.target_vocab_size is None) == (args.target_model_path is None):
        raise ValueError("give exactly one of --target-vocab-size and --target-model-path (as the script requires)")
    if args.target_vocab_size is not None:
        target_vocab_size = args.target_vocab_size
    else:
        config = AutoConfig.from_pretrained(args.target_model_path)
        if _line() == "0.4.0.1" and hasattr(config, "text_config"):  # 0.4.0.1: multimodal models
            config = config.text_config
        target_vocab_size = config.vocab_size
    d2t, t2d = build_vocab_mappings_from_distribution(
        token_freq_dict=token_freq_dict,
        draft_vocab_size=args.draft_vocab_size,
        target_vocab_size=target_vocab_size,
    )
    output_path = Path(args.output_path)
    output_path.mkdir(parents=True, exist_ok=True)
    np.save(output_path / "d2t.npy", d2t.cpu().numpy())
    np.save(output_path / "t2d.npy", t2d.cpu().numpy())
    return {"d2t": list(d2t.shape), "t2d": list(t2d.shape), "distinct_tokens": len(token_freq_dict)}


# -- stage 3: scripts/train.py --------------------------------------------------------------------------------------
def train(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.train.data import Eagle3SampleFileDataset, create_collate_fn, split_files, standardize_data_v1
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from speculators.train.noise_transforms import AddUniformNoise
    from speculators.train.trainer import Trainer, TrainerConfig
    from torch.utils.data import DataLoader

    line = _line()
    script_args = _train_script_args(args)
    if line == "0.4.0.1":
        _set_seed(args.seed)  # 0.4.0.1's set_seed(args.seed, args.deterministic_cuda)
    else:
        torch.manual_seed(args.seed)
    metrics = _capture_metrics()
    report: dict = {"line": line}
    if args.attention == "dense":
        _register_dense_attention()
        if args.check_attention:
            report["attention_max_abs_diff"] = _check_attention()

    device = torch.device(args.device)
    d2t = torch.from_numpy(np.load(args.d2t_path)).to(device)
    t2d = torch.from_numpy(np.load(args.t2d_path)).to(device)
    draft_vocab_size = d2t.shape[0]
    transformer_layer_config = _transformer_layer_config(args, line)
    if line == "0.4.0.1":  # the draft model from speculators' registry and the script's arguments
        from speculators.model import SpeculatorModel

        if SpeculatorModel.registry_auto_discovery:
            SpeculatorModel.auto_populate_registry()
        model_class = SpeculatorModel.registry[script_args["speculator_type"]]
        draft_model = model_class.from_training_args(
            verifier_config=transformer_layer_config, t2d=t2d, d2t=d2t, draft_vocab_size=draft_vocab_size,
            **script_args,
        )  # fmt: skip
    else:  # 0.3.0 builds the config by hand
        from speculators.config import SpeculatorsConfig, VerifierConfig
        from speculators.models.eagle3 import Eagle3DraftModel
        from speculators.proposals.greedy import GreedyTokenProposalConfig

        speculator_config = Eagle3SpeculatorConfig(
            transformer_layer_config=transformer_layer_config,
            draft_vocab_size=draft_vocab_size,
            norm_before_residual=True,
            speculators_config=SpeculatorsConfig(
                algorithm="eagle3",
                proposal_methods=[GreedyTokenProposalConfig(proposal_type="greedy", speculative_tokens=args.ttt_steps)],
                default_proposal_method="greedy",
                verifier=VerifierConfig(name_or_path=args.verifier_name_or_path, architectures=["LlamaForCausalLM"]),
            ),
        )
        draft_model = Eagle3DraftModel(config=speculator_config, t2d=t2d, d2t=d2t)
    before = {k: v.detach().clone() for k, v in draft_model.named_parameters() if v.requires_grad}

    def loader(files: list, noise: bool) -> DataLoader:
        dataset = Eagle3SampleFileDataset(
            file_list=files,
            max_len=args.total_seq_len,
            transform=AddUniformNoise(std=0.05, tensors=("hidden_states", "verifier_last_hidden_states"))
            if noise
            else None,
            standardize_fn=standardize_data_v1,
        )
        sampler = MultipackDistributedBatchSamplerV2(
            batch_max_length=args.total_seq_len, lengths=dataset.approx_lengths, num_replicas=1, rank=0
        )
        collate = create_collate_fn(args.total_seq_len)
        return DataLoader(dataset, batch_sampler=sampler, num_workers=0, collate_fn=collate)

    train_files, val_files = split_files(args.data_path, ratio=0.9)
    train_loader, val_loader = loader(train_files, True), (loader(val_files, False) if val_files else None)
    local_rank = args.device if args.device == "cpu" else int(args.device.split(":")[-1])
    if line == "0.4.0.1":
        train_call_kwargs, val_call_kwargs = model_class.get_trainer_kwargs(**script_args)
        config = TrainerConfig(
            num_epochs=args.epochs,
            save_path=args.save_path,
            lr=args.lr,
            resume_from_checkpoint=not script_args["no_resume_from_checkpoint"],
            is_distributed=False,
            local_rank=local_rank,
            train_call_kwargs=train_call_kwargs,
            val_call_kwargs=val_call_kwargs,
            scheduler_type=script_args["scheduler_type"],
            scheduler_warmup_steps=script_args["scheduler_warmup_steps"],
            scheduler_total_steps=script_args["scheduler_total_steps"],
            scheduler_num_cosine_cycles=script_args["scheduler_num_cosine_cycles"],
        )
    else:
        call_kwargs = {"use_off_policy_tokens": False, "ttt_steps": args.ttt_steps, "ttt_step_loss_decay": 1.0}
        config = TrainerConfig(
            num_epochs=args.epochs,
            save_path=args.save_path,
            lr=args.lr,
            resume_from_checkpoint=False,
            is_distributed=False,
            local_rank=local_rank,
            train_call_kwargs=call_kwargs,
            val_call_kwargs=call_kwargs,
        )
    trainer = Trainer(draft_model, config, train_loader, val_loader)
    started = time.perf_counter()
    trainer.run_training()
    changed = [k for k, v in draft_model.named_parameters() if k in before and not torch.equal(before[k], v.detach())]
    checkpoint = Path(args.save_path) / str(args.epochs - 1)
    reloaded = Eagle3SpeculatorConfig.from_pretrained(checkpoint)
    return {
        **report,
        "train_files": len(train_files),
        "val_files": len(val_files),
        "steps": trainer.global_step,
        "train_metrics": [m["train"] for m in metrics if "train" in m],
        "val_metrics": [m["val"] for m in metrics if "val" in m],
        "trainable": sorted(before),
        "changed": sorted(changed),
        "checkpoint_files": sorted(p.name for p in checkpoint.iterdir()),
        "reloaded": {
            "class": type(reloaded).__name__,
            "draft_vocab_size": reloaded.draft_vocab_size,
            "hidden_size": reloaded.transformer_layer_config.hidden_size,
        },
        "seconds": time.perf_counter() - started,
    }


def _train_script_args(args: argparse.Namespace) -> dict:
    """``vars(args)`` as 0.4.0.1's train.py parses them: its defaults, with the values this harness passes."""
    return {
        "verifier_name_or_path": args.verifier_name_or_path,
        "speculator_type": "eagle3",
        "data_path": args.data_path,
        "save_path": args.save_path,
        "epochs": args.epochs,
        "lr": args.lr,
        "no_resume_from_checkpoint": True,  # a fresh run
        "logger": "",
        "total_seq_len": args.total_seq_len,
        "log_dir": "./logs",
        "run_name": None,
        "num_layers": args.num_layers,
        "draft_arch": "llama",
        "d2t_path": args.d2t_path,
        "t2d_path": args.t2d_path,
        "ttt_steps": args.ttt_steps,
        "ttt_step_loss_decay": 1.0,
        "seed": args.seed,
        "deterministic_cuda": False,
        "use_off_policy_tokens": False,
        "norm_before_residual": True,
        "embed_requires_grad": False,
        "num_workers": 0,
        "prefetch_factor": None,
        "noise_std": 0.05,
        "scheduler_type": "linear",
        "scheduler_warmup_steps": None,
        "scheduler_total_steps": None,
        "scheduler_num_cosine_cycles": 0.5,
    }


def _set_seed(seed: int) -> None:
    """0.4.0.1's set_seed (deterministic_cuda off)."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def _transformer_layer_config(args: argparse.Namespace, line: str):
    """create_transformer_layer_config (0.4.0.1: with the multimodal text_config), draft architecture llama."""
    from transformers import LlamaConfig
    from transformers.models.auto.configuration_auto import AutoConfig

    verifier_config = AutoConfig.from_pretrained(args.verifier_name_or_path)
    if line == "0.4.0.1" and hasattr(verifier_config, "text_config"):
        verifier_config = verifier_config.text_config
    config = LlamaConfig(
        vocab_size=verifier_config.vocab_size,
        hidden_size=verifier_config.hidden_size,
        intermediate_size=verifier_config.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=verifier_config.num_attention_heads,
        num_key_value_heads=verifier_config.num_key_value_heads,
        hidden_act=verifier_config.hidden_act,
        max_position_embeddings=verifier_config.max_position_embeddings,
        initializer_range=verifier_config.initializer_range,
        rms_norm_eps=verifier_config.rms_norm_eps,
        head_dim=getattr(verifier_config, "head_dim", None),
    )
    config._attn_implementation = "simple_flex_attention" if args.attention == "flex" else DENSE_ATTENTION
    return config


DENSE_ATTENTION = "dense_block_mask_attention"


def _dense_attention(module, query, key, value, attention_mask, scaling=None, **_kwargs):
    """speculators' flex_attention_forward with the BlockMask made dense (CPU has no FlexAttention backward)."""
    import torch
    from speculators.models.eagle3.attention import block_mask_to_dense_attention_mask

    mask = block_mask_to_dense_attention_mask(attention_mask, query.device, torch.bool)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


def _register_dense_attention() -> None:
    import torch
    from transformers import AttentionInterface

    # eager: 0.3.0's draft forward is torch.compile'd, and tracing the row-by-row mask conversion would take minutes
    AttentionInterface.register(DENSE_ATTENTION, torch.compiler.disable(_dense_attention))


def _check_attention() -> float:
    """Largest |flex - dense| over the masks the draft model builds: packed documents and two draft steps.

    As in training, the packed batch fills whole 128-token mask blocks (the collate function pads to total_seq_len).
    """
    import torch
    from speculators.models.eagle3.attention import (
        create_combined_mask_mod,
        extend_mask_for_draft_tokens,
        flex_attention_forward,
    )
    from torch.nn.attention.flex_attention import create_block_mask

    torch.manual_seed(0)
    lengths = torch.tensor([37, 51, 40])
    total = int(lengths.sum())
    mask = create_block_mask(
        create_combined_mask_mod(lengths, total), B=None, H=None, Q_LEN=total, KV_LEN=total, device="cpu"
    )
    worst = 0.0
    for step in range(3):
        kv = total * (step + 1)
        query = torch.randn(1, 4, total, 32)
        key, value = torch.randn(1, 2, kv, 32), torch.randn(1, 2, kv, 32)
        with torch.no_grad():
            flex, _ = flex_attention_forward(None, query, key, value, mask, scaling=32**-0.5)
            dense, _ = _dense_attention(None, query, key, value, mask, scaling=32**-0.5)
        worst = max(worst, (flex - dense).abs().max().item())
        mask = extend_mask_for_draft_tokens(mask)
    return worst


def _capture_metrics() -> list[dict]:
    """speculators' trainer logs its metrics as dicts on the ``speculators.metrics`` logger: keep them."""
    records: list[dict] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if isinstance(record.msg, dict):
                records.append(record.msg)

    metric_logger = logging.getLogger("speculators.metrics")
    metric_logger.setLevel(logging.INFO)
    metric_logger.addHandler(Keep())
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", default=None, help="write what the stage did here (JSON)")
    stages = parser.add_subparsers(dest="stage", required=True)

    g = stages.add_parser("generate")  # data_generation_offline.py's arguments and defaults
    g.add_argument("--target-model-path", required=True)
    g.add_argument("--tensor-parallel-size", type=int, default=None, help="default: torch.accelerator.device_count()")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    g.add_argument("--train-data-path", required=True)
    g.add_argument("--seq-length", type=int, default=2048)
    g.add_argument("--max-samples", type=int, default=None)
    g.add_argument("--token-freq-path", default="./token_freq.pt")
    g.add_argument("--hf-cache-dir", default=None)
    g.add_argument("--assistant-pattern", default=None)
    g.add_argument("--turn-dropout", action="store_true")
    g.add_argument("--output-dir", required=True)
    g.add_argument("--layer-ids", type=int, nargs="+", default=None)
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--start-idx", type=int, default=0)
    g.add_argument("--num-preprocessing-workers", type=int, default=1, help="test harness: the script's default is 8")
    g.add_argument("--dtype", default=None, help="test harness: force vLLM's model dtype")

    v = stages.add_parser("vocab")  # build_vocab_mapping.py's arguments
    v.add_argument("--token-freq-path", required=True)
    v.add_argument("--draft-vocab-size", type=int, required=True)
    v.add_argument("--target-vocab-size", type=int, required=False)
    v.add_argument("--target-model-path", required=False)
    v.add_argument("--output-path", required=True, help="a folder: d2t.npy and t2d.npy are saved in it")

    t = stages.add_parser("train")
    t.add_argument("--verifier-name-or-path", required=True)
    t.add_argument("--data-path", required=True)
    t.add_argument("--save-path", required=True)
    t.add_argument("--epochs", type=int, default=1)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--total-seq-len", type=int, default=256)
    t.add_argument("--num-layers", type=int, default=1)
    t.add_argument("--d2t-path", required=True)
    t.add_argument("--t2d-path", required=True)
    t.add_argument("--ttt-steps", type=int, default=3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cpu", help="test harness: where the trainer puts the model (cpu or cuda:N)")
    t.add_argument("--attention", choices=["flex", "dense"], default="flex")
    t.add_argument("--check-attention", action="store_true")
    args = parser.parse_args()

    if args.stage == "generate":
        import torch

        if args.tensor_parallel_size is None:  # the script's default, evaluated as it does when it parses
            args.tensor_parallel_size = torch.accelerator.device_count()
        # the script configures logging on import
        logging.basicConfig(level=logging.INFO, format="%(asctime)s - %(name)s - %(levelname)s - %(message)s")
    stage = {"generate": generate, "vocab": vocab, "train": train}[args.stage]
    result = stage(args)
    write_report(args.report, {"stage": args.stage, **result, "status": compat_status(), "pid": os.getpid()})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.exit(main())
