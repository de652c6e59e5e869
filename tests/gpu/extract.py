"""tests/e2e/extract.py (an unchanged speculators extraction script) with one GPU test-harness setting.

``--attention-backend NAME`` (e.g. ``TRITON_ATTN``) selects vLLM's attention backend for the generator's hand-built
VllmConfig: a GPU host without flash-attention binaries needs the Triton backend, and speculators offers no knob.
Like extract.py's ``--dtype``, it rebinds ``VllmConfig`` in speculators' generator module, for this process only,
to pass ``attention_config=AttentionConfig(backend=AttentionBackendEnum.NAME)`` (vLLM releases whose VllmConfig
has no ``attention_config`` read ``VLLM_ATTENTION_BACKEND`` instead, which the workers inherit). It is a choice of
this test harness, not a library default: vllm-compat itself never selects a backend.

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


def main(argv: list[str]) -> int:
    backend = None
    if "--attention-backend" in argv:
        at = argv.index("--attention-backend")
        backend = argv[at + 1]
        del argv[at : at + 2]
    if "--no-compat" not in argv:
        import vllm_compat  # noqa: F401  (first, as a user's script does)
    if backend:
        from speculators.data_generation import vllm_hidden_states_generator as gen_module

        force_attention_backend(gen_module, backend)
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
