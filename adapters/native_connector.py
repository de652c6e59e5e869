"""The native line's adapter: vLLM's ExampleHiddenStatesConnector on vLLM's CPU platform.

speculators 0.5 to 0.9 extract through `vllm serve` and a hidden-states KV connector; vllm-compat reaches those
processes through ``vllm-compat run -- python scripts/launch_vllm.py ...`` (or ``VLLM_COMPAT_AUTO=1``): every
Python process of the server (the API server, the engine core where the connector is made) installs it at start-up.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import logging
import os
import textwrap
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import on_cpu
from vllm_compat.probes._native import CONNECTOR_MODULE
from vllm_compat.probes.native_connector import PINNING_FACTORIES, cuda_only_uses

from vllm_compat.adapter import Adapter
from vllm_compat.errors import AdapterError

logger = logging.getLogger("vllm_compat")
CONNECTOR = "ExampleHiddenStatesConnector"


class _CopyDone:
    """Stands in for ``torch.cuda.Event`` where the copy it marks was synchronous: complete once it is made."""

    def record(self, stream: Any = None) -> None:
        """Nothing to mark: the copy before it has finished."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for."""


class _NoStream:
    """Stands in for ``torch.cuda.Stream``: the host's work runs in program order, so waiting is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        """The events are complete when made."""

    def wait_stream(self, stream: Any) -> None:
        """There is no other stream to wait for."""

    def synchronize(self) -> None:
        """Nothing is in flight."""

    def query(self) -> bool:
        return True


class _HostCuda:
    """``torch.cuda`` as the connector's copy path sees it on vLLM's CPU platform: a stream that orders nothing, an
    event that is complete when made, ``torch.cuda.stream(s)`` a no-op context; anything else is torch.cuda's."""

    Stream = _NoStream
    Event = _CopyDone

    def __init__(self, real: Any) -> None:
        self._real = real

    @staticmethod
    def stream(stream: Any = None) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class HostTorch:
    """``torch`` as the connector module sees it on vLLM's CPU platform: ``cuda`` is :class:`_HostCuda`, and the
    factories the copy path pins memory with ignore ``pin_memory`` (there is no pinned memory without an
    accelerator); everything else is torch itself."""

    def __init__(self, real: ModuleType) -> None:
        self._real = real
        self.cuda = _HostCuda(real.cuda)
        for dotted in PINNING_FACTORIES:
            name = dotted.rpartition(".")[2]
            setattr(self, name, _unpinned(getattr(real, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __repr__(self) -> str:
        return f"<vllm-compat host view of {self._real!r}>"


def _unpinned(factory: Any) -> Any:
    def made(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    made.__name__ = getattr(factory, "__name__", "factory")
    return made


class NativeConnectorOnCpu(Adapter):
    """Make ExampleHiddenStatesConnector's copy of the states synchronous and CUDA-free on vLLM's CPU platform.

    What broke: from vLLM 0.22.0, ``ExampleHiddenStatesConnector`` (the ``file`` backend of speculators 0.5 to 0.9)
    copies each request's states off its cache on a ``torch.cuda.Stream`` into ``pin_memory=True`` memory, marks the
    copy with a ``torch.cuda.Event`` that its writer thread waits for and ``get_finished`` polls (``save_kv_layer``
    in 0.22 and 0.23, ``_submit_async_write`` from 0.24). vLLM's CPU platform has none of those, so the first
    request kills the engine: ``CUDA driver version is insufficient`` (0.22.0), ``'_StreamPlaceholder' object has
    no attribute 'wait_event'`` (0.26.0), ``pin_memory=True requires a CUDA or other accelerator backend``
    (0.32.0). On a GPU the path is right and fast, and is left alone.
    Where fixed: the connector module's own ``torch`` name, rebound on vLLM's CPU platform only to a view of torch
    whose ``cuda.Stream`` orders nothing, ``cuda.Event`` is complete when made, ``cuda.stream()`` is a no-op
    context and whose factories ignore ``pin_memory``: the copy becomes a plain synchronous host copy, made before
    the event that marks it, so the writer thread and ``get_finished`` see it done. Nothing outside that module
    (subclasses such as hs-connectors' fp8 connector included, whose methods the base's code calls) sees a change.
    Fails closed: a connector whose copy path has CUDA-only calls this adapter does not know raises AdapterError
    when the module is imported on vLLM's CPU platform, before the server starts.
    """

    id = "native-connector-on-cpu"
    covers = {"native.connector.device_copy": {"cuda_copy_stream"}}
    speculators = ">=0.5,<0.10"
    target = CONNECTOR_MODULE
    side = "worker"
    always = "a run-time condition: vLLM runs on its CPU platform (on a GPU the connector is left as it is)"
    first_vllm = "0.22.0"
    remove_when = "ExampleHiddenStatesConnector copies the states without CUDA-only calls on vLLM's CPU platform"

    def apply(self, module: ModuleType) -> None:
        if not on_cpu():
            return
        real = module.__dict__.get("torch")
        if isinstance(real, HostTorch):
            return  # this module is patched already (by an adapter instance not reverted)
        cls = getattr(module, CONNECTOR, None)
        if cls is None or not isinstance(real, ModuleType) or real.__name__ != "torch":
            raise AdapterError(
                f"{CONNECTOR_MODULE} has no {CONNECTOR} or does not bind torch as `torch`: its copy path is not one "
                "this adapter knows; on vLLM's CPU platform pin a vLLM release vllm-compat passes"
            )
        known, other = copy_path(cls)
        if other:
            raise AdapterError(
                f"{CONNECTOR}'s copy off its cache uses CUDA-only calls this adapter does not know "
                f"({', '.join(sorted({text for text, _ in other}))}): it would fail on vLLM's CPU platform; pin a vLLM "
                "release vllm-compat passes"
            )
        if not known:
            return  # a copy with nothing CUDA-only (vLLM 0.17 to 0.21): nothing to patch
        self.set_attr(module, "torch", HostTorch(real))
        logger.info(
            "vllm-compat: %s copies the states synchronously on vLLM's CPU platform (%s; pid %d)",
            CONNECTOR, self.id, os.getpid(),
        )  # fmt: skip


def copy_path(cls: type) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """The connector class's CUDA-only calls: those the adapter replaces, and any others (probes/native_connector.py
    reads the same from a wheel). Unreadable source counts as unknown."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError) as exc:
        return [], [(f"unreadable source ({type(exc).__name__})", 0)]
    return cuda_only_uses(tree)
