"""Post-import hooks for a few exact module names, safe when several threads import at once.

Why not ``wrapt.register_post_import_hook``: wrapt's finder answers ``find_spec`` by calling
``importlib.util.find_spec``, which imports the parent package. Python calls every meta-path finder while holding
the interpreter's global import lock, so a thread that imports ``vllm.config`` while another thread is still
executing ``vllm/__init__.py`` waits for ``vllm``'s module lock while holding the global lock, and the thread running
``vllm/__init__`` needs the global lock for its next import: both wait forever, and Python's module-lock deadlock
detection cannot see it. Our finder asks the finders after it, exactly as the import system would, and never
imports anything; it only wraps the found loader's ``exec_module`` so the hooks run right after the module body.
Every patch the hooks apply still goes through wrapt.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = ["register"]

Hook = Callable[[ModuleType], None]

_lock = threading.Lock()  # guards _hooks and the finder's installation; never held while a hook or import runs
_hooks: dict[str, list[tuple[Hook, bool]]] = {}  # module name -> (hook, once)


def register(name: str, hook: Hook, once: bool = False) -> None:
    """Call ``hook(module)`` after the module ``name`` is executed (now, if it is imported already).

    A hook stays registered, so a module imported again (after being removed from ``sys.modules``) is hooked again,
    unless ``once``. An exception from a hook makes the import fail, as an error in the module body would.
    """
    module = sys.modules.get(name)
    if module is not None and once:
        hook(module)
        return
    with _lock:
        _install_finder()
        _hooks.setdefault(name, []).append((hook, once))
    if module is not None:
        hook(module)


def _fire(name: str, module: ModuleType) -> None:
    with _lock:
        entries = list(_hooks.get(name, ()))
        if any(once for _, once in entries):
            _hooks[name] = [entry for entry in entries if not entry[1]]
    for hook, _ in entries:
        hook(module)


class _Finder:
    """A meta-path finder that claims nothing itself: for a hooked name it returns the spec the later finders give,
    with the loader wrapped. It imports nothing, so it cannot wait on another module's lock."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if fullname not in _hooks:  # the common case: one dict lookup
            return None
        meta_path = list(sys.meta_path)
        try:
            later = meta_path[meta_path.index(self) + 1 :]
        except ValueError:
            return None  # taken off sys.meta_path meanwhile
        for finder in later:
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is not None and not isinstance(loader, _Loader) and hasattr(loader, "exec_module"):
            spec.loader = _Loader(loader, fullname)
        return spec

    def invalidate_caches(self) -> None:
        """Nothing cached here (``importlib.invalidate_caches`` calls this on every finder)."""


class _Loader:
    """Runs the real loader, then the hooks. The module keeps the real loader as ``__loader__``."""

    def __init__(self, loader: Any, name: str) -> None:
        self.loader = loader
        self.name = name

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self.loader
        self.loader.exec_module(module)
        _fire(self.name, sys.modules.get(self.name, module))

    def __getattr__(self, attribute: str) -> Any:  # get_code, get_source, is_package, resource readers...
        return getattr(self.loader, attribute)


_finder: _Finder | None = None


def _install_finder() -> None:
    """Put the finder first on ``sys.meta_path`` once (called with ``_lock`` held)."""
    global _finder
    if _finder is None:
        _finder = _Finder()
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def _fresh_lock_in_forked_child() -> None:
    """A child forked while another thread held the lock would keep it locked forever (as the engine's lock)."""
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock_in_forked_child)
