"""The patch engine: post-import hooks, the adapter lifecycle and the fail-closed policy.

``install()`` only registers post-import hooks (``vllm_compat.hooks``). Work happens when a target module is
imported: the probes an adapter answers to are run against the live vLLM, and the adapter is applied only if they
find the drift it covers. The generator's constructor is guarded: if any drift is left unhandled it raises
:class:`UnhandledDrift` before a model loads; while it runs, it sets the environment variable by which the vLLM
worker processes it starts opt in to the plugin.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterable
from types import ModuleType
from typing import Any

from vllm_compat import hooks, plugin
from vllm_compat.adapter import Adapter, load_adapters
from vllm_compat.errors import AdapterError, SpeculatorsLineUnknown, UnhandledDrift
from vllm_compat.findings import Observation, State
from vllm_compat.lines import judge_line
from vllm_compat.models import ENV_FAMILIES, active_families, model_families
from vllm_compat.patching import Patch, scoped_environ, set_attr, wrap
from vllm_compat.plan import Plan, load_probes, make_plan
from vllm_compat.runners import facts_hold
from vllm_compat.status_text import Status
from vllm_compat.versions import installed_version

__all__ = ["ENV_ACTIVE", "ENV_DISABLE", "ENV_STRICT", "engine"]

logger = logging.getLogger("vllm_compat")

ENV_ACTIVE = "VLLM_COMPAT_ACTIVE"  # set while the generator starts its workers; read there by the plugin
ENV_DISABLE = "VLLM_COMPAT_DISABLE"  # "1": `import vllm_compat` installs nothing
ENV_STRICT = "VLLM_COMPAT_STRICT"  # "1": unhandled drift raises when the generator is imported
GUARD_MODULE = "speculators.data_generation.vllm_hidden_states_generator"
GUARD_PATH = "VllmHiddenStatesGenerator.__init__"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


class _Engine:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.installed = False
        self.strict = False
        self.hooked: set[str] = set()
        self.applied: dict[str, Adapter] = {}
        self.observations: dict[str, Observation] = {}
        self.guard: Patch | None = None
        self.name_guards: dict[str, Patch] = {}
        self.module_locks: dict[str, threading.RLock] = {}  # one per hooked module: see _on_import
        self.pass_through: dict[str, list[str]] = {}  # adapter id -> its wrappers left switched off by uninstall()
        self._view: Any = None
        self.summarised = False  # the guard's one summary line per process
        self.starting_workers: int | None = None  # the pid of this process while a guarded constructor runs
        self.worker_route: tuple[str, str] | None = None  # (route, why) the last generator's workers were reached by

    # -- public API --------------------------------------------------------------------------
    def install(self, strict: bool = False) -> None:
        with self.lock:
            adapters = load_adapters()
            already = self.installed
            self.installed = True
            self.strict = strict or _truthy(os.environ.get(ENV_STRICT))
            if not already:
                logger.debug("vllm-compat installed (strict=%s)", self.strict)
            for target in sorted({a.target for a in adapters.values()} | {GUARD_MODULE} | set(_imported_names())):
                if target not in self.hooked:
                    self.hooked.add(target)
                    hooks.register(target, self._on_import)  # fires now if imported
                elif target in sys.modules and not _initializing(sys.modules[target]):  # else its hook fires soon
                    self._on_import(sys.modules[target])
            if strict or (self.strict and "vllm" in sys.modules):
                self._strict_check("install(strict=True)")
            # VLLM_COMPAT_STRICT alone (`vllm-compat run --strict`, VLLM_COMPAT_AUTO) is checked when speculators'
            # generator is imported (_on_import), still before a model loads: probing imports vLLM and torch,
            # seconds that every Python interpreter would pay at start-up, and that those never using vLLM need not.

    def _strict_check(self, where: str) -> None:
        plan = self.live_plan()
        if not plan.ok:
            raise UnhandledDrift(plan.unhandled, where=where)

    def uninstall(self) -> None:
        with self.lock:
            for adapter_id in reversed(list(self.applied)):
                adapter = self.applied[adapter_id]
                adapter.revert()
                if adapter.applied:
                    continue  # stays listed: it could not be undone without undoing someone else's patch (logged)
                del self.applied[adapter_id]
                if adapter.pass_through:
                    self.pass_through[adapter_id] = list(adapter.pass_through)
                    logger.info("vllm-compat reverted adapter %s (its wrappers pass calls through)", adapter_id)
                else:
                    logger.info("vllm-compat reverted adapter %s", adapter_id)
            if self.guard is not None:
                self.guard.revert()
                self.guard = None
            self.name_guards = {name: guard for name, guard in self.name_guards.items() if not guard.revert()}
            self.installed = False
            self.observations.clear()
            self._view = None

    def status(self) -> Status:
        with self.lock:
            spec = installed_version("speculators")
            vllm = installed_version("vllm")
            verdict = judge_line()
            native = verdict.native
            return Status(
                {
                    "installed": self.installed,
                    "strict": self.strict,
                    "vllm_version": str(vllm) if vllm else None,
                    "speculators_version": str(spec) if spec else None,
                    # an in-process line from the code; a native line (0.5 to 0.9, no generator code) from metadata
                    "speculators_line": verdict.line or native,
                    # code | metadata | absent | unknown (lines.LineVerdict)
                    "speculators_line_judged": "metadata" if native else verdict.how,
                    "applied": {k: a.reason for k, a in self.applied.items()},
                    # reverted by uninstall(), but left in place as pass-throughs under wrappers applied after ours
                    "pass_through": {k: list(v) for k, v in self.pass_through.items()},
                    "hooks": sorted(self.hooked),
                    "guarded": self.guard is not None,
                    "plugin_loaded": plugin.entry_point_loaded(),
                    # how vllm-compat reaches vLLM's workers: in a worker, the route that activated it there; in the
                    # generator's process, the route its workers take (None before a generator is built)
                    "worker_route": plugin.route or (self.worker_route[0] if self.worker_route else None),
                    "worker_route_why": _route_why(plugin.route)
                    if plugin.route
                    else (self.worker_route[1] if self.worker_route else None),
                    # whether this process is one of vLLM's workers that vllm-compat was brought into
                    "in_worker": plugin.route is not None,
                    "pid": os.getpid(),
                }
            )

    def live_plan(self, probe_ids: Iterable[str] | None = None) -> Plan:
        """The plan for the installed vLLM and the speculators code that runs (both lines if its line is not known)."""
        line = judge_line().line
        lines = (line,) if line else ("0.3.0", "0.4.0.1")
        return make_plan(self.view(), lines, probe_ids, cache=self.observations)

    def view(self) -> Any:
        if self._view is None:
            from vllm_compat.apiview.live import LiveView

            self._view = LiveView()
        return self._view

    # -- hooks -------------------------------------------------------------------------------
    def _on_import(self, module: ModuleType) -> None:
        # A hook runs while its thread holds the module's import lock, and applying adapters imports other modules.
        # Waiting here for the engine-wide lock, which a thread busy applying (and so importing) holds, would be a
        # deadlock that Python's import system cannot detect; a lock per module serialises only this module's work.
        with self.module_locks.setdefault(module.__name__, threading.RLock()):
            if not self.installed:
                return
            if self.strict and module.__name__ == GUARD_MODULE:
                self._strict_check("speculators' generator module finished importing (VLLM_COMPAT_STRICT=1)")
            verdict = judge_line()  # from the code being imported, not only the metadata (lines.py)
            line = verdict.line
            if module.__name__ == GUARD_MODULE:
                self._install_guard(module)
            if verdict.unknown:
                self._guard_missing_names(module, None)  # no adapter is known to fit: the guard stops the run
                return
            if line is None:
                native = verdict.native
                if native is not None:  # speculators 0.5 to 0.9: `vllm serve`'s own processes, no generator to guard
                    for cls in sorted(load_adapters().values(), key=lambda c: c.order):
                        if cls.target == module.__name__ and cls.id not in self.applied:
                            self._maybe_apply(cls, module, native)
                return  # nothing else to adapt: speculators absent or a release we do not serve
            for cls in sorted(load_adapters().values(), key=lambda c: c.order):
                if cls.target == module.__name__ and cls.id not in self.applied:
                    self._maybe_apply(cls, module, line)
            self._guard_missing_names(module, line)

    def _guard_missing_names(self, module: ModuleType, line: str | None) -> None:
        """Make ``from module import NAME`` raise UnhandledDrift, not a bare ImportError, for names no adapter restored.

        speculators binds vLLM names at import time, so the import statement is the first call a moved or removed
        name affects. A module ``__getattr__`` (PEP 562) answers for the missing names only. With ``line`` None (the
        speculators line is unknown) every missing watched name raises SpeculatorsLineUnknown.
        """
        if module.__name__ in self.name_guards:  # guarded already (hasattr would now raise the guard's error)
            return
        missing = {}
        for probe_id, name in _imported_names().get(module.__name__, ()):
            if not hasattr(module, name):
                if line is None:
                    missing[name] = None
                    continue
                finding = self._finding(probe_id, line)
                if finding is not None and not finding.handled:
                    missing[name] = finding
        if not missing or module.__name__ in self.name_guards:
            return
        previous = module.__dict__.get("__getattr__")

        def __getattr__(attr: str) -> Any:
            if attr in missing:
                where = f"from {module.__name__} import {attr}"
                if missing[attr] is None:
                    raise SpeculatorsLineUnknown(judge_line().seen(), where=where)
                raise UnhandledDrift([missing[attr]], where=where)
            if previous is not None:
                return previous(attr)
            raise AttributeError(f"module {module.__name__!r} has no attribute {attr!r}")

        self.name_guards[module.__name__] = set_attr(module, "__getattr__", __getattr__, "missing-name guard")

    def _maybe_apply(self, cls: type[Adapter], module: ModuleType, line: str) -> None:
        if not cls.serves(line):
            return
        reasons = [f"always: {cls.always}"] if cls.always else []
        # the plan's choice: an adapter applies where a finding names it (or, for a companion, names the adapter it
        # is the other half of), not wherever it could cover a variant (runner adapters are alternatives)
        chosen = cls.companion_of or cls.id
        principal = load_adapters().get(cls.companion_of) if cls.companion_of else cls
        for probe_id in principal.covers if principal is not None else ():
            finding = self._finding(probe_id, line)
            if finding is not None and finding.adapter == chosen:
                reasons.append(f"{probe_id}: {finding.observed}")
        if not reasons:
            return
        failing = self._facts_failing(cls, line) if cls.companion_of else []
        if failing:  # a companion whose own facts do not hold stays off; its principal's path works without it
            logger.info("vllm-compat: %s not applied: %s", cls.id, ", ".join(failing))
            return
        adapter = cls()
        adapter.reason = "; ".join(reasons)
        try:
            adapter.apply(module)
        except AdapterError as exc:  # the adapter refused on purpose; its message says why and what to do
            adapter.revert()
            raise AdapterError(f"vllm-compat adapter {cls.id} refused to patch {module.__name__}: {exc}") from exc
        except Exception as exc:
            adapter.revert()
            raise AdapterError(
                f"vllm-compat adapter {cls.id} could not patch {module.__name__}: {type(exc).__name__}: "
                f"{str(exc).rstrip('.')}. Run `vllm-compat probe` and report its output with this message."
            ) from exc
        if not adapter.applied:
            logger.debug("vllm-compat adapter %s found nothing to patch", cls.id)
            return
        self.applied[cls.id] = adapter
        self.pass_through.pop(cls.id, None)  # its wrappers were switched on again, not stacked (patching.wrap)
        logger.debug("vllm-compat applied adapter %s (%s)", cls.id, adapter.reason)  # the guard's summary says it once

    def _facts_failing(self, cls: type[Adapter], line: str) -> list[str]:
        """The facts of ``cls.relies_on`` that do not hold for ``line`` (``probe: variant``), observed once."""
        if not cls.relies_on:
            return []
        probes = load_probes()
        make_plan(self.view(), (line,), [p for p in cls.relies_on if p in probes], cache=self.observations)
        return facts_hold(cls.relies_on, self.observations, line)[1]

    def _finding(self, probe_id: str, line: str):
        probe = load_probes().get(probe_id)
        if probe is None or not probe.applies_to(line):
            return None
        active = active_families()
        if probe.family and active is not None and probe.family not in active:
            return None  # a fact about another model family than the one being loaded
        plan = make_plan(self.view(), (line,), [probe_id], cache=self.observations)
        return plan.findings[0] if plan.findings else None

    def _install_guard(self, module: ModuleType) -> None:
        if self.guard is not None and self.guard.is_in_place():  # adapters may have wrapped it since
            return
        owner = getattr(module, GUARD_PATH.split(".")[0], None)
        if owner is None:
            return

        def guarded_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            from vllm_compat import transport  # imported here: `import vllm_compat` stays light

            families = model_families(kwargs.get("model_path", args[0] if args else None))
            # The constructor starts vLLM's workers: they inherit the opt-in for the plugin and the model's families
            # (they judge and adapt those only). Set for the call only, so no other child of this process gets them.
            environ = {
                ENV_ACTIVE: "1",
                ENV_FAMILIES: ",".join(families) if families else None,
                transport.ENV_SOCKET: transport.receiver_address(),  # where the workers hand their states over
            }
            with scoped_environ(environ):
                self.worker_route = _workers_route()
                self.check(where=f"{GUARD_PATH} (before the model loads)", families=families)
                outer = self.starting_workers
                self.starting_workers = os.getpid()
                try:
                    return wrapped(*args, **kwargs)
                finally:
                    self.starting_workers = outer

        self.guard = wrap(module, GUARD_PATH, guarded_init, "drift guard")

    def check(self, where: str, families: Iterable[str] | None = None) -> None:
        """Raise UnhandledDrift if the installed vLLM has drift no adapter covers (for the model families given:
        those of the model being loaded; by default the plan's)."""
        if not self.installed:
            return
        verdict = judge_line()
        if verdict.unknown:
            raise SpeculatorsLineUnknown(verdict.seen(), where=where)
        line = verdict.line
        if line is None:
            return
        plan = make_plan(self.view(), (line,), None, cache=self.observations, families=families)
        if not self.summarised:
            self.summarised = True
            logger.info("%s", self._summary(verdict, plan))
        if not plan.ok:
            for f in plan.unhandled:
                logger.error("vllm-compat: unhandled drift %s: %s", f.probe, f.observed)
            raise UnhandledDrift(plan.unhandled, where=where)

    def _summary(self, verdict: Any, plan: Plan) -> str:
        """The guard's summary: versions, the line and how it was judged, which adapters cover which drift."""
        covered = [f for f in plan.findings if f.state is State.DRIFTED and f.handled]
        # the fallback is armed in every process; which route the workers take is said on its own
        always = sorted(k for k, a in self.applied.items() if type(a).always and k != "worker-extension-fallback")
        vllm = plan.vllm_version or installed_version("vllm")
        route = f"; workers reached through {self.worker_route[1]}" if self.worker_route else ""
        return (
            f"vllm-compat: vLLM {vllm or '?'}, speculators {verdict.metadata_version or '?'} "
            f"({verdict.describe()}); {len(covered)} drift(s) covered by {', '.join(plan.adapters) or 'no adapter'}"
            f"; {len(plan.unhandled)} unhandled; run-time adapters applied: {', '.join(always) or 'none'}{route}"
        )


def _workers_route() -> tuple[str, str] | None:
    """(route, why) for the workers a generator starts now; None where the fallback adapter is not loaded."""
    try:
        from vllm_compat.adapters.plugin_fallback import workers_route
    except ImportError:  # pragma: no cover  (always installed with vllm-compat)
        return None
    return workers_route()


def _route_why(route: str) -> str:
    if route == plugin.PLUGIN_ROUTE:
        return "vLLM's plugin loader ran the vllm_compat entry point in this worker"
    return "vLLM imported vllm_compat.worker.HiddenStatesWorkerExtension (the generator named it) in this worker"


def _initializing(module: ModuleType) -> bool:
    """Whether the module body is still running (in another thread, or further up this thread's stack)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _imported_names() -> dict[str, list[tuple[str, str]]]:
    """vLLM module -> (probe id, name) for every ``from vllm... import name`` a probe watches."""
    names: dict[str, list[tuple[str, str]]] = {}
    for probe in load_probes().values():
        if probe.id.startswith("import."):
            module, _, name = probe.symbol.rpartition(".")
            names.setdefault(module, []).append((probe.id, name))
    return names


engine = _Engine()


def _fresh_lock_in_forked_child() -> None:
    """A forked child (a vLLM worker under the fork start method) starts with only the forking thread. If another
    thread held the engine lock at that moment, the child's copy would stay locked forever and the plugin's
    ``install()`` would deadlock there; the child gets a fresh lock over the state it inherited."""
    engine.lock = threading.RLock()
    engine.module_locks = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock_in_forked_child)
