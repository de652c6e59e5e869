"""Adapters for the parallel layout the generator is asked for."""

from __future__ import annotations

import inspect
import logging
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import GENERATOR_MODULE, on_cpu

from vllm_compat.adapter import Adapter

logger = logging.getLogger("vllm_compat")


class TensorParallelZeroOnCpu(Adapter):
    """Read ``tensor_parallel_size=0`` as 1 on vLLM's CPU platform.

    What broke (speculators' scripts, on every vLLM): data_generation_offline.py's ``--tensor-parallel-size`` defaults
    to ``torch.accelerator.device_count()``, which is 0 on a host without an accelerator; the generator passes it to
    ``ParallelConfig``, which refuses it (pydantic: ``Input should be greater than or equal to 1``), and it also sizes
    the KV-cache configs it hands the workers (``[config] * tensor_parallel_size``). On vLLM's CPU platform one worker
    is what the script means.
    Where fixed: the generator's constructor, on the CPU platform only: 0 becomes 1, with one INFO line. Any other
    value, and any value on another platform, is passed on unchanged (a GPU host that sees no device should fail).
    """

    id = "cpu-tensor-parallel-zero"
    always = "speculators' scripts default --tensor-parallel-size to the accelerator count, 0 on vLLM's CPU platform"
    target = GENERATOR_MODULE
    remove_when = "speculators' scripts default to at least one worker (or >= 0.5)"
    PARAMETER = "tensor_parallel_size"

    def apply(self, module: ModuleType) -> None:
        cls = module.VllmHiddenStatesGenerator
        names = list(inspect.signature(cls.__init__).parameters)[1:]  # after self
        position = names.index(self.PARAMETER) if self.PARAMETER in names else None

        def init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if self.PARAMETER in kwargs:
                if _zero(kwargs[self.PARAMETER]) and on_cpu():
                    kwargs = {**kwargs, self.PARAMETER: 1}
                    _tell()
            elif position is not None and len(args) > position and _zero(args[position]) and on_cpu():
                args = (*args[:position], 1, *args[position + 1 :])
                _tell()
            return wrapped(*args, **kwargs)

        self.wrap(module, "VllmHiddenStatesGenerator.__init__", init)


def _tell() -> None:
    logger.info(
        "vllm-compat: tensor_parallel_size=0 (speculators' scripts default it to the accelerator count, 0 here) "
        "means one worker on vLLM's CPU platform: using 1"
    )


def _zero(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value == 0
