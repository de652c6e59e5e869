"""StaticView: answer ApiView questions from source text with ``ast``, without importing vLLM.

It reads a source tree (a folder holding ``vllm/``, or the ``vllm/`` folder itself, or a
site-packages folder) or a wheel file, and only the modules a question needs (straight from the
zip for a wheel). It understands what vLLM's own code uses: plain and pydantic dataclasses
(including vLLM's ``@config`` decorator), ``field(default=...)``/``default_factory``, ``InitVar``,
explicit ``__init__``, inheritance, re-exports through ``from x import y`` and lazy ``__getattr__``
export tables in ``__init__.py``.
"""

from __future__ import annotations

import ast
import re
import textwrap
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from vllm_compat.apiview import Location, Param, Source, split_dotted
from vllm_compat.apiview._ast import class_body_binding, first_line, target_binds

__all__ = ["StaticSourceError", "StaticView"]

_DATACLASS_DECORATORS = {"dataclass", "config", "dataclasses.dataclass", "pydantic.dataclasses.dataclass"}
_FIELD_CALLS = {"field", "dataclasses.field", "Field", "pydantic.Field"}
_MAX_HOPS = 12  # re-export chains longer than this are treated as cycles


class StaticSourceError(Exception):
    """The given path is not a readable vLLM source tree or wheel."""


@dataclass(frozen=True)
class _Def:
    """A resolved definition: the module it lives in and its AST node (None for a module)."""

    module: str
    node: ast.AST | None
    qualname: str


class _Reader:
    def read(self, rel: str) -> str | None:  # pragma: no cover - interface
        raise NotImplementedError

    def exists(self, rel: str) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def listdir(self, rel: str) -> list[str]:  # pragma: no cover - interface
        raise NotImplementedError


class _DirReader(_Reader):
    def __init__(self, root: Path) -> None:
        self.root = root

    def read(self, rel: str) -> str | None:
        try:
            return (self.root / rel).read_text(encoding="utf-8", errors="replace")
        except (OSError, ValueError):
            return None

    def exists(self, rel: str) -> bool:
        return (self.root / rel).exists()

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(p.name for p in (self.root / rel).iterdir())
        except OSError:
            return []


class _WheelReader(_Reader):
    def __init__(self, path: Path) -> None:
        try:
            self.zip = zipfile.ZipFile(path)
            self.names = set(self.zip.namelist())
        except (zipfile.BadZipFile, OSError) as exc:
            raise StaticSourceError(f"{path} is not a readable wheel: {exc}") from exc

    def read(self, rel: str) -> str | None:
        if rel not in self.names:
            return None
        try:
            return self.zip.read(rel).decode("utf-8", errors="replace")
        except Exception:  # a damaged member (bad CRC, zlib.error, unsupported compression...) reads as absent
            return None

    def exists(self, rel: str) -> bool:
        return rel in self.names or any(n.startswith(rel.rstrip("/") + "/") for n in self.names)

    def listdir(self, rel: str) -> list[str]:
        prefix = rel.rstrip("/") + "/" if rel else ""
        return sorted({n[len(prefix) :].split("/")[0] for n in self.names if n.startswith(prefix)})


