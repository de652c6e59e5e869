"""Shared fixtures. Tests run against the installed package (``pip install -e .``)."""

from __future__ import annotations

import os

# The unit tests drive install()/uninstall() themselves: keep the import-time auto-install out.
os.environ.setdefault("VLLM_COMPAT_DISABLE", "1")
