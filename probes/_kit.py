"""Building blocks shared by the probe modules: name lookups, call-signature checks, AST queries."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping, Sequence

from vllm_compat.apiview import ApiView, Location, Param
from vllm_compat.findings import BASELINE, Observation, Probe, probe

__all__ = [
    "LINES",
    "V030",
    "V040",
    "call_probe",
    "calls",
    "check_call",
    "evidence",
    "first_found",
    "import_probe",
    "parse_source",
]

V030 = "0.3.0"
V040 = "0.4.0.1"
LINES = (V030, V040)


def evidence(loc: Location | None, note: str = "") -> str:
    if loc is None:
        return note
    return loc.evidence() + (f": {note}" if note else "")


def first_found(view: ApiView, candidates: Sequence[str]) -> tuple[str, Location] | None:
    """The first of ``candidates`` (dotted names) the view can locate."""
    for dotted in candidates:
        loc = view.locate(dotted)
        if loc is not None:
            return dotted, loc
    return None


def parse_source(view: ApiView, dotted: str) -> tuple[ast.AST, Location | None] | None:
    """The AST of a function or class body, and where it is; None if the view has no source."""
    src = view.source(dotted)
    if src is None:
        return None
    try:
        tree = ast.parse(src.text)
    except SyntaxError:
        return None
    return tree, view.locate(dotted)


def calls(tree: ast.AST) -> set[str]:
    """Names of everything called in ``tree``: ``f(...)`` gives ``f``, ``a.b.m(...)`` gives ``m``."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                found.add(func.id)
            elif isinstance(func, ast.Attribute):
                found.add(func.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            found.add(f"'{node.value}'")  # collective_rpc("method") names a call too
    return found


def import_probe(
    module: str,
    name: str,
    lines: Iterable[str],
    moved_to: Sequence[str] = (),
    id_prefix: str = "import.",
    surface: str = "imports",
    summary: str | None = None,
) -> Probe:
    """speculators does ``from module import name``: is it there, moved, or gone?

    ``id_prefix`` and ``surface`` place the fact (the native line's imports are ``native.import.*`` facts of the
    ``native_imports`` surface); ``summary`` replaces the default one."""
    lines = tuple(lines)
    dotted = f"{module}.{name}"

    def observe(view: ApiView) -> Observation:
        if not view.has_module(module):
            alt = first_found(view, [f"{m}.{name}" for m in moved_to])
            if alt:
                return Observation(
                    "module_moved", f"module {module} is gone; {name} is at {alt[0]}", (evidence(alt[1]),)
                )
            return Observation("missing", f"module {module} does not exist")
        loc = view.locate(dotted)
        if loc is not None:
            return Observation(BASELINE, f"{dotted} is importable", (evidence(loc),))
        alt = first_found(view, [f"{m}.{name}" for m in moved_to])
        if alt:
            return Observation("moved", f"{module} no longer has {name}; it moved to {alt[0]}", (evidence(alt[1]),))
        return Observation("missing", f"{module} has no {name}, and it is not at any known new place")

    observe.__module__ = f"vllm_compat.probes.{surface}"
    return probe(
        f"{id_prefix}{module.removeprefix('vllm.')}.{name}",
        symbol=dotted,
        summary=summary or f"`from {module} import {name}` succeeds",
        expected={line: f"`from {module} import {name}` works" for line in lines},
    )(observe)


def _check_call(params: Sequence[Param], passed: Sequence[str], positional: int) -> tuple[list[str], list[str]]:
    """(rejected keyword names, required parameters left unfilled) for a call shape."""
    by_name = {p.name: p for p in params}
    takes_kwargs = any(p.kind == "var_keyword" for p in params)
    named = [p for p in params if p.kind not in {"var_positional", "var_keyword"}]
    filled_by_position = {p.name for p in named[:positional] if p.kind != "keyword_only"}
    rejected = [
        k
        for k in passed
        if not takes_kwargs and (k not in by_name or by_name[k].kind in {"positional_only", "var_positional"})
    ]
    missing = [p.name for p in named if p.required and p.name not in passed and p.name not in filled_by_position]
    return rejected, missing


check_call = _check_call  # (rejected keyword names, required parameters left unfilled) for a call shape


def call_probe(
    probe_id: str,
    candidates: Sequence[str],
    calls_by_line: Mapping[str, Sequence[str]],
    summary: str,
    positional_by_line: Mapping[str, int] | None = None,
) -> Probe:
    """speculators calls ``candidates[0](**kwargs)``: does this vLLM accept exactly that call?

    The variant names the mismatch, e.g. ``requires=is_encoder_decoder`` or ``rejects=kv_cache_specs``,
    so an adapter covers a precise shape and anything else stays unhandled. ``candidates`` lists the
    symbol's known homes (it may have moved); the probe judges the first one present.
    """
    positional_by_line = positional_by_line or {}

    def describe(line: str) -> str:
        n = positional_by_line.get(line, 0)
        shown = [f"<{n} positional>"] if n else []
        return f"{candidates[0].rsplit('.', 1)[-1]}({', '.join(shown + [f'{k}=' for k in calls_by_line[line]])})"

    def observe(view: ApiView) -> Observation:
        found = first_found(view, candidates)
        if found is None:
            return Observation("missing", f"{candidates[0]} does not exist")
        dotted, loc = found
        params = view.parameters(dotted)
        if params is None:
            return Observation.unknown(f"could not read the parameters of {dotted}", evidence(loc))
        signature = ", ".join(p.name + ("" if p.required else "=…") for p in params)
        per_line: dict[str, str] = {}
        for line, passed in calls_by_line.items():
            rejected, missing = _check_call(params, passed, positional_by_line.get(line, 0))
            parts = ([f"rejects={','.join(rejected)}"] if rejected else []) + (
                [f"requires={','.join(missing)}"] if missing else []
            )
            per_line[line] = ";".join(parts) or BASELINE
        return Observation(
            per_line[next(iter(calls_by_line))],
            f"{dotted}({signature})",
            (evidence(loc),),
            per_line=per_line,
        )

    observe.__module__ = f"vllm_compat.probes.{probe_id.split('.')[0]}"
    return probe(
        probe_id,
        symbol=candidates[0],
        summary=summary,
        expected={line: f"accepts {describe(line)}" for line in calls_by_line},
    )(observe)
