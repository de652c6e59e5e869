"""The forgotten runner's hint: one line on stderr when speculators fails to import in a way vllm-compat covers.

The wheel's ``vllm_compat_auto.pth`` runs at every interpreter start. Where ``VLLM_COMPAT_AUTO`` is not set (and
``VLLM_COMPAT_DISABLE`` is not), it installs one small ``sys.excepthook`` that chains to the one before it and
nothing else: no import, no patch, no probe. Only when an exception reaches it uncaught does that hook read this file
(by path: the ``vllm_compat`` package is not imported, so vllm-compat installs nothing) and call :func:`hint`, after
the normal traceback has been printed.

Covered, as ``adapters/speculators_imports.py`` covers them next to transformers 5 (vLLM 0.24 and later):

- ``PydanticUndefinedAnnotation`` for ``torch`` (``pydantic-torch-namespace``), raised by ``import speculators``;
- ``ImportError`` of ``transformers.modeling_attn_mask_utils`` (``transformers-attn-mask-utils``).

The hint is printed only where the traceback passes through a ``speculators`` module and vllm-compat is not
already active in the process (under ``vllm-compat run`` the adapters were there, and advice to use it would be
wrong). Everything else passes through unchanged.
"""

import sys

COVERED_MODULE = "transformers.modeling_attn_mask_utils"
MESSAGE = (
    "vllm-compat: this failure of speculators' import ({name}) is one vllm-compat covers: run the command as "
    "`vllm-compat run -- COMMAND`, or set VLLM_COMPAT_AUTO=1\n"
)


def covered(exc_type, exc) -> bool:
    """Whether vllm-compat's import adapters cover this exception (by type and the name it is about)."""
    name = getattr(exc, "name", None)
    if exc_type.__name__ == "PydanticUndefinedAnnotation":
        return name == "torch"
    return isinstance(exc_type, type) and issubclass(exc_type, ImportError) and name == COVERED_MODULE


def through_speculators(tb) -> bool:
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__") or ""
        if module == "speculators" or module.startswith("speculators."):
            return True
        tb = tb.tb_next
    return False


def hint(exc_type, exc, tb, stderr=None) -> bool:
    """Print the one-line hint if it applies; whether it was printed."""
    if "vllm_compat" in sys.modules or not covered(exc_type, exc) or not through_speculators(tb):
        return False
    stream = stderr or sys.stderr
    stream.write(MESSAGE.format(name=exc_type.__name__))
    stream.flush()
    return True
