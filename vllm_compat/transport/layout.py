"""What both sides of the hand-over agree on: where a tensor lies in a slab, and the environment that connects them.

Imported by the worker (vllm_compat.capture lays a call out in slots) and by the generator's process (which views
the same slots over its own mapping). Nothing here imports torch until it is used.
"""

from __future__ import annotations

import fcntl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ENV_SOCKET = "VLLM_COMPAT_STATES_SOCKET"  # the generator's receiving socket; set while its constructor starts workers
ENV_MODE = "VLLM_COMPAT_STATES"  # "map" (default): returned states map the slab privately; "copy": ordinary memory
ENV_PINNED_LIMIT = "VLLM_COMPAT_PINNED_LIMIT_GIB"  # at most this much slab memory is registered with CUDA per worker

SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW  # a slab's size is fixed: the worker seals it, the caller checks
_ALIGN = 64  # every tensor starts on a 64-byte boundary: aligned for any dtype and for vectorised copies


class TransportError(RuntimeError):
    """The states the worker handed over cannot be received or are not what the worker said they are."""


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in a slab."""

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def aligned(nbytes: int) -> int:
    """The room a tensor of ``nbytes`` takes in a slab (the next one starts aligned)."""
    return -(-nbytes // _ALIGN) * _ALIGN


def slot_view(block: Any, slot: Slot) -> Any:
    """The tensor ``slot`` describes, over ``block`` (a slab's bytes as a uint8 tensor)."""
    import torch

    return block.narrow(0, slot.offset, slot.nbytes).view(getattr(torch, slot.dtype)).view(slot.shape)


def map_slots(obj: Any, kind: type, replace: Callable[[Any], Any]) -> Any:
    """``obj`` with every ``kind`` inside it (through dicts, lists and tuples) replaced by ``replace(it)``.

    A module-level function, not a recursive closure: a closure that calls itself is a reference cycle, and one
    holding the call's tensors would keep them until the garbage collector runs instead of until they are dropped.
    """
    if isinstance(obj, kind):
        return replace(obj)
    if isinstance(obj, dict):
        return {k: map_slots(v, kind, replace) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(map_slots(v, kind, replace) for v in obj)
    return obj
