"""Shared by the drift tests: plans of real vLLM wheels, computed once per test module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from vllm_compat.apiview.static import StaticView
from vllm_compat.errors import SourceError
from vllm_compat.plan import Plan, make_plan
from vllm_compat.sources import fetch_release


def by_version(releases: Any) -> list[str]:
    """Release strings in version order."""
    return sorted(releases, key=lambda v: tuple(int(x) for x in v.split(".")))


def plan_getter(lines: tuple[str, ...], **plan_kwargs: Any) -> Callable[[str], Plan]:
    """release -> ``make_plan`` over its wheel, cached; skips a test whose wheel cannot be had."""
    plans: dict[str, Plan] = {}

    def get(release: str) -> Plan:
        if release not in plans:
            try:
                wheel = fetch_release(release)
            except SourceError as exc:
                pytest.skip(f"vllm=={release} is not cached and cannot be fetched: {exc}")
            plans[release] = make_plan(StaticView(wheel), lines, **plan_kwargs)
        return plans[release]

    return get
