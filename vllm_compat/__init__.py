"""vllm-compat keeps speculators' in-process EAGLE-3 hidden-state extraction running on new vLLM.

``import vllm_compat`` before speculators. On import it registers post-import hooks and does
nothing else (set ``VLLM_COMPAT_DISABLE=1`` to opt out); adapters are applied when the vLLM and
speculators modules they fix are imported, in this process and in vLLM's worker processes.
"""

from __future__ import annotations

import logging
import os

from vllm_compat import engine as _engine_module
from vllm_compat._version import __version__
from vllm_compat.errors import AdapterError, SourceError, SpeculatorsLineUnknown, UnhandledDrift, VllmCompatError

__all__ = [
    "AdapterError",
    "SourceError",
    "SpeculatorsLineUnknown",
    "UnhandledDrift",
    "VllmCompatError",
    "__version__",
    "install",
    "status",
    "uninstall",
]

logging.getLogger("vllm_compat").addHandler(logging.NullHandler())


def install(strict: bool = False) -> None:
    """Activate vllm-compat in this process and in the vLLM workers it starts (idempotent).

    With ``strict=True`` the installed vLLM is probed at once and :class:`UnhandledDrift` is raised
    if any drift is not covered; otherwise that error is raised when the generator is constructed.
    ``VLLM_COMPAT_STRICT=1`` is strict too, but probes when speculators' generator is imported (or now, if vLLM
    is imported already), so that an interpreter's start-up never pays for importing vLLM and torch.
    """
    from vllm_compat import log

    log.configure()  # before anything is logged; prints nothing itself
    _engine_module.engine.install(strict=strict)


def uninstall() -> None:
    """Revert every patch vllm-compat applied in this process (the originals come back)."""
    _engine_module.engine.uninstall()


def status() -> dict[str, object]:
    """What is installed and applied in this process, and why each adapter was applied.

    A dict (keys in docs/index.md#4-see-what-it-did); ``print()`` it for a few readable lines.
    """
    return _engine_module.engine.status()


if os.environ.get(_engine_module.ENV_DISABLE, "").strip().lower() not in {"1", "true", "yes", "on"}:
    install()
