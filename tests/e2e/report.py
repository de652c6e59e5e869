"""The per-cell report the matrix runner collects (scripts/e2e_matrix.py sets ``VLLM_COMPAT_E2E_REPORT``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ENV = "VLLM_COMPAT_E2E_REPORT"


def record(name: str, value: Any) -> None:
    """Add ``name: value`` to the cell's report, where the matrix runner asked for one."""
    record_all({name: value})


def record_all(values: dict[str, Any]) -> None:
    path = os.environ.get(ENV)
    if path:
        report = Path(path)
        data = json.loads(report.read_text()) if report.exists() else {}
        data.update(values)
        report.write_text(json.dumps(data, indent=2))
