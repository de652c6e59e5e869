"""Activate vllm-compat at interpreter start-up: the bootstrap of ``vllm-compat run``.

``vllm-compat run -- COMMAND`` puts this file's folder first on PYTHONPATH, so every Python process the command
starts (the script, and any Python child it spawns: vLLM's workers, ``subprocess.run([sys.executable, ...])``)
imports this module during start-up (``site`` imports ``sitecustomize``). It then

1. runs the ``sitecustomize`` that would have run without vllm-compat (the next one on ``sys.path``), so an
   environment's own start-up customisation keeps working; an error in it is reported, as Python reports it,
   and start-up goes on;
2. imports ``vllm_compat``, which registers its post-import hooks (unless ``VLLM_COMPAT_DISABLE=1``). In strict mode
   (``vllm-compat run --strict`` sets ``VLLM_COMPAT_STRICT=1``) drift that no adapter covers raises
   ``UnhandledDrift`` when the program imports speculators' generator, before any model loads; start-up itself
   imports neither vLLM nor torch. Should ``import vllm_compat`` raise it here, the process stops with exit code 1
   and the report.

Recursion guard: while the other ``sitecustomize`` is imported, this folder is taken off ``sys.path`` (every
occurrence) and a flag on ``sys`` stops a re-entry; both are restored afterwards. A failure never stops the
user's program: it is reported on stderr.
"""

from __future__ import annotations

import os
import sys

_FOLDER = os.path.dirname(os.path.abspath(__file__))
_GUARD = "_vllm_compat_bootstrapping"


def _same(entry: str) -> bool:
    try:
        return os.path.abspath(entry or os.curdir) == _FOLDER
    except (TypeError, ValueError):
        return False


def _chain() -> None:
    """Import the next ``sitecustomize`` on ``sys.path``, the one this module hides."""
    ours = sys.modules.get("sitecustomize")
    saved = list(sys.path)
    sys.path[:] = [entry for entry in sys.path if not _same(entry)]
    sys.modules.pop("sitecustomize", None)
    try:
        import importlib

        importlib.import_module("sitecustomize")
    except ImportError as exc:
        if exc.name != "sitecustomize":
            _report("the environment's sitecustomize failed", exc)
    except Exception as exc:  # as site.py does: report and go on
        _report("the environment's sitecustomize failed", exc)
    finally:
        sys.path[:] = saved
        if ours is not None:
            sys.modules["sitecustomize"] = ours


def _activate() -> None:
    try:
        import vllm_compat  # noqa: F401  (the import installs, unless VLLM_COMPAT_DISABLE=1)
    except Exception as exc:
        errors = sys.modules.get("vllm_compat.errors")
        if errors is not None and isinstance(exc, errors.UnhandledDrift):
            sys.stderr.write(f"vllm-compat (strict, pid {os.getpid()}): {exc}\n")
            sys.stderr.flush()
            os._exit(1)  # site.py would swallow an exception here and let the program run
        _report("vllm_compat could not be imported in this interpreter; it runs without vllm-compat", exc)


def _report(what: str, exc: BaseException) -> None:
    sys.stderr.write(f"vllm-compat bootstrap (pid {os.getpid()}): {what}: {type(exc).__name__}: {exc}\n")


def _main() -> None:
    if getattr(sys, _GUARD, False):
        return
    setattr(sys, _GUARD, True)
    try:
        _chain()
        _activate()
    finally:
        setattr(sys, _GUARD, False)


_main()
