"""AST helpers shared by StaticView and LiveView (which reads class bodies from source, too)."""

from __future__ import annotations

import ast

__all__ = ["class_body_binding", "first_line", "target_binds"]


def first_line(node: ast.AST) -> int | None:
    decorators = getattr(node, "decorator_list", None)
    if decorators:
        return min(d.lineno for d in decorators)
    return getattr(node, "lineno", None)


def target_binds(target: ast.expr, name: str) -> bool:
    if isinstance(target, ast.Name):
        return target.id == name
    if isinstance(target, ast.Tuple | ast.List):
        return any(target_binds(e, name) for e in target.elts)
    return False


def class_body_binding(node: ast.ClassDef, attr: str) -> ast.stmt | None:
    found = None
    for stmt in node.body:
        if (
            (isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and stmt.name == attr)
            or (isinstance(stmt, ast.Assign) and any(target_binds(t, attr) for t in stmt.targets))
            or (isinstance(stmt, ast.AnnAssign) and target_binds(stmt.target, attr))
        ):
            found = stmt
    return found
