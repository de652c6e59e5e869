"""The Adapter contract: one drift, one patch, applied on import of one target module."""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any, ClassVar

from vllm_compat.patching import ItemPatch, Patch, Wrapper, set_attr, set_item, wrap

__all__ = ["Adapter", "load_adapters", "registered_adapters"]

logger = logging.getLogger("vllm_compat")
_REGISTRY: dict[str, type[Adapter]] = {}


class Adapter:
    """Base class. A subclass declares what it fixes; ``apply`` patches, ``revert`` undoes.

    Class attributes (the adapter's metadata; the docs catalogue is generated from them):
      id:          stable name, used in reports and ``status()``.
      covers:      probe id -> drift variants of that probe this adapter makes harmless.
      speculators: the speculators versions it serves (a PEP 440 specifier set).
      target:      the module whose import triggers ``apply`` (a vLLM or speculators module).
      side:        "parent" (the generator's process) or "worker" (every vLLM worker process).
      first_vllm:  the first vLLM release that needs it.
      remove_when: when the adapter can be deleted.
      always:      non-empty for an adapter that no vLLM finding calls for: a speculators defect or a
                   run-time condition (such as vLLM's CPU platform) that the adapter checks itself.
                   The text says why; the report shows it.
      order:       adapters of one target are applied in ascending order (then in registry order); a wrapper
                   applied later sits outside those applied before it.
      relies_on:   probe id -> the variants under which the adapter's patch is right. A plan takes the adapter for
                   a drift only where every such fact holds (an unknown fact does not): otherwise the next adapter
                   that covers the drift, or none (the drift is unhandled, and the report names the fact).
      companion_of: the id of another adapter this one is the other half of (its worker side, say): applied
                   exactly where the plan takes that adapter; it covers nothing itself.
    The class docstring says what broke, why it is fixed at this place, and upstream references.
    """

    id: ClassVar[str]
    covers: ClassVar[Mapping[str, frozenset[str]]]
    speculators: ClassVar[str] = ">=0.3,<0.5"
    target: ClassVar[str]
    side: ClassVar[str] = "parent"
    first_vllm: ClassVar[str] = ""
    remove_when: ClassVar[str] = "speculators no longer uses the in-process generator (>= 0.5)"
    always: ClassVar[str] = ""
    order: ClassVar[int] = 0
    relies_on: ClassVar[Mapping[str, frozenset[str]]] = {}
    companion_of: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "id" not in cls.__dict__:
            return  # an abstract intermediate class
        if cls.id in _REGISTRY and _REGISTRY[cls.id].__qualname__ != cls.__qualname__:
            raise ValueError(f"duplicate adapter id {cls.id!r}")
        cls.covers = {k: frozenset(v) for k, v in getattr(cls, "covers", {}).items()}
        cls.relies_on = {k: frozenset(v) for k, v in getattr(cls, "relies_on", {}).items()}
        _REGISTRY[cls.id] = cls

    def __init__(self) -> None:
        self._patches: list[Patch | ItemPatch] = []
        self.pass_through: list[str] = []  # wrappers left switched off under someone else's (see revert)
        self.reason: str = ""

    # -- metadata helpers ------------------------------------------------------------------
    @classmethod
    def serves(cls, speculators_version: str) -> bool:
        """Whether it serves a speculators line or version; a native line (``native-0.9``) stands for its minor
        release (``0.9``), so only adapters whose specifier names 0.5 to 0.9 serve the native lines."""
        from packaging.specifiers import SpecifierSet  # imported on use: keeps `import vllm_compat` light

        version = str(speculators_version).removeprefix("native-")
        return SpecifierSet(cls.speculators).contains(version)

    @classmethod
    def covers_variant(cls, probe_id: str, variant: str) -> bool:
        return variant in cls.covers.get(probe_id, frozenset())

    @property
    def applied(self) -> bool:
        return bool(self._patches)

    # -- patching --------------------------------------------------------------------------
    def apply(self, module: ModuleType) -> None:
        """Patch ``module`` (the imported target). Must be idempotent through ``applied``."""
        raise NotImplementedError

    def revert(self) -> None:
        """Undo the patches, last first. A wrapper that someone wrapped again since is switched to a pass-through
        (listed in ``pass_through``). If another patch cannot be undone without undoing someone else's, the adapter
        is left applied as a whole (``applied`` stays true, logged): half an adapter would be neither fix nor
        original."""
        stuck = [patch.label for patch in self._patches if isinstance(patch, Patch) and patch.is_stuck()]
        if stuck:
            logger.warning(
                "vllm-compat: adapter %s stays applied: %s was wrapped again after vllm-compat patched it, and "
                "undoing it would undo that wrapper too; remove the other wrapper first",
                self.id,
                ", ".join(stuck),
            )
            return
        for patch in reversed(self._patches):
            if not patch.revert() and isinstance(patch, Patch) and patch.pass_through:
                self.pass_through.append(patch.label)
        self._patches.clear()

    def wrap(self, owner: Any, path: str, wrapper: Wrapper) -> None:
        self._patches.append(wrap(owner, path, wrapper, f"{self.id}: {_name(owner)}.{path}"))

    def set_env(self, name: str, value: str) -> None:
        """Set an environment variable; vLLM's worker processes inherit it."""
        self._patches.append(set_item(os.environ, name, value, f"{self.id}: ${name}"))

    def set_module(self, name: str, module: ModuleType) -> None:
        """Register ``module`` as importable under ``name`` (a module vLLM removed or has yet to add)."""
        self._patches.append(set_item(sys.modules, name, module, f"{self.id}: sys.modules[{name!r}]"))
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            self.set_attr(sys.modules[parent], child, module)

    def set_attr(self, owner: Any, name: str, value: Any) -> None:
        self._patches.append(set_attr(owner, name, value, f"{self.id}: {_name(owner)}.{name}"))


def _name(owner: Any) -> str:
    return getattr(owner, "__name__", type(owner).__name__)


def load_adapters() -> dict[str, type[Adapter]]:
    """Import every module of ``vllm_compat.adapters`` (cheap: none imports vLLM or torch)."""
    package = importlib.import_module("vllm_compat.adapters")
    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{info.name}")
    return _REGISTRY


def registered_adapters() -> dict[str, type[Adapter]]:
    return _REGISTRY
