"""Adapters that let speculators' model configs work next to the transformers that new vLLM releases require.

vLLM 0.24 and later require transformers >= 5.5.3. transformers 5 turned ``PreTrainedConfig`` into a dataclass
that rewrites its subclasses, while speculators' ``SpeculatorModelConfig`` is both a pydantic model and a
``PretrainedConfig``. Extraction does not build these configs, but the training step that follows it does:
speculators' training script starts with ``Eagle3SpeculatorConfig(...)`` and its trainer ends each epoch with
``save_pretrained``. Each adapter checks the condition it fixes in the transformers that speculators actually
imported (``speculators.config.PretrainedConfig``), so with transformers 4 none of them patches anything.

What they change happens to each speculators config class when it is created (classes created before vllm-compat
was installed are fixed when it is); ``uninstall()`` stops it for classes created later.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from types import ModuleType
from typing import Any

from vllm_compat.adapter import Adapter

logger = logging.getLogger("vllm_compat")
TARGET = "speculators.config"
FIRST_VLLM = "0.24.0 (requires transformers >= 5.5.3)"


def _subclasses(cls: type) -> list[type]:
    found, todo = [], list(cls.__subclasses__())
    while todo:
        sub = todo.pop()
        if sub not in found:
            found.append(sub)
            todo.extend(sub.__subclasses__())
    return found


def _generated_init(cls: type) -> bool:
    """Whether ``cls`` holds an ``__init__`` that transformers generated (a dataclass init, or its kwargs wrapper)."""
    code = getattr(cls.__dict__.get("__init__"), "__code__", None)
    if code is None:
        return False
    return code.co_filename == "<string>" or os.path.basename(os.path.dirname(code.co_filename)) == "transformers"


class SpeculatorConfigInit(Adapter):
    """Keep ``SpeculatorModelConfig.__init__`` for every speculators config class under transformers 5.

    What broke: transformers 5's ``PreTrainedConfig.__init_subclass__`` makes every subclass a dataclass and, when
    the subclass defines no ``__init__`` of its own, gives it a generated one that assigns each dataclass field with
    ``setattr``. speculators' config classes (``Eagle3SpeculatorConfig``, ...) inherit their ``__init__`` from
    ``SpeculatorModelConfig``, which initialises pydantic first; the generated one skips it, so building any of them
    fails: ``AttributeError: 'Eagle3SpeculatorConfig' object has no attribute '__pydantic_fields_set__'``.
    Where fixed: ``SpeculatorModelConfig.__init_subclass__``: after transformers' hook ran, the ``__init__`` it
    generated is removed from the new class, so ``SpeculatorModelConfig.__init__`` is inherited again. The
    dataclass fields transformers recorded stay; speculators' ``__init__`` passes every field on anyway.
    """

    id = "speculator-config-init"
    always = "a run-time condition: transformers' PretrainedConfig generates subclasses' __init__ (transformers 5)"
    target = TARGET
    first_vllm = FIRST_VLLM
    remove_when = "speculators supports transformers 5 (its configs define their own __init__)"

    def apply(self, module: ModuleType) -> None:
        base = module.SpeculatorModelConfig
        if "__init_subclass__" not in vars(module.PretrainedConfig):
            return  # transformers 4: subclasses keep the __init__ they inherit
        original = base.__dict__.get("__init_subclass__")

        def __init_subclass__(cls: type, **kwargs: Any) -> None:
            own_init = "__init__" in cls.__dict__
            if original is not None:
                original.__get__(None, cls)(**kwargs)
            else:
                super(base, cls).__init_subclass__(**kwargs)
            if not own_init and _generated_init(cls):
                type.__delattr__(cls, "__init__")

        self.set_attr(base, "__init_subclass__", classmethod(__init_subclass__))
        for cls in _subclasses(base):  # created before vllm-compat was installed
            if _generated_init(cls):
                type.__delattr__(cls, "__init__")


class SpeculatorConfigSchema(Adapter):
    """Complete the pydantic schema of speculators config classes whose inherited annotations name ``torch``.

    What broke: under transformers 5, ``PretrainedConfig`` annotates ``dtype`` as ``torch.dtype`` in a module that
    imports torch only for type checking. When speculators defines a config class (``Eagle3SpeculatorConfig``...)
    pydantic cannot resolve that name and leaves the class incomplete; building one then fails with
    ``PydanticUserError: Eagle3SpeculatorConfig is not fully defined; you should define torch``.
    (``pydantic-torch-namespace`` covers the same name in speculators' registry reloads at import.)
    Where fixed: ``SpeculatorModelConfig.__pydantic_init_subclass__``: a class pydantic left incomplete is rebuilt
    once with ``torch`` in the types namespace. Complete classes are left alone.
    """

    id = "speculator-config-schema"
    always = "a run-time condition: PretrainedConfig's annotations name torch, which its module does not import"
    target = TARGET
    first_vllm = FIRST_VLLM
    remove_when = "speculators supports transformers 5"

    def apply(self, module: ModuleType) -> None:
        base = module.SpeculatorModelConfig
        if not _torch_unresolvable(module.PretrainedConfig):
            return
        original = inspect.getattr_static(base, "__pydantic_init_subclass__")

        def __pydantic_init_subclass__(cls: type, **kwargs: Any) -> None:
            original.__get__(None, cls)(**kwargs)
            _complete(cls)

        self.set_attr(base, "__pydantic_init_subclass__", classmethod(__pydantic_init_subclass__))
        for cls in _subclasses(base):
            _complete(cls)


def _torch_unresolvable(config_class: type) -> bool:
    """Whether ``config_class`` has annotations that name ``torch.`` while its module has no ``torch``."""
    module = sys.modules.get(config_class.__module__)
    if module is None or "torch" in vars(module):
        return False
    annotations = vars(config_class).get("__annotations__", {})
    return any("torch." in (a if isinstance(a, str) else repr(a)) for a in annotations.values())


def _complete(cls: Any) -> None:
    if getattr(cls, "__pydantic_complete__", True):
        return
    import torch

    if cls.model_rebuild(force=True, raise_errors=False, _types_namespace={"torch": torch}):
        logger.debug("vllm-compat completed the pydantic schema of %s", cls.__qualname__)


class SpeculatorConfigValidate(Adapter):
    """Let ``save_pretrained`` reach transformers' ``validate`` on speculators configs.

    What broke: transformers 5's ``PreTrainedConfig.save_pretrained`` calls ``self.validate()``. speculators' configs
    list pydantic's ``BaseModel`` before ``PretrainedConfig``, so that name resolves to pydantic's deprecated
    ``BaseModel.validate(value)`` classmethod: ``TypeError: BaseModel.validate() missing 1 required positional
    argument: 'value'``. speculators' trainer saves a checkpoint at the end of every epoch through this call.
    Where fixed: ``SpeculatorModelConfig.validate`` dispatches: called on a config with no argument it is
    transformers' ``validate``; called with a value (or on the class) it is pydantic's, as before.
    """

    id = "speculator-config-validate"
    always = "a run-time condition: PretrainedConfig has a validate() that pydantic's BaseModel.validate shadows"
    target = TARGET
    first_vllm = FIRST_VLLM
    remove_when = "speculators supports transformers 5"

    def apply(self, module: ModuleType) -> None:
        base, pretrained = module.SpeculatorModelConfig, module.PretrainedConfig
        own = vars(pretrained).get("validate")
        if not callable(own) or inspect.getattr_static(base, "validate") is own:
            return  # transformers 4 has no validate(), or it already wins
        self.set_attr(base, "validate", _DispatchValidate(inspect.getattr_static(base, "validate"), own))


class _DispatchValidate:
    """``config.validate()`` -> transformers' check; ``Config.validate(value)`` -> pydantic's classmethod."""

    def __init__(self, pydantic_validate: Any, transformers_validate: Any) -> None:
        self.pydantic_validate = pydantic_validate
        self.transformers_validate = transformers_validate

    def __get__(self, instance: Any, owner: type) -> Any:
        classic = self.pydantic_validate.__get__(None, owner)
        if instance is None:
            return classic

        def validate(*args: Any, **kwargs: Any) -> Any:
            if args or kwargs:
                return classic(*args, **kwargs)
            return self.transformers_validate(instance)

        return validate
