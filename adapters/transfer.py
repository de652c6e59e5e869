"""Adapters for how captured states travel from the worker that captured them to the generator's process."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import GENERATOR_MODULE, WORKER_MODULE

from vllm_compat import capture, transport
from vllm_compat.adapter import Adapter


class StatesThroughSharedMemory(Adapter):
    """Hand each call's captured states to the generator in shared memory that the returned tensors then own.

    What is slow (speculators' design, on every vLLM): ``_get_captured_states`` returns every captured tensor in the
    reply of ``collective_rpc``. vLLM pickles the reply through its worker message queue: a CUDA tensor is copied to
    the host, serialised, sent in chunks, rebuilt on the generator's own GPU and copied once more by speculators
    (``.clone().cpu()``). Measured on an H200 (vLLM 0.22, 4 layers x 2048 x bf16, 32768 tokens per call: 537 MB),
    that reply took 91 % of the extraction time.
    Where fixed: where a call's captured rows go (per-request-capture lays the call out). Here they go into a slab of
    sealed anonymous shared memory, pinned for DMA, while the steps run; at the end the slab's descriptor is passed
    to the generator's process over a Unix socket and the reply is a small handle. Unpickling it there yields the
    reply's usual structure over a private mapping of the slab, and speculators' ``.clone()`` of each state maps that
    state's own bytes privately (no copy): every tensor ``generate()`` returns is an ordinary tensor owning exactly
    its bytes (vllm_compat.transport says how). Where the worker cannot reach the generator's process, that call's
    states go through the RPC reply as before, with a warning.
    """

    id = "states-through-shared-memory"
    always = "speculators returns all captured states through the RPC reply (a speculators design cost)"
    target = WORKER_MODULE
    side = "worker"
    remove_when = "speculators hands states over outside the RPC reply"

    def apply(self, module: ModuleType) -> None:
        self.set_attr(capture, "HAND_OVER", hand_over_slab)


def hand_over_slab(call: capture.CallCapture) -> Any:
    """The call's slab passed to the generator's process: the handle for the reply (or, where there is no channel,
    the states themselves, copied out of the slab, which then goes back to the pool)."""
    spec, pieces = call.finish()
    slab, layout = call.slab, call.layout
    assert slab is not None and layout is not None
    handle = transport.send_slab(slab, layout.size, spec, pieces)
    if handle is not None:
        return handle
    states = transport.map_slots(spec, transport.Slot, lambda s: transport.slot_view(slab.block, s).clone())
    call.release()
    return states


class ReturnedStatesKeepTheirShape(Adapter):
    """Leave a returned state readable when ``resize_`` or ``resize_as_`` to a larger size fails on it.

    What broke (torch, every version, for any tensor over memory torch did not allocate: ``torch.from_numpy``,
    ``torch.load(mmap=True)``, shared-memory tensors): ``resize_`` sets the new shape before it finds that the
    storage cannot grow, and raises with the new shape left in place; the next read runs past the memory (SIGSEGV).
    ``resize_as_`` (the method and ``torch.resize_as_``) resizes the same way. The states speculators returns under
    vllm-compat map their slab privately, so their storage cannot grow.
    Where fixed: ``torch.Tensor.resize_``, ``torch.Tensor.resize_as_`` and ``torch.resize_as_``, in the generator's
    process: when the call raises, the tensor's shape, strides and offset are put back as they were, and the error
    says what to do (``clone()`` first, or ``VLLM_COMPAT_STATES=copy`` for states in ordinary, growable memory). A
    call that succeeds is passed through. Not covered: an op's ``out=`` (torch resizes it inside the op's kernel,
    where no Python wrapper sees it; docs/limits.md).
    """

    id = "returned-states-keep-their-shape"
    always = "returned states map memory torch did not allocate; torch leaves a failed resize_'s shape on a tensor"
    target = GENERATOR_MODULE

    def apply(self, module: ModuleType | None) -> None:
        import torch

        self.wrap(torch.Tensor, "resize_", _keep_shape)
        self.wrap(torch.Tensor, "resize_as_", _keep_shape)
        self.wrap(torch, "resize_as_", _keep_shape)


def _keep_shape(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run a resizing call; where it raises with a new shape left on the tensor it resizes (the method's tensor, or
    ``torch.resize_as_``'s first argument), put the shape, strides and offset back as they were."""
    import torch

    tensor = instance if instance is not None else (args[0] if args else None)
    if not isinstance(tensor, torch.Tensor):
        return wrapped(*args, **kwargs)
    shape, stride, offset = tensor.shape, tensor.stride(), tensor.storage_offset()
    try:
        return wrapped(*args, **kwargs)
    except RuntimeError as exc:
        if tensor.shape != shape:
            with torch.no_grad():
                tensor.set_(tensor.untyped_storage(), offset, shape, stride)
            if hasattr(exc, "add_note"):
                exc.add_note(
                    "vllm-compat: the tensor keeps its shape. Its memory cannot grow (it maps the states "
                    "vLLM handed over); resize a clone() of it, or set VLLM_COMPAT_STATES=copy."
                )
        raise
