"""Which model families (probes/model.py) a model belongs to, from the ``architectures`` of its config.json.

Read without loading the model: a local folder's ``config.json``, or, for a hub id, transformers' raw config dict
(no remote code runs). The generator's guard uses it to judge the model-side facts of the model being loaded, and
exports the answer to vLLM's workers through ``VLLM_COMPAT_FAMILIES``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

__all__ = ["ENV_FAMILIES", "active_families", "architectures_of", "model_families"]

logger = logging.getLogger("vllm_compat")

ENV_FAMILIES = "VLLM_COMPAT_FAMILIES"  # comma-separated families of the model being loaded; inherited by workers


def architectures_of(model: str | os.PathLike[str]) -> list[str] | None:
    """The ``architectures`` of a model folder or hub id; None when its config cannot be read."""
    config = Path(model) / "config.json"
    try:
        if config.is_file():
            data = json.loads(config.read_text())
        else:
            from transformers import PretrainedConfig

            data, _ = PretrainedConfig.get_config_dict(str(model))
    except Exception as exc:  # no transformers, offline, not a model: fall back to the default families
        logger.debug("vllm-compat could not read the config of %s: %s", model, exc)
        return None
    found = data.get("architectures") or (data.get("text_config") or {}).get("architectures")
    return [str(a) for a in found] if isinstance(found, list) else None


def model_families(model: str | os.PathLike[str] | None) -> tuple[str, ...] | None:
    """The families to judge for ``model``: those serving its architectures, else None (the plan's default)."""
    from vllm_compat.probes.model import families_for

    architectures = architectures_of(model) if model is not None else None
    if not architectures:
        return None
    families = families_for(architectures)
    if not families:
        logger.info("vllm-compat: %s is no model family it probes; judging it as the default", architectures)
        return None
    return families


def active_families() -> frozenset[str] | None:
    """The families of the model being loaded, as the parent exported them; None if it did not."""
    value = os.environ.get(ENV_FAMILIES, "").strip()
    return frozenset(f for f in value.split(",") if f) if value else None
