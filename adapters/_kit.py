"""Shared pieces of the adapters: target module names and call-rewriting wrappers.

Most parent-side adapters rebind a name inside speculators' generator module (``SchedulerConfig``,
``Request``, ``MultiprocExecutor``...) with a wrapt wrapper, so the fix applies to speculators'
own calls only and vLLM's other users in the process see vLLM unchanged.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import wrapt

GENERATOR_MODULE = "speculators.data_generation.vllm_hidden_states_generator"
WORKER_MODULE = "speculators.data_generation.custom_worker"
SPECULATORS_WORKER_EXTENSION = "speculators.data_generation.custom_worker.HiddenStatesWorkerExtension"

KwargsRewrite = Callable[[Callable[..., Any], dict[str, Any]], dict[str, Any]]


def rewrite_kwargs(rewrite: KwargsRewrite) -> Callable[..., Any]:
    """A wrapt wrapper that passes the call's keyword arguments through ``rewrite(wrapped, kwargs)``."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return wrapped(*args, **rewrite(wrapped, dict(kwargs)))

    return wrapper


def after_construct(hook: Callable[[Any], None]) -> Callable[..., Any]:
    """A wrapt wrapper for a class binding that runs ``hook(obj)`` on every object it builds."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        obj = wrapped(*args, **kwargs)
        hook(obj)
        return obj

    return wrapper


def wrap_instance_method(obj: Any, name: str, wrapper: Callable[..., Any]) -> None:
    """Wrap one object's bound method (the object's own attribute; its class is untouched).

    Used for objects speculators creates and owns (its executor, scheduler, extension): the patch lives
    and dies with that object.
    """
    setattr(obj, name, wrapt.FunctionWrapper(getattr(obj, name), wrapper))


@functools.lru_cache(maxsize=64)
def _parameter_names(target: Any) -> frozenset[str] | None:
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None  # accepts anything
    return frozenset(p.name for p in params)


def accepts(target: Any, name: str) -> bool:
    """Whether ``target(...)`` takes a keyword argument ``name``."""
    names = _parameter_names(target)
    return names is None or name in names


def requires(target: Any, name: str) -> bool:
    """Whether ``target(...)`` has a parameter ``name`` without a default."""
    try:
        param = inspect.signature(target).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is inspect.Parameter.empty


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform in this process."""
    try:
        from vllm.platforms import current_platform
    except Exception:  # vLLM not importable: nothing to adapt
        return False
    return bool(current_platform.is_cpu())
