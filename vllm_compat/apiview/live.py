"""LiveView: answer ApiView questions about the installed vLLM through import and ``inspect``."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import logging
import sys
import textwrap
from pathlib import Path
from typing import Any

from vllm_compat.apiview import Location, Param, Source, split_dotted
from vllm_compat.apiview._ast import class_body_binding, first_line
from vllm_compat.errors import UnhandledDrift
from vllm_compat.versions import installed_version

__all__ = ["LiveView"]

logger = logging.getLogger("vllm_compat")

_MISSING = object()
_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional_only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional_or_keyword",
    inspect.Parameter.VAR_POSITIONAL: "var_positional",
    inspect.Parameter.KEYWORD_ONLY: "keyword_only",
    inspect.Parameter.VAR_KEYWORD: "var_keyword",
}


class ImportBroken(RuntimeError):
    """A module this vLLM has does not import in this environment. What a probe would see of it (nothing) says
    nothing about vLLM's API, so the fact is unknown (``Fact.run``), never drifted."""

    def __init__(self, module: str, error: str) -> None:
        super().__init__(
            f"{module} is in this vLLM but does not import here ({error}): the environment is broken, not vLLM's "
            "API (a package vLLM imports missing or of another build, e.g. PyPI's torchvision beside a +cpu torch); "
            "fix it, or judge vLLM's files without importing them (`vllm-compat probe` without --live)"
        )
        self.module, self.error = module, error


def _is_self_or_parent(missing: str | None, module: str) -> bool:
    return bool(missing) and (module == missing or module.startswith(f"{missing}."))


