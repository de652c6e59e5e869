"""Adapters for the Request objects speculators builds for each prompt."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import GENERATOR_MODULE, accepts, rewrite_kwargs

from vllm_compat.adapter import Adapter


class RequestEosToken(Adapter):
    """``Request(eos_token_id=...)`` was removed.

    What broke: vLLM 0.17.0 moved the EOS token to ``SamplingParams`` and dropped the Request parameter
    (TypeError for both speculators lines). The generator samples one token (max_tokens=1) and never decodes,
    so EOS has no effect on extraction; where SamplingParams can carry it, it is kept there.
    Where fixed: speculators' Request call.
    """

    id = "request-eos-token-id"
    covers = {"request.request_kwargs": {"rejects=eos_token_id"}}
    target = GENERATOR_MODULE
    first_vllm = "0.17.0"

    def apply(self, module: ModuleType) -> None:
        def fix(cls: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            if accepts(cls, "eos_token_id"):
                return kwargs
            eos = kwargs.pop("eos_token_id", None)
            params = kwargs.get("sampling_params")
            update = getattr(params, "update_from_generation_config", None)
            if eos is not None and update is not None:
                update({}, eos)
            return kwargs

        self.wrap(module, "Request", rewrite_kwargs(fix))


class HashingModuleAlias(Adapter):
    """``vllm.utils.hashing`` for vLLM 0.11.0.

    What broke: speculators 0.4.0.1 imports ``get_hash_fn_by_name`` from ``vllm.utils.hashing``, a module that
    vLLM 0.11.1 split out of ``vllm.utils``; on 0.11.0 the import fails.
    Where fixed: vLLM's surface, on import of ``vllm.utils``: a module ``vllm.utils.hashing`` exposing the same
    function is registered, so speculators' import resolves.
    """

    id = "hashing-module-alias"
    covers = {"import.utils.hashing.get_hash_fn_by_name": {"module_moved"}}
    speculators = "==0.4.*"
    target = "vllm.utils"
    first_vllm = "0.11.0 (the module appeared in 0.11.1)"

    def apply(self, module: ModuleType) -> None:
        alias = ModuleType("vllm.utils.hashing", "vllm-compat alias: vllm.utils.get_hash_fn_by_name (vLLM 0.11.0)")
        alias.get_hash_fn_by_name = module.get_hash_fn_by_name  # type: ignore[attr-defined]
        self.set_module("vllm.utils.hashing", alias)
