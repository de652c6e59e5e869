"""The benchmark's presets, its sides and its command line."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

DEFAULT = {  # 1B-class
    "hidden": 2048,
    "layers": 16,
    "heads": 16,
    "kv_heads": 8,
    "intermediate": 0,  # 0: the builder's 11/4 x hidden
    "vocab": 32000,
    "seq_len": 1024,
    "seqs_per_call": 32,
    "calls": 8,
    "warmup_calls": 1,
    "max_model_len": 2048,
}
LARGE = {  # 8B-class: Llama 3 8B's shape
    "hidden": 4096,
    "layers": 32,
    "heads": 32,
    "kv_heads": 8,
    "intermediate": 14336,
    "vocab": 128256,
    "seq_len": 2048,
    "seqs_per_call": 16,
    "calls": 8,
    "warmup_calls": 1,
    "max_model_len": 4096,  # a prompt of seq_len plus the one sampled token must fit
}
SMALL = {
    "hidden": 256,
    "layers": 4,
    "heads": 4,
    "kv_heads": 2,
    "intermediate": 0,
    "vocab": 1024,
    "seq_len": 256,
    "seqs_per_call": 8,
    "calls": 3,
    "warmup_calls": 1,
    "max_model_len": 2048,
}
PRESETS = {"small": SMALL, "default": DEFAULT, "large": LARGE}

KINDS = ("extract", "prefill", "native", "native_disk", "hf")  # what a side does
NATIVE = ("native", "native_disk")
RUNNERS = ("v1", "v2")
RATIOS = (  # (numerator, denominator) kinds: tokens/s of one side over another's, under the same model runner
    ("extract", "prefill"),
    ("extract", "native"),
    ("native", "prefill"),
    ("extract", "native_disk"),
    ("native_disk", "prefill"),
    ("extract", "hf"),
)
GOAL_CALL_RATIO = 0.97  # every timed extraction call at >= this fraction of plain prefill's speed (issue #19)
GOAL_PEAK_MEMORY = 1.05  # extraction's peak GPU memory <= this multiple of prefill's
NATIVE_NO_CHUNKED_PREFILL = {(0, 22)}  # vLLM releases whose extract_hidden_states path needs chunked prefill off


def side_name(kind: str, runner: str | None) -> str:
    """``extract``, or ``extract@v2`` where ``--model-runner`` names the runner."""
    return f"{kind}@{runner}" if runner else kind


def split_name(name: str) -> tuple[str, str | None]:
    kind, _, runner = name.partition("@")
    return kind, runner or None


def parse(argv: list[str], description: str = "") -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cpu for the small preset, else cuda)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, help="sizes (default: default)")
    parser.add_argument("--small", action="store_true", help="--preset small (hidden 256, 4 layers, 6k tokens)")
    for key, value in DEFAULT.items():
        sizes = f"default {value}, large {LARGE[key]}, small {SMALL[key]}" + ("; 0: 11/4 x hidden" if not value else "")
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=sizes)
    parser.add_argument("--extract-layers", default=None, help="comma-separated ids; default: speculators'")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default=None, help="e.g. TRITON_ATTN (a harness setting, all sides)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="default 790 on cuda (H200 bf16 dense)")
    parser.add_argument("--model-dir", default=None, help="the random model's folder (default: a temp folder)")
    parser.add_argument(
        "--sides", default="extract,prefill,native", help=f"comma-separated, of {','.join(KINDS)} (default %(default)s)"
    )
    parser.add_argument("--repeat", type=int, default=1, help="rounds of timed calls in each side's one engine")
    parser.add_argument(
        "--model-runner",
        default=None,
        help="v1, v2 or v1,v2: run every vLLM side under each (VLLM_COMPAT_MODEL_RUNNER and VLLM_USE_V2_MODEL_RUNNER)",
    )
    parser.add_argument("--native-disk-dir", default=None, help="native_disk's folder (default: a temp folder)")
    parser.add_argument("--native-wait-timeout", type=float, default=300.0, help="seconds for one call's files")
    parser.add_argument(
        "--cpu-unpinned-staging",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CPU only, a harness setting (on by default on a CPU): vLLM's connector stages the native side's states "
        "in ordinary memory (it asks for pinned memory, which a CPU build of torch cannot allocate)",
    )
    parser.add_argument("--no-check", action="store_true", help="skip the states check")
    parser.add_argument("--check-seqs", type=int, default=2, help="sequences of one call whose states are checked")
    parser.add_argument(
        "--check-factor",
        type=float,
        default=1.5,
        help="states check: vLLM's bf16 error against float32 may be at most this multiple of transformers' bf16 "
        "error, per layer (mean and max)",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile one extra extraction call (not timed)")
    parser.add_argument(
        "--trace-slabs",
        action="store_true",
        help="extract: record the worker's slab work and both processes' stalls per call (bench/extraction/trace.py)",
    )
    parser.add_argument("--side-timeout", type=int, default=480, help="seconds for one side's process")
    parser.add_argument(
        "--time-budget", type=int, default=None, help="seconds for the whole command; rounds are cut to fit"
    )
    parser.add_argument(
        "--resummarize", type=Path, default=None, help="print the summary of an earlier results.json again (no run)"
    )
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--side-input", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.small and args.preset not in (None, "small"):
        parser.error(f"--small is --preset small, not --preset {args.preset}")
    args.preset = "small" if args.small else args.preset or "default"
    args.small = args.preset == "small"
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    unknown = set(args.sides.split(",")) - set(KINDS)
    if unknown:
        parser.error(f"unknown sides {sorted(unknown)}; choose from {','.join(KINDS)}")
    args.runners = args.model_runner.split(",") if args.model_runner else []
    if set(args.runners) - set(RUNNERS) or len(set(args.runners)) != len(args.runners):
        parser.error(f"--model-runner takes v1, v2 or v1,v2, not {args.model_runner!r}")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if not 1 <= args.check_seqs <= args.seqs_per_call:
        parser.error(f"--check-seqs must be between 1 and --seqs-per-call ({args.seqs_per_call})")
    args.device = args.device or ("cpu" if args.small else "cuda")
    if args.cpu_unpinned_staging is None:
        args.cpu_unpinned_staging = args.device == "cpu"
    if args.peak_tflops is None and args.device == "cuda":
        args.peak_tflops = 790.0
    if args.model_dir is None:
        from importlib.metadata import PackageNotFoundError, version

        try:  # a tokenizer saved by transformers 5 does not load in transformers 4
            writer = f"tf{version('transformers')}"
        except PackageNotFoundError:
            writer = "tf-none"
        tag = f"h{args.hidden}-l{args.layers}-v{args.vocab}-{args.dtype}-{args.device}-{writer}"
        if args.intermediate:
            tag += f"-i{args.intermediate}"
        args.model_dir = str(Path(tempfile.gettempdir()) / f"vllm-compat-bench-model-{tag}")
    args.out = args.out.resolve()
    args.started = time.time()
    args.passthrough = without_options(argv, ("--side", "--side-input", "--side-timeout", "--time-budget"))
    return args


def without_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` minus the options ``names`` and their values (``--opt value`` or ``--opt=value``)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not any(arg.startswith(f"{name}=") for name in names):
            kept.append(arg)
    return kept


def default_layers(args: argparse.Namespace, layers: int) -> list[int]:
    """speculators' default choice, as the generator makes it (or ``--extract-layers``)."""
    if args.extract_layers:
        return [int(x) for x in args.extract_layers.split(",")]
    return [2, layers // 2, layers - 3, layers - 1]


def checked_layers(args: argparse.Namespace, layers: int) -> list[int]:
    """The decoder layers whose outputs the check compares (each once, in the model's order)."""
    return sorted(set(default_layers(args, layers)))


def check_call(args: argparse.Namespace) -> int:
    """Index (among all calls, warm-up first) of the call whose states are checked: the last timed call."""
    return args.warmup_calls + args.calls - 1


def check_positions(args: argparse.Namespace) -> list[int]:
    """The checked sequences of that call: the first and the last (other steps of the call), evenly between."""
    n, k = args.seqs_per_call, args.check_seqs
    if k == 1:
        return [0]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})
