"""tests/e2e/extract.py (an unchanged speculators extraction script) with the family tests' harness settings.

The settings, each a choice of this test harness and never a library default (vllm-compat itself selects nothing):

- ``--attention-backend NAME``: vLLM's attention backend for the generator's hand-built VllmConfig, as in
  tests/gpu/extract.py (``TRITON_MLA`` for the MLA families, ``TRITON_ATTN`` for the others on a host without
  flash-attention binaries, ``CPU_MLA`` for DeepSeek on vLLM's CPU build).
- ``--language-model-only``: ``ModelConfig(language_model_only=True)`` for a multimodal wrapper (Kimi-K2.5,
  Qwen3-VL) whose tiny checkpoint has text weights only: vLLM then builds no vision tower and profiles no
  encoder; the prompts are text-only either way, the decoder stack speculators captures is the same.
- ``--custom-ops SPEC``: ``CompilationConfig(custom_ops=SPEC.split(","))`` (``-rotary_embedding`` on vLLM's CPU
  build, whose rotary kernel rotates DeepSeek's interleaved q_pe wrongly; see tests/e2e/test_families.py).

Each rebinds a name in speculators' generator module for this process only; ``--dtype`` and every other argument
are extract.py's, and so is the work. ``import vllm_compat`` still comes first (unless ``--no-compat``).
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _pop_option(argv: list[str], name: str) -> str | None:
    if name not in argv:
        return None
    at = argv.index(name)
    value = argv[at + 1]
    del argv[at : at + 2]
    return value


def _pop_flag(argv: list[str], name: str) -> bool:
    if name not in argv:
        return False
    argv.remove(name)
    return True


def _load_by_path(path: Path, name: str):
    """Import a file as a module without putting the project root on ``sys.path`` (see tests/gpu/extract.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    backend = _pop_option(argv, "--attention-backend")
    custom_ops = _pop_option(argv, "--custom-ops")
    language_model_only = _pop_flag(argv, "--language-model-only")
    if "--no-compat" not in argv:
        import vllm_compat  # noqa: F401  (first, as a user's script does)
    from speculators.data_generation import vllm_hidden_states_generator as gen

    if language_model_only:
        original_model_config = gen.ModelConfig
        if "language_model_only" not in inspect.signature(original_model_config).parameters:
            raise SystemExit("this vLLM's ModelConfig has no language_model_only")

        def model_config(*args, **kwargs):
            return original_model_config(*args, **{**kwargs, "language_model_only": True})

        gen.ModelConfig = model_config
    extra: dict = {}
    if backend:
        gpu_extract = _load_by_path(HERE / "extract.py", "vllm_compat_gpu_extract")
        extra.update(gpu_extract.attention_backend_kwargs(backend))
    if custom_ops:
        from vllm.config import CompilationConfig

        extra["compilation_config"] = CompilationConfig(custom_ops=custom_ops.split(","))
    if extra:
        original_vllm_config = gen.VllmConfig

        def vllm_config(*args, **kwargs):
            return original_vllm_config(*args, **{**extra, **kwargs})

        gen.VllmConfig = vllm_config
    extract = _load_by_path(ROOT / "tests" / "e2e" / "extract.py", "vllm_compat_e2e_extract")
    sys.argv = [str(Path(extract.__file__)), *argv]
    return extract.main()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.exit(main(sys.argv[1:]))
