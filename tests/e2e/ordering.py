"""One ordering scenario of the adapter lifecycle, against the real speculators and vLLM modules, in this process.

Run by tests/e2e/test_adapter_ordering.py, one fresh interpreter per scenario (a real module is imported once per
process). Every registered adapter is forced on (its ``always`` set), as dd-trace-py's PatchTestCase calls
``patch()`` whatever the installed version: the ordering contract is the adapter's and the engine's, not the
probes'. An adapter whose ``apply()`` fails on this vLLM (it patches something this release does not have) is
recorded as not applicable here, with the reason, and reverted.

    python tests/e2e/ordering.py SCENARIO --out OUT.json

Scenarios: install-then-import, import-then-install, install-twice, install-uninstall-install,
uninstall-without-install. The JSON holds, per adapter: the speculators lines it serves, how often ``apply()`` ran,
whether its patches were in place while installed and whether, after each ``uninstall()``, every patched attribute
holds the very object it held before (identity), or why the adapter did not apply; and per target module: whether
``uninstall()`` left the module and its classes exactly as they were before ``install()``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import traceback
from collections import Counter
from types import ModuleType
from typing import Any

os.environ["VLLM_COMPAT_DISABLE"] = "1"  # the scenario decides when install() runs
FIRST = (  # what a user's extraction script imports, in this order
    "speculators.data_generation.vllm_hidden_states_generator",
    "speculators.data_generation.custom_worker",
)
_ABSENT = object()

CALLS: Counter[str] = Counter()
NOT_APPLICABLE: dict[str, str] = {}
RESULT: dict[str, Any] = {"adapters": {}, "modules": {}, "steps": []}


def force_every_adapter() -> dict[str, type]:
    from vllm_compat.adapter import load_adapters

    adapters = dict(load_adapters())
    originals = {
        a: next(k.__dict__["apply"] for k in cls.__mro__ if "apply" in k.__dict__) for a, cls in adapters.items()
    }
    for cls in adapters.values():
        original = originals[cls.id]

        def apply(self: Any, module: ModuleType, _original: Any = original, _id: str = cls.id) -> None:
            CALLS[_id] += 1
            try:
                _original(self, module)
            except Exception as exc:
                self.revert()
                NOT_APPLICABLE[_id] = f"apply() raised {type(exc).__name__}: {exc}"

        cls.apply = apply
        cls.always = cls.always or "forced by the ordering suite"
    return adapters


def import_targets(adapters: dict[str, type]) -> dict[str, str]:
    """Import what a user's script imports, then every other target; target -> why it failed to import."""
    failed = {}
    for name in [*FIRST, *sorted({cls.target for cls in adapters.values()} - set(FIRST))]:
        try:
            importlib.import_module(name)
        except Exception as exc:  # e.g. speculators under transformers 5 needs vllm-compat to import at all
            failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return failed


def before_install(adapters: dict[str, type], per: dict[str, dict[str, Any]]) -> None:
    """Import the targets before install(); an adapter whose target cannot be imported yet is marked so."""
    failed = import_targets(adapters)
    RESULT["import_errors_before_install"] = failed
    first_error = next(iter(failed.values()), "")
    for info in per.values():
        if info["target"] not in sys.modules:
            info["not_importable_before_install"] = failed.get(info["target"]) or first_error or "not imported"


# -- snapshots: identity of every attribute of the target modules and of the classes they bind -----------------------
def snapshot(adapters: dict[str, type]) -> dict[str, Any]:
    shot: dict[str, Any] = {"environ": dict(os.environ), "sys.modules": dict(sys.modules)}
    for name in {cls.target for cls in adapters.values()}:
        module = sys.modules.get(name)
        if module is None:
            continue
        shot[name] = (dict(vars(module)), {k: dict(vars(v)) for k, v in vars(module).items() if inspect.isclass(v)})
    return shot


def _derived(cls: type, key: str, value: Any) -> bool:
    """Class state that Python or pydantic derive on their own, not a patch: a pydantic model's schema caches and
    ``__signature__`` (rebuilt when a config class is completed, e.g. by the speculator-config-* adapters under
    transformers 5) and the empty ``__annotations__`` dict that reading ``cls.__annotations__`` creates on a class
    without annotations."""
    if key == "__annotations__" and value == {}:
        return True
    pydantic_model = "__pydantic_fields__" in dir(cls)
    return pydantic_model and ((key.startswith("__pydantic_") and key.endswith("__")) or key == "__signature__")


