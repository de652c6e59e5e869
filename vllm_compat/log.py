"""vllm-compat's own log handler, so its warnings are seen in processes that configure no logging.

vLLM's worker processes (and many scripts) configure no logging: with only a NullHandler on the ``vllm_compat``
logger, Python's last-resort handler stays silent and every warning from a worker was lost. As vLLM and transformers
do, the library puts a stderr handler on its own logger; unlike theirs, ours keeps propagation and prints only while
the root logger has no handler, so an application that configures logging (or pytest's caplog) gets each record
once, through its own handlers. ``install()`` attaches it; importing prints nothing.

Environment: ``VLLM_COMPAT_CONFIGURE_LOGGING=0`` leaves logging alone; ``VLLM_COMPAT_LOGGING_LEVEL`` (default INFO)
sets the ``vllm_compat`` logger's level unless the application set one.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["ENV_CONFIGURE", "ENV_LEVEL", "configure"]

ENV_CONFIGURE = "VLLM_COMPAT_CONFIGURE_LOGGING"
ENV_LEVEL = "VLLM_COMPAT_LOGGING_LEVEL"
FORMAT = "%(levelname)s %(asctime)s [%(name)s pid %(process)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"  # vLLM's


class _DefaultHandler(logging.StreamHandler):
    """Writes to the current ``sys.stderr``, and only where the application has no logging of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the record propagates to the application's handlers; printing it here would double it
        super().emit(record)


def configure() -> None:
    """Attach the default handler and set the level once per process (idempotent), unless opted out."""
    if os.environ.get(ENV_CONFIGURE, "1").strip().lower() in {"0", "false", "no", "off"}:
        return
    logger = logging.getLogger("vllm_compat")
    if any(isinstance(h, _DefaultHandler) for h in logger.handlers):
        return
    asked = os.environ.get(ENV_LEVEL, "INFO")
    level = logging.getLevelName(asked.strip().upper())
    if logger.level == logging.NOTSET:  # the application did not choose one
        logger.setLevel(level if isinstance(level, int) else logging.INFO)
    logger.addHandler(_DefaultHandler())
    if not isinstance(level, int):
        logger.warning("vllm-compat: %s=%r is not a logging level; using INFO", ENV_LEVEL, asked)
