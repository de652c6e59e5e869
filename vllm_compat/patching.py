"""The patch engine's primitives: every patch goes through wrapt and can be undone exactly.

A revert only restores an attribute that still holds *our* replacement, so undoing vllm-compat can
never clobber a patch someone else applied on top (the OpenTelemetry ``unwrap`` rule). Where someone
wrapped our wrapper again (a tracer, say), our wrapper stays in their chain but is switched to a
pass-through, so the behaviour is reverted all the same; a later ``wrap()`` of the same label switches
that very wrapper on again instead of stacking a second one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import wrapt

__all__ = ["ItemPatch", "Patch", "scoped_environ", "set_attr", "set_item", "wrap"]

logger = logging.getLogger("vllm_compat")
_ABSENT = object()

Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


class _Switch:
    """The wrapper wrapt calls: ours while on, a plain pass-through while off."""

    def __init__(self, wrapper: Wrapper, label: str, before: Any) -> None:
        self.wrapper = wrapper
        self.label = label
        self.before = before  # what the owner held before the first wrap (for a revert once it is on top again)
        self.on = True
        self.replacement: Any = None  # the FunctionWrapper calling this switch

    def __call__(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if self.on:
            return self.wrapper(wrapped, instance, args, kwargs)
        return wrapped(*args, **kwargs)


@dataclass
class Patch:
    """One attribute replaced on one owner (module, class or instance)."""

    owner: Any
    name: str
    original: Any  # the object found in the owner's own namespace, or _ABSENT if it was inherited
    replacement: Any
    label: str
    switch: _Switch | None = None  # set for a wrapper (``wrap``): it can be turned into a pass-through

    @property
    def pass_through(self) -> bool:
        """Whether this wrapper was left in place, switched off, because someone wrapped it again."""
        return self.switch is not None and not self.switch.on

    def is_current(self) -> bool:
        return _own_attr(self.owner, self.name) is self.replacement

    def is_stuck(self) -> bool:
        """Whether a revert would leave this patch in effect: not a wrapper, and under someone else's wrapper."""
        return self.switch is None and not self.is_current() and self.is_in_place()

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
        """Restore the original. False if that would undo someone else's patch on top of ours: then a wrapper of
        ours is switched to a pass-through (``pass_through``), and any other patch stays in effect (logged)."""
        if not self.is_current():
            if self.switch is not None:
                self.switch.on = False
                if self.is_in_place():
                    logger.warning(
                        "vllm-compat: %s was wrapped again after vllm-compat patched it; its wrapper stays under "
                        "that one as a pass-through (vllm-compat's behaviour is off; install() turns it on again)",
                        self.label,
                    )
                    return False
                logger.warning("vllm-compat: %s was replaced after vllm-compat patched it; left as it is", self.label)
                return True  # nothing of ours is in effect there any more
            if self.is_in_place():
                logger.warning(
                    "vllm-compat: not reverting %s: it was wrapped again after vllm-compat patched it, and undoing "
                    "it would undo that wrapper too; it stays in effect",
                    self.label,
                )
                return False
            logger.warning("vllm-compat: %s was replaced after vllm-compat patched it; left as it is", self.label)
            return True
        if self.switch is not None:
            self.switch.on = False  # should anything still hold the wrapper, it passes calls through
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
    """Wrap ``owner.path`` (``"Class.method"`` or ``"function"``) with a wrapt FunctionWrapper.

    If a wrapper of ours with this label sits switched off under someone else's (see ``Patch.revert``), that one
    is switched on again with ``wrapper``: wrapping anew would run our wrapper twice once theirs is removed.
    """
    parent, attribute, original = wrapt.resolve_path(owner, path)
    dormant = _switched_off(_own_attr(parent, attribute), label)
    if dormant is not None:
        dormant.wrapper = wrapper
        dormant.on = True
        logger.info("vllm-compat: %s switched on again under the wrapper applied after it", label)
        return Patch(parent, attribute, dormant.before, dormant.replacement, label, dormant)
    before = _own_attr(parent, attribute)
    switch = _Switch(wrapper, label, before)
    replacement = wrapt.FunctionWrapper(original, switch)
    switch.replacement = replacement
    setattr(parent, attribute, replacement)
    return Patch(parent, attribute, before, replacement, label, switch)


def _switched_off(current: Any, label: str) -> _Switch | None:
    """Our switched-off wrapper with ``label`` in the chain of wrappers ``current`` heads, if any."""
    for _ in range(64):
        if current is _ABSENT or current is None:
            return None
        switch = getattr(current, "_self_wrapper", None)  # a wrapt FunctionWrapper's wrapper
        if isinstance(switch, _Switch) and switch.label == label and not switch.on:
            return switch
        current = getattr(current, "__wrapped__", None)
    return None


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
        if not self.is_current():  # a value, not a chain: ours is no longer in effect, and theirs is kept
            logger.warning("vllm-compat: %s was changed after vllm-compat set it; left as it is", self.label)
            return True
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


_environ_lock = threading.Lock()
_environ_saved: dict[str, tuple[int, str | None]] = {}  # variable -> (calls inside, value before the first)


@contextlib.contextmanager
def scoped_environ(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set environment variables (None: unset) for the duration of a call, then put back what was there.

    For what vLLM's worker processes must inherit from the generator's constructor, which starts them: set
    process-wide, the variables would reach every later child too (a ``vllm serve`` the script starts). Nested or
    concurrent scopes restore the original once the last one ends.
    """
    with _environ_lock:
        for name, value in values.items():
            depth, before = _environ_saved.get(name, (0, os.environ.get(name)))
            _environ_saved[name] = (depth + 1, before)
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    try:
        yield
    finally:
        with _environ_lock:
            for name in values:
                depth, before = _environ_saved.pop(name)
                if depth > 1:
                    _environ_saved[name] = (depth - 1, before)
                elif before is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = before


def _fresh_lock_in_forked_child() -> None:
    """A child forked while another thread held the lock would keep it locked forever (as the engine's lock)."""
    global _environ_lock
    _environ_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock_in_forked_child)
