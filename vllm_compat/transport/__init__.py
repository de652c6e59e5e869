"""Hand a call's captured states from a vLLM worker to the generator's process at the speed of the bus.

Why: speculators returns every captured state in the reply of ``collective_rpc``, which vLLM pickles through its
message queue (GPU -> host -> serialised -> chunks -> rebuilt), then copies once more (``.clone().cpu()``). On an
H200 that reply was most of the extraction time.

How, and what the caller can rely on:

- The worker keeps a few *slabs*: anonymous shared memory (``memfd_create``: no name in any file system, so no
  cleaner can remove it and nothing is left behind when a process dies), each mapped once with every page in place
  (by a few threads, with the GIL released: a spare made while a call runs does not hold the call up), registered
  with CUDA as pinned memory once (in pieces: the driver holds the worker's launches up while it registers), and
  sealed: its size can never change and no process can open it for writing
  (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE``); only the mapping the worker made before sealing writes.
- While a call's steps run, each step's captured rows are copied to their place in the call's slab
  (vllm_compat.capture lays a call out): on a GPU by DMA on a side stream, overlapped with the steps that follow.
- At the end of the call the worker passes the slab's descriptor to the generator's process over a Unix socket
  (``SCM_RIGHTS``) and replies with a small :class:`StatesHandle` instead of the states.
- Unpickling the handle in the generator's process opens the slab on a descriptor of its own, takes a shared lock on
  it and maps it *privately* (copy-on-write). speculators sees ``HandedOverStates`` over that mapping; its
  ``.clone()`` of one is a plain tensor whose storage is exactly that state's bytes of the mapping: no copy made
  (``VLLM_COMPAT_STATES=copy``: a real copy into ordinary memory instead, made with a few threads).
- The worker writes a slab again only once no process holds a lock on it: the caller's lock goes when the last tensor
  over the slab goes (the kernel drops the locks of a process that dies; a forked child keeps the lock it inherited,
  as it keeps its snapshot of the tensors).

So each tensor ``generate()`` returns owns exactly its bytes: ``torch.save`` or pickling one writes that tensor alone;
a write to it is private to it and to the process that makes it (``fork()`` gives the child a copy-on-write
snapshot); no other process and no later call can change it, and its memory goes when the last process mapping it
drops it. The slabs are not in /dev/shm: filling them never takes the room vLLM's own message queues need there.

The package follows the data's way, one module for each process that runs it:

- ``slabs``: the worker's side (making, populating, pinning and sealing slabs; spares and the maker thread).
- ``wire``: the socket between the two (``SCM_RIGHTS``, ``SO_PEERCRED``, the keyed hello), both of its ends.
- ``caller``: the generator's side (leases, private mappings, copies made ahead, ``HandedOverStates``, the fork hook).
- ``layout``: what both agree on (slots in a slab, the environment's names).

Nothing here imports torch until it is used.
"""

from __future__ import annotations

from typing import Any

from vllm_compat.transport.caller import discarding, handed_over_type, open_states
from vllm_compat.transport.layout import (
    ENV_MODE,
    ENV_PINNED_LIMIT,
    ENV_SOCKET,
    Slot,
    TransportError,
    aligned,
    map_slots,
    slot_view,
)
from vllm_compat.transport.slabs import AHEAD, MOST_SPARES, Slab, Slabs, piece_ranges, record_stats, worker_stats
from vllm_compat.transport.wire import StatesHandle, forget_workers, receiver_address, send_slab, when_released

__all__ = [
    "AHEAD",
    "ENV_MODE",
    "ENV_PINNED_LIMIT",
    "ENV_SOCKET",
    "MOST_SPARES",
    "Slab",
    "Slabs",
    "Slot",
    "StatesHandle",
    "TransportError",
    "aligned",
    "discarding",
    "forget_workers",
    "handed_over_type",
    "map_slots",
    "open_states",
    "piece_ranges",
    "receiver_address",
    "record_stats",
    "send_slab",
    "slot_view",
    "when_released",
    "worker_stats",
]


def __getattr__(name: str) -> Any:
    if name == "HandedOverStates":  # states pickled under the name this module gave them before it was a package
        return handed_over_type()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
