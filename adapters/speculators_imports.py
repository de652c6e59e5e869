"""Adapters that let ``import speculators`` succeed next to the transformers that new vLLM releases require.

vLLM 0.24 and later require transformers >= 5.5.3, while speculators 0.3.0 and 0.4.0.1 were written against
transformers 4. Importing ``speculators.data_generation`` runs ``speculators/__init__.py`` first, so these
failures stop extraction before any vLLM code runs.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from types import ModuleType
from typing import Any

from vllm_compat.adapter import Adapter
from vllm_compat.errors import AdapterError

logger = logging.getLogger("vllm_compat")
ATTN_MASK_UTILS = "transformers.modeling_attn_mask_utils"


def _transformers_major() -> int | None:
    from vllm_compat.versions import installed_version

    version = installed_version("transformers")
    return version.major if version is not None else None


def _missing_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


class AttentionMaskUtilsShim(Adapter):
    """``transformers.modeling_attn_mask_utils`` for speculators' import under transformers 5.

    What broke: transformers 5 removed ``modeling_attn_mask_utils``; ``speculators/models/eagle.py`` (the EAGLE-1
    model, imported by ``import speculators``) imports ``_prepare_4d_causal_attention_mask`` from it at module level,
    so ``import speculators`` fails with ModuleNotFoundError on any vLLM that pins transformers 5 (0.24 and later).
    Where fixed: a stand-in module, registered when ``speculators.utils.pydantic_utils`` (loaded early in
    speculators' import) is imported and withdrawn as soon as ``speculators.models.eagle`` has imported it, so other
    libraries do not see it. The stand-in function raises a clear error if the EAGLE-1 model ever calls it; EAGLE-3
    extraction and training do not.
    """

    id = "transformers-attn-mask-utils"
    always = "a run-time condition: the installed transformers has no modeling_attn_mask_utils (transformers 5)"
    target = "speculators.utils.pydantic_utils"
    first_vllm = "0.24.0 (requires transformers >= 5.5.3)"
    remove_when = "speculators no longer imports transformers.modeling_attn_mask_utils"

    def apply(self, module: ModuleType) -> None:
        if "speculators.models.eagle" in sys.modules or not _missing_module(ATTN_MASK_UTILS):
            return
        stand_in = ModuleType(ATTN_MASK_UTILS, "vllm-compat stand-in: removed in transformers 5")
        stand_in._prepare_4d_causal_attention_mask = _prepare_4d_causal_attention_mask  # type: ignore[attr-defined]
        self.set_module(ATTN_MASK_UTILS, stand_in)
        from vllm_compat import hooks

        hooks.register("speculators.models.eagle", self._withdraw, once=True)

    def _withdraw(self, module: ModuleType) -> None:
        """Once its one user imported the function, take the stand-in away so no other library sees it."""
        keep = []
        for patch in self._patches:
            if "modeling_attn_mask_utils" in patch.label:
                patch.revert()
            else:
                keep.append(patch)
        self._patches[:] = keep


def _prepare_4d_causal_attention_mask(*args: Any, **kwargs: Any) -> Any:
    raise AdapterError(
        "speculators' EAGLE-1 model needs transformers.modeling_attn_mask_utils, which transformers 5 removed. "
        "vllm-compat supports EAGLE-3 extraction and training here; for EAGLE-1 use transformers < 5."
    )


class PydanticTorchNamespace(Adapter):
    """Resolve ``torch`` annotations when speculators rebuilds its pydantic config models.

    What broke: under transformers 5, ``PretrainedConfig`` (which speculators' configs extend) carries annotations
    such as ``"torch.dtype"`` whose module imports torch only for type checking; ``import speculators`` calls
    ``reload_and_populate_configs()`` -> ``model_rebuild(force=True)``, and pydantic fails with
    ``PydanticUndefinedAnnotation: name 'torch' is not defined``.
    Where fixed: speculators' ``ReloadableBaseModel.reload_schema``: if the plain rebuild fails on an undefined
    ``torch``, it is rebuilt once more with ``torch`` in the types namespace. Nothing changes when it succeeds.
    """

    id = "pydantic-torch-namespace"
    always = "a run-time condition: transformers 5 annotations that name torch (checked on each rebuild)"
    target = "speculators.utils.pydantic_utils"
    first_vllm = "0.24.0 (requires transformers >= 5.5.3)"
    remove_when = "speculators supports transformers 5"

    def apply(self, module: ModuleType) -> None:
        major = _transformers_major()
        if major is None or major < 5:
            return

        def reload_schema(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            from pydantic.errors import PydanticUndefinedAnnotation

            try:
                return wrapped(*args, **kwargs)
            except PydanticUndefinedAnnotation as exc:
                if exc.name != "torch":
                    raise
                import torch

                owner = instance if isinstance(instance, type) else type(instance)
                return owner.model_rebuild(force=True, _types_namespace={"torch": torch})

        self.wrap(module, "ReloadableBaseModel.reload_schema", reload_schema)
