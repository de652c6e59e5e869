"""Adapters for the run metadata speculators' data-generation script writes next to the samples."""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from vllm_compat.adapter import Adapter

logger = logging.getLogger("vllm_compat")
CONFIG_MODULE = "speculators.data_generation.config_generator"
NO_ACCELERATOR = "NO ACCELERATOR"  # what speculators' own get_device_name() returns under a CPU build of torch


class AcceleratorNameWithoutDriver(Adapter):
    """Let speculators 0.4.0.1 record "CPU ONLY" where torch was built for an accelerator the host does not have.

    What broke (speculators 0.4.0.1 with any vLLM, on a host without the accelerator torch was built for): the
    data-generation script ends with ``DataGenerationConfig.from_generator``, whose ``gpu`` field asks
    ``speculators.utils.util.get_device_name(0)``. That helper trusts ``torch.accelerator.current_accelerator()``,
    the accelerator torch was *built* for, not one that is there: a CUDA build of torch on a host without an NVIDIA
    driver (PyPI's plain ``torch`` wheel beside vLLM's CPU build, as pip installs it) gets ``cuda`` and
    ``torch.cuda.get_device_name(0)`` raises "Found no NVIDIA driver". Every sample is saved by then, but the script
    exits 1 and writes no ``data_config.json``. speculators 0.3.0 checks ``torch.cuda.is_available()`` first.
    Where fixed: the ``get_device_name`` name in speculators' config_generator module: where torch has no usable
    accelerator, it returns "NO ACCELERATOR", as speculators' helper does under a CPU build of torch (the metadata
    then says "CPU ONLY"); with an accelerator present, speculators' own helper answers. Metadata only: no state is
    touched.
    """

    id = "accelerator-name-without-driver"
    always = "a speculators 0.4.0.1 defect: without the accelerator torch was built for, the script fails at its end"
    speculators = "==0.4.*"
    target = CONFIG_MODULE
    first_vllm = "any (a host without the accelerator torch was built for)"

    def apply(self, module: ModuleType) -> None:
        if not callable(getattr(module, "get_device_name", None)):
            return  # another layout of the module: nothing of this defect to fix

        def get_device_name(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not _accelerator_usable():
                logger.debug("vllm-compat: %s: torch has no usable accelerator; recording %s", self.id, NO_ACCELERATOR)
                return NO_ACCELERATOR
            return wrapped(*args, **kwargs)

        self.wrap(module, "get_device_name", get_device_name)


def _accelerator_usable() -> bool:
    """Whether torch has an accelerator it can use here (not only one it was built for)."""
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None:
        return torch.cuda.is_available()
    try:
        return accelerator.current_accelerator(check_available=True) is not None
    except TypeError:  # a torch whose current_accelerator() takes no check_available
        built = accelerator.current_accelerator()
        return built is not None and torch.get_device_module(built).is_available()
