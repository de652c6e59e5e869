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


class BlockHashesOnlyForPrefixCaching(Adapter):
    """Build requests without block hashes when prefix caching is off, as vLLM's own engine does.

    What is slow (speculators 0.4.0.1's design, on every vLLM): the generator turns prefix caching off but still
    gives every request a block hasher, so each call hashes every 16-token block of every prompt (SHA-256: 4 ms per
    32 x 1024 tokens on one core, 2 to 3 % of an extraction call on an H200) for a cache that never looks them up.
    vLLM's EngineCore creates a hasher only where prefix caching (or a KV connector) uses the hashes.
    Where fixed: the generator object, after its constructor: ``block_hasher`` becomes None where its
    ``cache_config.enable_prefix_caching`` is off, so speculators builds its requests with ``block_hasher=None``.
    """

    id = "block-hashes-only-for-prefix-caching"
    always = "speculators hashes every prompt block for a prefix cache it turned off (a speculators design cost)"
    speculators = "==0.4.*"
    target = GENERATOR_MODULE
    remove_when = "speculators passes a block hasher only where prefix caching is on"

    def apply(self, module: ModuleType) -> None:
        def init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = wrapped(*args, **kwargs)
            cache = getattr(getattr(instance, "vllm_config", None), "cache_config", None)
            if cache is not None and not cache.enable_prefix_caching and getattr(instance, "block_hasher", None):
                instance.block_hasher = None
            return result

        self.wrap(module, "VllmHiddenStatesGenerator.__init__", init)