class StaticView:
    """An ApiView over a vLLM source tree or wheel, read with ``ast``."""

    kind = "static"

    def __init__(self, path: str | Path, package: str = "vllm") -> None:
        path = Path(path)
        self.path = path
        self.package = package
        if path.is_file():
            self._reader: _Reader = _WheelReader(path)
        elif (path / package / "__init__.py").is_file():
            self._reader = _DirReader(path)
        elif path.name == package and (path / "__init__.py").is_file():
            self._reader = _DirReader(path.parent)
        else:
            raise StaticSourceError(f"{path} holds no {package}/__init__.py and is not a wheel")
        if not self._reader.exists(f"{package}/__init__.py"):
            raise StaticSourceError(f"{path} holds no {package} package")
        self._parse = lru_cache(maxsize=None)(self._parse_uncached)

    # -- ApiView ---------------------------------------------------------------------------
    def version(self) -> str | None:
        for name in self._reader.listdir(""):
            m = re.fullmatch(rf"{self.package}(?:[-_]cpu)?-(.+)\.dist-info", name)
            if m:
                text = self._reader.read(f"{name}/METADATA") or ""
                found = re.search(r"^Version:\s*(\S+)", text, re.M)
                if found:
                    return found.group(1).split("+")[0]  # "0.17.0+cpu" -> "0.17.0", as installed_version()
        text = self._reader.read(f"{self.package}/_version.py") or ""
        found = re.search(r"""^(?:__version__|version)\s*(?::[^=]+)?=\s*['"]([^'"]+)['"]""", text, re.M)
        return found.group(1) if found else None

    def has_module(self, module: str) -> bool:
        return self._module_file(module) is not None

    def locate(self, dotted: str) -> Location | None:
        found = self._resolve(dotted)
        if found is None:
            return None
        return self._location(found)

    def parameters(self, dotted: str) -> tuple[Param, ...] | None:
        found = self._resolve(dotted)
        if found is None or found.node is None:
            return None
        if isinstance(found.node, ast.FunctionDef | ast.AsyncFunctionDef):
            params = _function_params(found.node)
            in_class = "." in found.qualname
            return params[1:] if in_class and _is_method(found.node) else params
        if isinstance(found.node, ast.ClassDef):
            return self._class_params(found, hops=0)
        return None

    def source(self, dotted: str) -> Source | None:
        found = self._resolve(dotted)
        if found is None or found.node is None:
            return None
        text = self._reader.read(self._module_file(found.module) or "")
        if text is None:
            return None
        segment = ast.get_source_segment(text, found.node, padded=True)
        if segment is None:
            return None
        start = first_line(found.node)
        return Source(text=textwrap.dedent(segment), file=self._module_file(found.module), line=start)

    def members(self, dotted: str) -> frozenset[str] | None:
        found = self._resolve(dotted)
        if found is None or not isinstance(found.node, ast.ClassDef):
            return None
        names: set[str] = set()
        for cls in self._mro(found, hops=0):
            names.update(_class_body_names(cls.node))  # type: ignore[arg-type]
        return frozenset(names)

    # -- modules ---------------------------------------------------------------------------
    def _module_file(self, module: str) -> str | None:
        rel = module.replace(".", "/")
        for candidate in (f"{rel}.py", f"{rel}/__init__.py"):
            if self._reader.exists(candidate) and self._reader.read(candidate) is not None:
                return candidate
        return None

    def _parse_uncached(self, module: str) -> ast.Module | None:
        rel = self._module_file(module)
        if rel is None:
            return None
        text = self._reader.read(rel)
        if text is None:
            return None
        try:
            return ast.parse(text)
        except (SyntaxError, ValueError):
            return None

    def _is_package(self, module: str) -> bool:
        rel = self._module_file(module)
        return rel is not None and rel.endswith("__init__.py")

    # -- name resolution -------------------------------------------------------------------
    def _resolve(self, dotted: str) -> _Def | None:
        split = split_dotted(dotted, self.has_module)
        if split is None:
            return None
        module, rest = split
        if not rest:
            return _Def(module, None, "")
        found = self._resolve_in_module(module, rest[0], hops=0)
        for attr in rest[1:]:
            if found is None or not isinstance(found.node, ast.ClassDef):
                return None
            found = self._class_member(found, attr, hops=0)
        return found

    def _resolve_in_module(self, module: str, name: str, hops: int) -> _Def | None:
        if hops > _MAX_HOPS:
            return None
        tree = self._parse(module)
        if tree is None:
            return None
        binding = _last_binding(tree, name)
        if binding is None:
            for star in _star_imports(tree):
                source = _absolute(module, "." * star.level + (star.module or ""), self._is_package(module))
                source_tree = self._parse(source)
                if source_tree is None or not _star_exports(source_tree, name):
                    continue
                found = self._resolve_in_module(source, name, hops + 1)
                if found is not None:
                    return found
            lazy = _lazy_export(tree, name)
            if lazy is not None:
                target_module, target_name = _absolute(module, lazy[0], self._is_package(module)), lazy[1]
                return self._resolve_in_module(target_module, target_name, hops + 1)
            submodule = f"{module}.{name}"
            if self.has_module(submodule):
                return _Def(submodule, None, "")
            return None
        if isinstance(binding, ast.ImportFrom):
            alias = next(a for a in binding.names if (a.asname or a.name) == name)
            source = _absolute(module, "." * binding.level + (binding.module or ""), self._is_package(module))
            if (
                self.has_module(f"{source}.{alias.name}")
                and _last_binding(self._parse(source) or ast.Module(body=[], type_ignores=[]), alias.name) is None
            ):
                return _Def(f"{source}.{alias.name}", None, "")
            return self._resolve_in_module(source, alias.name, hops + 1)
        if isinstance(binding, ast.Import):
            alias = next(a for a in binding.names if (a.asname or a.name.split(".")[0]) == name)
            target = alias.name if alias.asname else alias.name.split(".")[0]
            return _Def(target, None, "") if self.has_module(target) else None
        return _Def(module, binding, name)

    def _class_member(self, cls: _Def, attr: str, hops: int) -> _Def | None:
        for owner in self._mro(cls, hops):
            node = class_body_binding(owner.node, attr)  # type: ignore[arg-type]
            if node is not None:
                return _Def(owner.module, node, f"{owner.qualname}.{attr}")
        return None

    def _bases(self, cls: _Def, hops: int) -> Iterator[_Def]:
        assert isinstance(cls.node, ast.ClassDef)
        for base in cls.node.bases:
            name = _dotted_name(base)
            if name is None:
                continue
            head, _, tail = name.partition(".")
            found = self._resolve_in_module(cls.module, head, hops + 1)
            for part in tail.split(".") if tail else []:
                if found is None:
                    break
                if found.node is None:  # a module
                    found = self._resolve_in_module(found.module, part, hops + 1)
                elif isinstance(found.node, ast.ClassDef):
                    found = self._class_member(found, part, hops + 1)
                else:
                    found = None
            if found is not None and isinstance(found.node, ast.ClassDef):
                yield found

    def _mro(self, cls: _Def, hops: int) -> list[_Def]:
        """Depth-first linearisation of the classes the view can resolve (enough for lookups)."""
        order: list[_Def] = []
        seen: set[tuple[str, str]] = set()

        def visit(c: _Def, depth: int) -> None:
            key = (c.module, c.qualname)
            if key in seen or depth > _MAX_HOPS:
                return
            seen.add(key)
            order.append(c)
            for base in self._bases(c, hops + depth):
                visit(base, depth + 1)

        visit(cls, 0)
        return order

    # -- constructor parameters ------------------------------------------------------------
    def _class_params(self, cls: _Def, hops: int) -> tuple[Param, ...] | None:
        mro = self._mro(cls, hops)
        for owner in mro:
            assert isinstance(owner.node, ast.ClassDef)
            init = class_body_binding(owner.node, "__init__")
            if isinstance(init, ast.FunctionDef | ast.AsyncFunctionDef):
                return _function_params(init)[1:]
            if _is_dataclass(owner.node) or _is_struct(owner.node):
                chain = [c for c in mro if _is_dataclass(c.node) or _is_struct(c.node)]
                return self._dataclass_params(chain)
        return ()

    def _dataclass_params(self, chain: list[_Def]) -> tuple[Param, ...]:
        fields: dict[str, Param] = {}
        kw_only_names: set[str] = set()
        for owner in reversed(chain):  # base classes first, as dataclasses orders fields
            assert isinstance(owner.node, ast.ClassDef)
            class_kw_only = _decorator_kw_only(owner.node)
            kw_only_from_here = False
            for stmt in owner.node.body:
                if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
                    continue
                annotation = ast.unparse(stmt.annotation)
                if annotation.endswith("KW_ONLY"):
                    kw_only_from_here = True
                    continue
                if annotation.startswith(("ClassVar", "typing.ClassVar")):
                    continue
                required, default, init = _field_default(stmt.value)
                name = stmt.target.id
                if not init:
                    fields.pop(name, None)
                    continue
                fields.pop(name, None)  # a redefinition moves nothing in dataclasses, but wins
                fields[name] = Param(name, "positional_or_keyword", required, default, annotation)
                if class_kw_only or kw_only_from_here or _field_kw_only(stmt.value):
                    kw_only_names.add(name)
        params = [
            Param(p.name, "keyword_only", p.required, p.default, p.annotation) if p.name in kw_only_names else p
            for p in fields.values()
        ]
        return tuple(params)

    def _location(self, found: _Def) -> Location:
        if found.node is None:
            return Location(found.module, "", "module", self._module_file(found.module), 1)
        node = found.node
        if isinstance(node, ast.ClassDef):
            kind = "class"
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            kind = "function"
        else:
            kind = "attribute"
        return Location(found.module, found.qualname, kind, self._module_file(found.module), first_line(node))