class LiveView:
    """An ApiView over the vLLM importable in this process."""

    kind = "live"

    def __init__(self, package: str = "vllm") -> None:
        self.package = package
        self._import_errors: dict[str, str] = {}

    def version(self) -> str | None:
        found = installed_version(self.package)
        return str(found) if found is not None else None

    def has_module(self, module: str) -> bool:
        """Whether this vLLM has ``module``; ``ImportBroken`` where it has it but it does not import here."""
        return self._import(module) is not None

    def import_error(self, module: str) -> str | None:
        """Why ``module`` could not be imported, if it could not."""
        return self._import_errors.get(module)

    def locate(self, dotted: str) -> Location | None:
        member = self._class_member(dotted)
        if member is not None:
            owner, node, _ = member
            file, start = _file_line(owner)
            kind = "function" if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else "attribute"
            kind = "class" if isinstance(node, ast.ClassDef) else kind
            line = start + first_line(node) - 1 if start is not None else None
            return Location(owner.__module__, f"{owner.__qualname__}.{dotted.rsplit('.', 1)[1]}", kind, file, line)
        obj, module, qual = self._lookup(dotted)
        if obj is _MISSING:
            return None
        if inspect.ismodule(obj):
            return Location(obj.__name__, "", "module", _relative_file(obj), 1)
        target = inspect.unwrap(obj) if callable(obj) else obj
        defining = getattr(target, "__module__", None) or module
        qualname = getattr(target, "__qualname__", None) or qual
        if inspect.isclass(target):
            kind = "class"
        elif inspect.isroutine(target):
            kind = "function"
        else:
            kind, defining, qualname = "attribute", module, qual
        file, line = _file_line(target) if kind != "attribute" else (_relative_file(sys.modules.get(module)), None)
        if kind == "attribute" and file is not None:
            line = _attribute_line(sys.modules.get(module), qual)
        return Location(defining, qualname, kind, file, line)

    def parameters(self, dotted: str) -> tuple[Param, ...] | None:
        obj, _, _ = self._lookup(dotted)
        if obj is _MISSING or not callable(obj):
            return None
        try:
            signature = inspect.signature(obj)
        except (TypeError, ValueError):
            return None
        params = list(signature.parameters.values())
        if params and not inspect.isclass(obj) and (params[0].name == "self" or self._binds_first(dotted)):
            params = params[1:]  # the instance or the class, which Python passes: not a parameter a caller gives
        return tuple(_param(p) for p in params)

    def _binds_first(self, dotted: str) -> bool:
        """Whether ``dotted`` is a method or classmethod of a class: Python passes its first parameter (whatever its
        name: ``cls`` for a classmethod), as the static view reads it. ``_lookup`` unwraps classmethods, so ask the
        class's own attribute."""
        owner_name, _, attr = dotted.rpartition(".")
        owner, _, _ = self._lookup(owner_name) if owner_name else (_MISSING, "", "")
        if owner is _MISSING or not inspect.isclass(owner):
            return False
        try:
            raw = inspect.getattr_static(owner, attr)
        except AttributeError:
            return False
        return isinstance(raw, classmethod) or inspect.isfunction(raw)

    def source(self, dotted: str) -> Source | None:
        member = self._class_member(dotted)
        if member is not None:
            owner, node, text = member
            file, start = _file_line(owner)
            segment = ast.get_source_segment(text, node, padded=True)
            if segment is None:
                return None
            line = start + first_line(node) - 1 if start is not None else None
            return Source(text=textwrap.dedent(segment), file=file, line=line)
        obj, _, _ = self._lookup(dotted)
        if obj is _MISSING:
            return None
        target = inspect.unwrap(obj) if callable(obj) else obj
        try:
            lines, start = inspect.getsourcelines(target)
        except (OSError, TypeError):
            return None
        file, _ = _file_line(target)
        return Source(text=textwrap.dedent("".join(lines)).rstrip("\n"), file=file, line=start)

    def members(self, dotted: str) -> frozenset[str] | None:
        obj, _, _ = self._lookup(dotted)
        if obj is _MISSING or not inspect.isclass(obj):
            return None
        names: set[str] = set()
        for cls in obj.__mro__:
            if cls is object:
                continue
            names.update(vars(cls))
            names.update(getattr(cls, "__annotations__", {}))
        return frozenset(n for n in names if not (n.startswith("__") and n.endswith("__")) or n == "__init__")

    # -- helpers ---------------------------------------------------------------------------
    def _class_member(self, dotted: str) -> tuple[type, ast.stmt, str] | None:
        """For ``pkg.mod.Class.name``: the class in the MRO whose body binds ``name``, that statement, its source.

        Read from the class's source text, as StaticView does: decorators such as vLLM's
        ``@support_torch_compile`` replace ``__init__`` with a closure whose source says nothing about the class,
        and dataclass fields without defaults are not class attributes at all.
        """
        owner_dotted, _, name = dotted.rpartition(".")
        owner, _, _ = self._lookup(owner_dotted) if owner_dotted else (_MISSING, "", "")
        if owner is _MISSING or not inspect.isclass(owner):
            return None
        for cls in owner.__mro__:
            if cls is object or cls.__module__ == "builtins":
                continue
            try:
                text = textwrap.dedent(inspect.getsource(cls))
                tree = ast.parse(text)
            except (OSError, TypeError, SyntaxError):
                continue
            node = next((n for n in tree.body if isinstance(n, ast.ClassDef)), None)
            if node is None:
                continue
            found = class_body_binding(node, name)
            if found is not None:
                return cls, found, text
        return None

    def _import(self, module: str) -> Any:
        """The module, None where this vLLM has no such module; ``ImportBroken`` where it has one that does not
        import here (a package it needs missing or of another build): a name in it is not known to be missing."""
        if module in sys.modules:
            return sys.modules[module]
        if module in self._import_errors:
            raise ImportBroken(module, self._import_errors[module])
        try:
            if importlib.util.find_spec(module) is None:
                return None
            return importlib.import_module(module)
        except Exception as exc:  # finding a submodule imports its parents, which may fail
            if isinstance(exc, ModuleNotFoundError) and _is_self_or_parent(exc.name, module):
                return None  # the module (or a package above it) is not in this vLLM: absent, not broken
            self._import_errors[module] = f"{type(exc).__name__}: {exc}"
            logger.debug("could not import %s: %s", module, exc)
            raise ImportBroken(module, self._import_errors[module]) from exc

    def _lookup(self, dotted: str) -> tuple[Any, str, str]:
        split = split_dotted(dotted, lambda m: self._import(m) is not None)
        if split is None:
            return _MISSING, "", ""
        module, rest = split
        obj: Any = sys.modules[module]
        for attr in rest:
            try:
                obj = inspect.getattr_static(obj, attr) if inspect.isclass(obj) else getattr(obj, attr)
            except (AttributeError, UnhandledDrift):  # (vllm-compat's own missing-name guard answers for a name)
                return _MISSING, module, ".".join(rest)
            if isinstance(obj, staticmethod | classmethod):
                obj = obj.__func__
        return obj, module, ".".join(rest)


def _param(p: inspect.Parameter) -> Param:
    has_default = p.default is not inspect.Parameter.empty
    variadic = p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    annotation = None
    if p.annotation is not inspect.Parameter.empty:
        annotation = p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(p.annotation)
    return Param(
        p.name,
        _KINDS[p.kind],
        not has_default and not variadic,
        repr(p.default) if has_default else None,
        annotation,
    )


def _relative_file(obj: Any) -> str | None:
    if obj is None:
        return None
    try:
        path = inspect.getsourcefile(obj) or inspect.getfile(obj)
    except TypeError:
        return None
    return _package_relative(path, getattr(obj, "__name__", "") if inspect.ismodule(obj) else obj.__module__)


def _package_relative(path: str, module: str) -> str:
    """``.../site-packages/vllm/config/x.py`` -> ``vllm/config/x.py``."""
    top = module.split(".")[0]
    parts = Path(path).parts
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] == top:
            return "/".join(parts[i:])
    return path


def _file_line(obj: Any) -> tuple[str | None, int | None]:
    try:
        path = inspect.getsourcefile(obj)
        _, line = inspect.getsourcelines(obj)
    except (OSError, TypeError):
        return None, None
    if path is None:
        return None, None
    return _package_relative(path, getattr(obj, "__module__", "") or ""), line


def _attribute_line(module: Any, name: str) -> int | None:
    """Line of a module-level assignment, found by reading the module's source."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.lineno
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node.lineno
    return None
