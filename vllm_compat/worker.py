"""Fallback worker extension: used when vLLM's plugin loader does not run vllm-compat in the workers.

vLLM imports this module in each worker to resolve ``worker_extension_cls``; importing it installs
vllm-compat there first, so the worker-side adapters patch speculators' extension on its import.
"""

from __future__ import annotations

import vllm_compat
from vllm_compat import plugin

plugin.activated_in_worker(plugin.FALLBACK_ROUTE)  # the plugin did not run here (why the generator named us)
vllm_compat.install()

from speculators.data_generation.custom_worker import (  # noqa: E402  (must follow install())
    HiddenStatesWorkerExtension as _SpeculatorsExtension,
)

__all__ = ["HiddenStatesWorkerExtension"]


class HiddenStatesWorkerExtension(_SpeculatorsExtension):
    """speculators' worker extension, unchanged, imported after vllm-compat's hooks are in place."""