# -- AST helpers (pure functions) ------------------------------------------------------------


def _top_level_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements that bind module names: the body, and branches of if/try (not TYPE_CHECKING-only)."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            if _dotted_name(stmt.test) in {"TYPE_CHECKING", "typing.TYPE_CHECKING"}:
                yield from _top_level_statements(stmt.orelse)
                continue
            yield from _top_level_statements(stmt.body)
            yield from _top_level_statements(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            yield from _top_level_statements(stmt.body)
            for handler in stmt.handlers:
                yield from _top_level_statements(handler.body)
            yield from _top_level_statements(stmt.orelse)
        else:
            yield stmt


def _binds(stmt: ast.stmt, name: str) -> bool:
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return stmt.name == name
    if isinstance(stmt, ast.ImportFrom):
        return any((a.asname or a.name) == name for a in stmt.names)
    if isinstance(stmt, ast.Import):
        return any((a.asname or a.name.split(".")[0]) == name for a in stmt.names)
    if isinstance(stmt, ast.Assign):
        return any(target_binds(t, name) for t in stmt.targets)
    if isinstance(stmt, ast.AnnAssign):
        return stmt.value is not None and target_binds(stmt.target, name)
    return False


def _last_binding(tree: ast.Module, name: str) -> ast.stmt | None:
    found = None
    for stmt in _top_level_statements(tree.body):
        if _binds(stmt, name):
            found = stmt
    return found


def _star_imports(tree: ast.Module) -> list[ast.ImportFrom]:
    return [
        stmt
        for stmt in _top_level_statements(tree.body)
        if isinstance(stmt, ast.ImportFrom) and any(a.name == "*" for a in stmt.names)
    ]


def _star_exports(tree: ast.Module, name: str) -> bool:
    """Whether ``from module import *`` brings ``name``: listed in ``__all__``, or public if none."""
    binding = _last_binding(tree, "__all__")
    if isinstance(binding, ast.Assign | ast.AnnAssign) and isinstance(binding.value, ast.List | ast.Tuple):
        return any(isinstance(e, ast.Constant) and e.value == name for e in binding.value.elts)
    return not name.startswith("_")


def _lazy_export(tree: ast.Module, name: str) -> tuple[str, str] | None:
    """A lazy export table entry for ``name`` in a module that defines ``__getattr__``.

    vLLM's top-level ``__init__`` maps names to ``"module:attr"`` (or ``"module.attr"``) strings
    and imports them on first access.
    """
    if _last_binding(tree, "__getattr__") is None:
        return None
    for stmt in _top_level_statements(tree.body):
        value = stmt.value if isinstance(stmt, ast.Assign | ast.AnnAssign) else None
        if not isinstance(value, ast.Dict):
            continue
        for key, val in zip(value.keys, value.values, strict=False):
            if isinstance(key, ast.Constant) and key.value == name and isinstance(val, ast.Constant):
                target = str(val.value)
                if ":" in target:
                    mod, _, attr = target.partition(":")
                    return mod, attr
                mod, _, attr = target.rpartition(".")
                return (mod, attr) if mod else None
    return None


def _absolute(module: str, target: str, is_package: bool) -> str:
    level = len(target) - len(target.lstrip("."))
    if level == 0:
        return target
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    rest = target[level:]
    return ".".join([*base, rest]) if rest else ".".join(base)


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted_name(node.value)
        return f"{head}.{node.attr}" if head else None
    if isinstance(node, ast.Subscript):  # Generic[T], Base[X]
        return _dotted_name(node.value)
    if isinstance(node, ast.Call):
        return _dotted_name(node.func)
    return None


def _is_method(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    names = {_dotted_name(d) for d in node.decorator_list}
    return "staticmethod" not in names


def _class_body_names(node: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for stmt in node.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
    return names


def _is_dataclass(node: ast.AST) -> bool:
    if not isinstance(node, ast.ClassDef):
        return False
    return any(_dotted_name(d) in _DATACLASS_DECORATORS for d in node.decorator_list)


def _is_struct(node: ast.AST) -> bool:
    """A msgspec Struct (vLLM's SamplingParams): fields are its annotated class attributes."""
    if not isinstance(node, ast.ClassDef):
        return False
    return any(_dotted_name(b) in {"msgspec.Struct", "Struct"} for b in node.bases)


def _decorator_kw_only(node: ast.ClassDef) -> bool:
    if any(kw.arg == "kw_only" and isinstance(kw.value, ast.Constant) and kw.value.value for kw in node.keywords):
        return True
    for d in node.decorator_list:
        if isinstance(d, ast.Call) and _dotted_name(d) in _DATACLASS_DECORATORS:
            for kw in d.keywords:
                if kw.arg == "kw_only" and isinstance(kw.value, ast.Constant) and kw.value.value is True:
                    return True
    return False


def _field_kw_only(value: ast.expr | None) -> bool:
    if isinstance(value, ast.Call) and _dotted_name(value.func) in _FIELD_CALLS:
        for kw in value.keywords:
            if kw.arg == "kw_only" and isinstance(kw.value, ast.Constant) and kw.value.value is True:
                return True
    return False


def _field_default(value: ast.expr | None) -> tuple[bool, str | None, bool]:
    """(required, default text, in __init__) of a dataclass field's right-hand side."""
    if value is None:
        return True, None, True
    if isinstance(value, ast.Call) and _dotted_name(value.func) in _FIELD_CALLS:
        init = True
        default: str | None = None
        required = True
        for arg in value.args[:1]:  # pydantic Field(default, ...)
            if not (isinstance(arg, ast.Constant) and arg.value is Ellipsis):
                required, default = False, ast.unparse(arg)
        for kw in value.keywords:
            if kw.arg == "default":
                required, default = False, ast.unparse(kw.value)
            elif kw.arg == "default_factory":
                required, default = False, f"{ast.unparse(kw.value)}()"
            elif kw.arg == "init" and isinstance(kw.value, ast.Constant) and kw.value.value is False:
                init = False
        return required, default, init
    return False, ast.unparse(value), True


def _function_params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[Param, ...]:
    args = node.args
    params: list[Param] = []
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        kind = "positional_only" if i < len(args.posonlyargs) else "positional_or_keyword"
        params.append(_param(arg, kind, default))
    if args.vararg:
        params.append(Param(args.vararg.arg, "var_positional", False, None, _annotation(args.vararg)))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        params.append(_param(arg, "keyword_only", default))
    if args.kwarg:
        params.append(Param(args.kwarg.arg, "var_keyword", False, None, _annotation(args.kwarg)))
    return tuple(params)


def _param(arg: ast.arg, kind: str, default: ast.expr | None) -> Param:
    return Param(
        arg.arg,
        kind,
        default is None,
        ast.unparse(default) if default is not None else None,
        _annotation(arg),
    )


def _annotation(arg: ast.arg) -> str | None:
    return ast.unparse(arg.annotation) if arg.annotation is not None else None
