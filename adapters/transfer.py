"""Adapters for how captured states travel from the worker that captured them to the generator's process."""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import WORKER_MODULE

from vllm_compat.adapter import Adapter

logger = logging.getLogger("vllm_compat")


class StatesThroughSharedMemory(Adapter):
    """Hand the captured states to the generator through one shared-memory block instead of the RPC reply.

    What is slow (speculators' design, on every vLLM): ``_get_captured_states`` returns every captured tensor in the
    reply of ``collective_rpc``. vLLM pickles the reply through its worker message queue: a CUDA tensor is copied to
    the host, serialised, sent in chunks, rebuilt on the generator's own GPU and copied back to the host by
    speculators (``.clone().cpu()``). Measured on an H200 (vLLM 0.22, 4 layers x 2048 x bf16, 32768 tokens per call:
    537 MB), that reply took 91 % of the extraction time.
    Where fixed: the worker extension's return value. The worker copies the states once into a shared-memory file
    and returns a small handle; unpickling the handle in the generator's process maps the file, removes its name
    and rebuilds the same structure (a list of per-layer tensors, or 0.4.0.1's dict of per-request lists) as host
    tensors viewing the mapping, which speculators then copies out as it always did. Values are bit-identical; the
    reply's shape is unchanged for speculators. If the generator's process dies before it reads a reply, that
    reply's file stays in /dev/shm (named vllm_compat_states_*).
    """

    id = "states-through-shared-memory"
    always = "speculators returns all captured states through the RPC reply (a speculators design cost)"
    target = WORKER_MODULE
    side = "worker"
    remove_when = "speculators hands states over outside the RPC reply"

    def apply(self, module: ModuleType) -> None:
        def collect(wrapped: Any, ext: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            states = wrapped(*args, **kwargs)
            return SharedStates.pack(states) if states else states

        self.wrap(module, "HiddenStatesWorkerExtension._get_captured_states", collect)


@dataclass(frozen=True)
class _Slot:
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


SHM_DIR = "/dev/shm"  # POSIX shared memory on Linux, where vLLM runs


class SharedStates:
    """A picklable handle to tensors in a shared-memory file; unpickling yields the tensors themselves."""

    def __init__(self, path: str, size: int, spec: Any) -> None:
        self.path = path
        self.size = size
        self.spec = spec  # the original structure with every tensor replaced by a _Slot

    @classmethod
    def pack(cls, states: Any) -> SharedStates:
        import torch

        tensors: list[Any] = []

        def describe(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                tensors.append(obj)
                return _Index(len(tensors) - 1)
            if isinstance(obj, dict):
                return {k: describe(v) for k, v in obj.items()}
            if isinstance(obj, list | tuple):
                return type(obj)(describe(v) for v in obj)
            return obj

        layout = describe(states)
        slots, size = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            slots.append(_Slot(size, nbytes, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
            size += (nbytes + 63) // 64 * 64  # aligned for any dtype
        size = max(size, 64)
        path = os.path.join(SHM_DIR, f"vllm_compat_states_{os.getpid()}_{uuid.uuid4().hex}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        try:
            block = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            for t, slot in zip(tensors, slots, strict=True):
                if slot.nbytes:
                    _view(block, slot).copy_(t.detach().reshape(slot.shape))
            del block
        except BaseException:
            os.unlink(path)
            raise

        def fill(obj: Any) -> Any:
            if isinstance(obj, _Index):
                return slots[obj.i]
            if isinstance(obj, dict):
                return {k: fill(v) for k, v in obj.items()}
            if isinstance(obj, list | tuple):
                return type(obj)(fill(v) for v in obj)
            return obj

        return cls(path, size, fill(layout))

    def __reduce__(self) -> tuple[Any, tuple[str, int, Any]]:
        return (_unpack, (self.path, self.size, self.spec))


@dataclass(frozen=True)
class _Index:
    i: int


def _view(block: Any, slot: _Slot) -> Any:
    import torch

    return block.narrow(0, slot.offset, slot.nbytes).view(getattr(torch, slot.dtype)).view(slot.shape)


def _unpack(path: str, size: int, spec: Any) -> Any:
    """Map the block, remove its name at once (the mapping lives as long as the tensors), return views of it.

    No copy is made here: speculators copies what it keeps (``.clone().cpu()``).
    """
    import torch

    try:
        block = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def build(obj: Any) -> Any:
        if isinstance(obj, _Slot):
            return _view(block, obj)
        if isinstance(obj, dict):
            return {k: build(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(build(v) for v in obj)
        return obj

    return build(spec)