def compare(before: dict[str, Any], watched: set[str]) -> dict[str, list[str]]:
    """Module name -> what differs from ``before`` (empty lists: everything is the very same object).

    Environment variables are compared for ``watched`` (what vllm-compat sets) only: importing vLLM modules sets
    others of its own. Derived class state (``_derived``) is listed under ``RESULT["derived"]``, not as a difference.
    """
    diffs: dict[str, list[str]] = {}
    derived = RESULT.setdefault("derived", [])
    for name, (namespace, classes) in ((k, v) for k, v in before.items() if k not in {"environ", "sys.modules"}):
        module = sys.modules[name]
        found = diffs.setdefault(name, [])
        now = vars(module)
        for key, value in namespace.items():
            if now.get(key, _ABSENT) is not value:
                found.append(f"{name}.{key} is not the object it was")
        for key in set(now) - set(namespace):
            if not inspect.ismodule(now[key]):  # a submodule imported meanwhile is bound on its package: fine
                found.append(f"{name}.{key} was added")
        for cls_name, members in classes.items():
            cls = namespace[cls_name]
            current = vars(cls)
            for key in sorted(set(members) | set(current)):
                old, new = members.get(key, _ABSENT), current.get(key, _ABSENT)
                if old is new:
                    continue
                where = f"{name}.{cls_name}.{key}"
                if _derived(cls, key, new):
                    derived.append(where)
                else:
                    found.append(f"{where} was added" if old is _ABSENT else f"{where} is not the object it was")
    keys = watched | {k for k in set(before["environ"]) | set(os.environ) if k.startswith("VLLM_COMPAT_")}
    diffs["os.environ"] = sorted(f"${k} changed" for k in keys if before["environ"].get(k) != os.environ.get(k))
    diffs["sys.modules"] = sorted(
        f"sys.modules[{k!r}] changed" for k, v in before["sys.modules"].items() if sys.modules.get(k, _ABSENT) is not v
    )
    return diffs


def env_keys(seen: dict[str, list[Any]]) -> set[str]:
    return {rec[2] for recs in seen.values() for rec in recs if rec[1] is os.environ}


# -- per-adapter records --------------------------------------------------------------------------------------------
# Several patches may stack on one attribute (five adapters wrap speculators' SchedulerConfig binding, the drift guard
# and three adapters wrap the generator's __init__). While installed, each adapter's wrapper must be somewhere in the
# chain the attribute holds; after uninstall() the attribute must hold the object it held before the first patch.
Record = tuple[str, Any, str, Any, Any]  # (kind, owner, name, original, replacement)


def _record(p: Any) -> Record:
    if hasattr(p, "mapping"):
        return ("item", p.mapping, p.key, p.original, p.value)
    return ("attr", p.owner, p.name, p.original, p.replacement)


def patch_records(engine: Any) -> dict[str, list[Record]]:
    """Holder -> every patch it holds now: each adapter by id, and the engine's own guards."""
    records = {a: [_record(p) for p in adapter._patches] for a, adapter in engine.applied.items()}
    records["<drift guard>"] = [_record(engine.guard)] if engine.guard is not None else []
    records["<missing-name guards>"] = [_record(p) for p in getattr(engine, "name_guards", {}).values()]
    return records


def _now(kind: str, owner: Any, name: str) -> Any:
    from vllm_compat.patching import _ABSENT as ABSENT

    return owner.get(name, ABSENT) if kind == "item" else vars(owner).get(name, ABSENT)


def _chain(value: Any) -> list[Any]:
    """``value`` and what it wraps, through wrapt's ``__wrapped__`` (outermost first)."""
    out = [value]
    while len(out) < 64:
        try:
            inner = object.__getattribute__(out[-1], "__wrapped__")
        except AttributeError:
            try:
                inner = out[-1].__wrapped__
            except Exception:
                break
        if any(inner is seen for seen in out):
            break
        out.append(inner)
    return out


def current(records: list[Record]) -> list[str]:
    """The patches of one holder that are NOT in place, alone or under later ones (empty: all are)."""
    out = []
    for kind, owner, name, _original, replacement in records:
        now = _now(kind, owner, name)
        if kind == "item":
            ok = now is replacement or now == replacement
        else:
            ok = any(layer is replacement for layer in _chain(now))
        if not ok:
            out.append(f"{_label(owner)}.{name} does not hold the patch")
    return out


def originals(all_records: dict[str, list[Record]]) -> dict[tuple[int, str], Any]:
    """(owner, name) -> what it held before vllm-compat's first patch: the one original no patch put there."""
    by_key: dict[tuple[int, str], list[Record]] = {}
    for recs in all_records.values():
        for rec in recs:
            by_key.setdefault((id(rec[1]), rec[2]), []).append(rec)
    base = {}
    for key, recs in by_key.items():
        replacements = [r[4] for r in recs]
        first = [r[3] for r in recs if not any(r[3] is x for x in replacements)]
        base[key] = first[0] if first else recs[0][3]
    return base


