"""LiveView (the installed vLLM, imported) and StaticView (the same files, read with ast) agree."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def plans():
    import vllm

    from vllm_compat.apiview.live import LiveView
    from vllm_compat.apiview.static import StaticView
    from vllm_compat.plan import make_plan

    lines = ("0.3.0", "0.4.0.1")
    site = Path(vllm.__file__).resolve().parent.parent
    return make_plan(LiveView(), lines), make_plan(StaticView(site), lines)


def test_same_findings(plans) -> None:
    live, static = plans
    assert live.vllm_version == static.vllm_version
    got = {(f.probe, f.speculators): (f.state, f.variant) for f in live.findings}
    want = {(f.probe, f.speculators): (f.state, f.variant) for f in static.findings}
    assert got == want


def test_same_evidence(plans) -> None:
    """Each finding points at the same file:line whichever way the source was read."""
    live, static = plans
    evidence = {(f.probe, f.speculators): f.evidence for f in static.findings}
    for f in live.findings:
        assert f.evidence == evidence[(f.probe, f.speculators)], f.probe
