"""tests/e2e/extract.py (an unchanged speculators extraction script) with one GPU test-harness setting.

``--attention-backend NAME`` (e.g. ``TRITON_ATTN``) selects vLLM's attention backend for the generator's hand-built
VllmConfig: a GPU host without flash-attention binaries needs the Triton backend, and speculators offers no knob.
Like extract.py's ``--dtype``, it rebinds ``VllmConfig`` in speculators' generator module, for this process only,
to pass ``attention_config=AttentionConfig(backend=AttentionBackendEnum.NAME)`` (vLLM releases whose VllmConfig
has no ``attention_config`` read ``VLLM_ATTENTION_BACKEND`` instead, which the workers inherit). It is a choice of
this test harness, not a library default: vllm-compat itself never selects a backend.

``--max-num-batched-tokens N`` sets the scheduler's token budget per step the same way (speculators 0.3.0 has no
parameter for it, 0.4.0.1 passes its own): rebinding ``SchedulerConfig`` in speculators' module, after vllm-compat's
adapters wrapped it, to call it with ``max_num_batched_tokens=N``. A budget smaller than a prompt makes the scheduler
prefill that prompt over several steps. Also a harness choice, never a library default.

Every other argument is extract.py's; the work is extract.py's ``main()``. ``import vllm_compat`` still comes first
(unless ``--no-compat``), before speculators is imported.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def attention_backend_kwargs(name: str) -> dict:
    """``{"attention_config": AttentionConfig(backend=...)}`` where VllmConfig takes one, else sets the env var."""
    import inspect

    from vllm.config import VllmConfig

    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:  # releases before the attention registry moved under v1
        from vllm.attention.backends.registry import AttentionBackendEnum
    if "attention_config" in inspect.signature(VllmConfig).parameters:
        from vllm.config import AttentionConfig

        return {"attention_config": AttentionConfig(backend=AttentionBackendEnum[name])}
    os.environ["VLLM_ATTENTION_BACKEND"] = name
    return {}


def force_attention_backend(module, name: str) -> None:
    """Rebind ``VllmConfig`` in speculators' generator module so its one call selects ``name``."""
    original = module.VllmConfig
    extra = attention_backend_kwargs(name)

    def vllm_config(*args, **kwargs):
        return original(*args, **{**extra, **kwargs})

    module.VllmConfig = vllm_config


def force_token_budget(module, tokens: int) -> None:
    """Rebind ``SchedulerConfig`` in speculators' generator module so its one call gets ``max_num_batched_tokens``."""
    original = module.SchedulerConfig

    def scheduler_config(*args, **kwargs):
        return original(*args, **{**kwargs, "max_num_batched_tokens": tokens})

    module.SchedulerConfig = scheduler_config


def _take(argv: list[str], flag: str) -> str | None:
    if flag not in argv:
        return None
    at = argv.index(flag)
    value = argv[at + 1]
    del argv[at : at + 2]
    return value


def main(argv: list[str]) -> int:
    backend = _take(argv, "--attention-backend")
    budget = _take(argv, "--max-num-batched-tokens")
    if "--no-compat" not in argv:
        import vllm_compat  # noqa: F401  (first, as a user's script does)
    if backend or budget:
        from speculators.data_generation import vllm_hidden_states_generator as gen_module

        if backend:
            force_attention_backend(gen_module, backend)
        if budget:
            force_token_budget(gen_module, int(budget))
    extract = load_by_path(ROOT / "tests" / "e2e" / "extract.py", "vllm_compat_e2e_extract")
    sys.argv = [str(Path(extract.__file__)), *argv]
    return extract.main()


def load_by_path(path: Path, name: str):
    """Import a file as a module without putting the project root on ``sys.path``.

    vLLM's spawned workers inherit the parent's ``sys.path``; with the project root first on it they would import
    ``vllm_compat`` from the source tree (where ``vllm_compat.adapters`` does not exist) instead of the installed
    package.
    """
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.exit(main(sys.argv[1:]))