def restored(records: list[Record], base: dict[tuple[int, str], Any]) -> list[str]:
    """The attributes one holder patched that do NOT hold their pre-vllm-compat object again (empty: all do)."""
    out = []
    for kind, owner, name, _original, _replacement in records:
        before = base[(id(owner), name)]
        now = _now(kind, owner, name)
        if now is not before and not (kind == "item" and now == before):
            out.append(f"{_label(owner)}.{name}: {now!r:.80} is not the original {before!r:.80}")
    return out


def _label(owner: Any) -> str:
    if owner is os.environ:
        return "os.environ"
    if owner is sys.modules:
        return "sys.modules"
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or type(owner).__name__


def step(name: str) -> None:
    RESULT["steps"].append(name)


# -- scenarios -------------------------------------------------------------------------------------------------------
def run(scenario: str) -> None:
    import vllm_compat
    from vllm_compat.engine import engine
    from vllm_compat.versions import installed_version, speculators_line

    adapters = force_every_adapter()
    line = speculators_line(installed_version("speculators"))
    RESULT.update(scenario=scenario, speculators=line, vllm=str(installed_version("vllm")))
    per: dict[str, dict[str, Any]] = {
        a: {"serves": cls.serves(line) if line else False, "target": cls.target, "problems": []}
        for a, cls in adapters.items()
    }
    RESULT["adapters"] = per
    seen: dict[str, list[Record]] = {}

    def installed_check(label: str) -> None:
        records = patch_records(engine)
        for holder, recs in records.items():
            seen.setdefault(holder, [])
            seen[holder] += [r for r in recs if not any(r is x for x in seen[holder])]
            for problem in current(recs):
                if holder in per:
                    per[holder]["problems"].append(f"{label}: {problem}")
                else:
                    RESULT.setdefault("engine_problems", []).append(f"{label}: {holder}: {problem}")
        for adapter_id, info in per.items():
            info["applied_" + label] = bool(records.get(adapter_id))

    def uninstalled_check(label: str) -> None:
        base = originals(seen)
        for holder, recs in seen.items():
            for problem in restored(recs, base):
                if holder in per:
                    per[holder]["problems"].append(f"{label}: {problem}")
                else:
                    RESULT.setdefault("engine_problems", []).append(f"{label}: {holder}: {problem}")
        assert not engine.applied, f"{label}: uninstall() left {sorted(engine.applied)}"

    if scenario == "install-then-import":
        vllm_compat.install()
        step("install")
        RESULT["import_errors"] = import_targets(adapters)
        step("import")
        installed_check("installed")
        vllm_compat.uninstall()
        step("uninstall")
        uninstalled_check("uninstalled")
    elif scenario == "import-then-install":
        before_install(adapters, per)
        step("import")
        before = snapshot(adapters)
        vllm_compat.install()
        step("install")
        import_targets(adapters)  # what could not be imported before install() (adapters apply at import then)
        installed_check("installed")
        vllm_compat.uninstall()
        step("uninstall")
        uninstalled_check("uninstalled")
        RESULT["module_diffs"] = compare(before, env_keys(seen))
    elif scenario == "install-twice":
        vllm_compat.install()
        step("install")
        vllm_compat.install()
        step("install")
        import_targets(adapters)
        step("import")
        vllm_compat.install()
        step("install")
        installed_check("installed")
        vllm_compat.uninstall()
        step("uninstall")
        uninstalled_check("uninstalled")
    elif scenario == "install-uninstall-install":
        vllm_compat.install()
        step("install")
        import_targets(adapters)
        step("import")
        installed_check("first")
        vllm_compat.uninstall()
        step("uninstall")
        uninstalled_check("first-uninstall")
        vllm_compat.install()
        step("install")
        installed_check("second")
        vllm_compat.uninstall()
        step("uninstall")
        uninstalled_check("second-uninstall")
    elif scenario == "uninstall-without-install":
        before_install(adapters, per)
        step("import")
        before = snapshot(adapters)
        vllm_compat.uninstall()
        step("uninstall")
        RESULT["module_diffs"] = compare(before, env_keys(seen))
        RESULT["installed_after_uninstall"] = vllm_compat.status()["installed"]
        vllm_compat.install()
        step("install")  # a later install still works
        import_targets(adapters)
        installed_check("installed")
        vllm_compat.uninstall()
        step("uninstall")
        uninstalled_check("uninstalled")
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    for adapter_id, info in per.items():
        info["apply_calls"] = CALLS[adapter_id]
        info["not_applicable"] = NOT_APPLICABLE.get(adapter_id)
        info.setdefault("not_importable_before_install", None)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    try:
        run(args.scenario)
        RESULT["ok"] = True
    except BaseException as exc:
        RESULT["ok"] = False
        RESULT["error"] = f"{type(exc).__name__}: {exc}"
        RESULT["trace"] = traceback.format_exc()[-4000:]
    with open(args.out, "w") as f:
        json.dump(RESULT, f, indent=2, default=str)
    return 0 if RESULT["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
