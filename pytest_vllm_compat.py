"""pytest plugin: fail a test session early when vLLM has drifted in a way vllm-compat does not cover.

Installed with vllm-compat (entry point group ``pytest11``, name ``vllm_compat``) and off unless asked:

    pytest --vllm-compat-guard                          # probe the installed vLLM
    pytest --vllm-compat-source vllm==0.34.0            # probe a release, a wheel or a source folder instead
    pytest --vllm-compat-guard --vllm-compat-strict     # facts the probes cannot establish fail too

or in the ini file: ``vllm_compat_guard = true`` (and ``vllm_compat_source``, ``vllm_compat_strict``,
``vllm_compat_speculators``). At session start, before collection, the probes run once (as ``vllm-compat probe``
does); when the plan does not pass, the probe report is printed and the session ends before any test is collected, with
``vllm-compat probe``'s exit codes: 1 unhandled drift (with strict: or unknown facts), 2 no vLLM to probe or a bad
source. A passing guard adds one line to the session header.

This module is outside the ``vllm_compat`` package on purpose: pytest imports every ``pytest11`` plugin in every
session, and importing ``vllm_compat`` registers its hooks. Nothing of vllm-compat is imported unless the guard is on.
"""

from __future__ import annotations

import pytest

EXIT_DRIFT, EXIT_USAGE = 1, 2  # as `vllm-compat probe`


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("vllm-compat", "vllm-compat drift guard")
    group.addoption(
        "--vllm-compat-guard",
        action="store_true",
        default=None,
        help="probe vLLM at session start; end the session (exit 1) on drift no adapter covers",
    )
    group.addoption(
        "--vllm-compat-source",
        metavar="PATH|WHEEL|vllm==X",
        default=None,
        help="probe this vLLM instead of the installed one (implies --vllm-compat-guard)",
    )
    group.addoption(
        "--vllm-compat-strict",
        action="store_true",
        default=None,
        help="facts the probes cannot establish fail the guard too (implies --vllm-compat-guard)",
    )
    group.addoption(
        "--vllm-compat-speculators",
        metavar="VERSION",
        default=None,
        help="the speculators release to judge for (any 0.3.x or 0.4.x version, judged as its line; default: the "
        "line of the speculators code Python imports, or both)",
    )
    parser.addini("vllm_compat_guard", "probe vLLM at session start (the --vllm-compat-guard option)", type="bool")
    parser.addini("vllm_compat_source", "the vLLM to probe (the --vllm-compat-source option)", default="")
    parser.addini("vllm_compat_strict", "strict guard (the --vllm-compat-strict option)", type="bool")
    parser.addini("vllm_compat_speculators", "speculators line (the --vllm-compat-speculators option)", default="")


def _setting(config: pytest.Config, name: str) -> object:
    value = config.getoption(f"--vllm-compat-{name}")
    return value if value is not None else config.getini(f"vllm_compat_{name}")


def _enabled(config: pytest.Config) -> bool:
    return bool(_setting(config, "guard") or _setting(config, "source") or _setting(config, "strict"))


@pytest.hookimpl(tryfirst=True)  # the first step after session start (and its header), before any collection
def pytest_collection(session: pytest.Session) -> None:
    config = session.config
    if _enabled(config) and not hasattr(config, "workerinput"):  # xdist workers: the controller guards
        _guard(config)


def _guard(config: pytest.Config) -> None:
    from vllm_compat.cli import probe_plan
    from vllm_compat.errors import SourceError
    from vllm_compat.report import render_table

    source = str(_setting(config, "source") or "") or None
    strict = bool(_setting(config, "strict"))
    speculators = str(_setting(config, "speculators") or "") or None
    write = _writer(config)
    try:
        plan = probe_plan(source, speculators)
    except SourceError as exc:
        pytest.exit(f"vllm-compat guard: {exc}", returncode=EXIT_USAGE)
    passed = plan.passes(strict)
    origin = source or "installed"
    if passed:
        drifted = sum(str(f.state) == "drifted" for f in plan.findings)
        write(
            f"vllm-compat guard: vLLM {plan.vllm_version or '?'} ({origin}): OK "
            f"({drifted} drifted findings, all covered; {len(plan.unknown)} unknown)"
        )
        return
    write(render_table(plan, origin, strict))
    names = sorted({f.probe for f in plan.failing(strict)})
    pytest.exit(
        f"vllm-compat guard: vLLM {plan.vllm_version or '?'} ({origin}) has drift that no adapter covers: "
        f"{', '.join(names)}. See the probe report above; `vllm-compat probe` prints it too.",
        returncode=EXIT_DRIFT,
    )


def _writer(config: pytest.Config):
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        return lambda text: reporter.write_line(text)
    import sys

    return lambda text: sys.stderr.write(text + "\n")
