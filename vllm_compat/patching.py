"""The patch engine's primitives: every patch goes through wrapt and can be undone exactly.

A revert only restores an attribute that still holds *our* replacement, so undoing vllm-compat can
never clobber a patch someone else applied on top (the OpenTelemetry ``unwrap`` rule).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import wrapt

__all__ = ["ItemPatch", "Patch", "set_attr", "set_item", "wrap"]

logger = logging.getLogger("vllm_compat")
_ABSENT = object()

Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


@dataclass
class Patch:
    """One attribute replaced on one owner (module, class or instance)."""

    owner: Any
    name: str
    original: Any  # the object found in the owner's own namespace, or _ABSENT if it was inherited
    replacement: Any
    label: str

    def is_current(self) -> bool:
        return _own_attr(self.owner, self.name) is self.replacement

    def is_in_place(self) -> bool:
        """Whether the replacement is in effect: the attribute itself, or wrapped by patches applied after it."""
        current = _own_attr(self.owner, self.name)
        for _ in range(64):  # a chain of wrappers, outermost first
            if current is self.replacement:
                return True
            if current is _ABSENT or current is None:
                return False
            current = getattr(current, "__wrapped__", None)
        return False

    def revert(self) -> bool:
        """Restore the original; False (and a log line) if someone replaced our replacement."""
        if not self.is_current():
            logger.warning("not reverting %s: it was replaced after vllm-compat patched it", self.label)
            return False
        if self.original is _ABSENT:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)
        return True


def _own_attr(owner: Any, name: str) -> Any:
    namespace = getattr(owner, "__dict__", None)
    if namespace is not None and name in namespace:
        return namespace[name]
    return _ABSENT


def wrap(owner: Any, path: str, wrapper: Wrapper, label: str) -> Patch:
    """Wrap ``owner.path`` (``"Class.method"`` or ``"function"``) with a wrapt FunctionWrapper."""
    parent, attribute, original = wrapt.resolve_path(owner, path)
    replacement = wrapt.FunctionWrapper(original, wrapper)
    before = _own_attr(parent, attribute)
    setattr(parent, attribute, replacement)
    return Patch(parent, attribute, before, replacement, label)


def set_attr(owner: Any, name: str, value: Any, label: str) -> Patch:
    """Bind ``owner.name = value`` (a shim for a name vLLM moved or removed, say)."""
    before = _own_attr(owner, name)
    setattr(owner, name, value)
    return Patch(owner, name, before, value, label)


@dataclass
class ItemPatch:
    """One key of a mapping set: an environment variable (``os.environ``) or a ``sys.modules`` entry."""

    mapping: Any
    key: str
    original: Any  # _ABSENT if the key was not there
    value: Any
    label: str

    def is_current(self) -> bool:
        return self.mapping.get(self.key, _ABSENT) is self.value or self.mapping.get(self.key) == self.value

    def revert(self) -> bool:
        if not self.is_current():
            logger.warning("not reverting %s: it was changed after vllm-compat set it", self.label)
            return False
        if self.original is _ABSENT:
            self.mapping.pop(self.key, None)
        else:
            self.mapping[self.key] = self.original
        return True


def set_item(mapping: Any, key: str, value: Any, label: str) -> ItemPatch:
    """Set ``mapping[key] = value``, remembering what was there."""
    original = mapping.get(key, _ABSENT)
    mapping[key] = value
    return ItemPatch(mapping, key, original, value, label)
