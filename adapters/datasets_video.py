"""An adapter for the datasets release speculators 0.4.0.1 pins, next to the torchvision a vLLM install brings."""

from __future__ import annotations

import ast
import importlib.util
import logging
from pathlib import Path
from types import ModuleType
from typing import Any

from vllm_compat.adapter import Adapter
from vllm_compat.errors import AdapterError

logger = logging.getLogger("vllm_compat")

# datasets' formatters that check "is this value a torchvision VideoReader?" (datasets/formatting/*.py)
FORMATTERS = ("torch_formatter.py", "np_formatter.py", "tf_formatter.py", "jax_formatter.py")
_CAUGHT = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


class VideoReaderName(Adapter):
    """``torchvision.io.VideoReader`` for datasets releases that import it unguarded.

    What broke: datasets 4.6.0 and earlier (speculators 0.4.0.1 pins ``datasets<=4.6.0``) run
    ``from torchvision.io import VideoReader`` in their formatters (``TorchFormatter._tensorize`` and the numpy, tf
    and jax ones) whenever torchvision is imported, to recognise video values. torchvision 0.26 removed
    ``VideoReader``, and ``pip install vllm`` brings torchvision at vLLM's pin (0.26.0 for vLLM 0.20 to 0.26, 0.28.0
    for 0.27 to 0.32, 0.29.0 for 0.33), so speculators' data-generation script stops at "Counting token frequencies"
    (``with_format("torch")``): ``ImportError: cannot import name 'VideoReader' from 'torchvision.io'``.
    datasets 4.8.4 and later guard that import (``except ImportError``).
    Where fixed: ``torchvision.io``, on its import, where it has no ``VideoReader`` and the installed datasets imports
    it unguarded (read from datasets' source, not its version): the name is added as a placeholder class. datasets'
    ``isinstance(value, VideoReader)`` is then False, as it is under datasets 4.8.4 where the import fails; making
    one raises an error that says why, so nothing can use it by mistake.
    """

    id = "datasets-videoreader-name"
    always = (
        "a run-time condition: the installed datasets imports torchvision.io.VideoReader unguarded (<= 4.6.0) and the "
        "installed torchvision has none (>= 0.26)"
    )
    target = "torchvision.io"
    first_vllm = "0.20.0 (pins torchvision 0.26.0)"
    remove_when = "speculators allows a datasets release that guards the import (4.8.4 or later)"

    def apply(self, module: ModuleType) -> None:
        if "VideoReader" in module.__dict__:
            return  # torchvision < 0.26, or someone else supplied it
        unguarded = unguarded_videoreader_imports()
        if not unguarded:
            return  # datasets absent, or a release that guards the import: nothing needs the name
        logger.debug("vllm-compat: %s: datasets imports torchvision.io.VideoReader unguarded in %s", self.id,
                     ", ".join(unguarded))  # fmt: skip
        self.set_attr(module, "VideoReader", VideoReader)


class VideoReader:
    """vllm-compat's placeholder for ``torchvision.io.VideoReader``, which torchvision 0.26 removed.

    It exists so that datasets <= 4.6.0 can import the name for its ``isinstance`` checks (never true for it); it
    cannot be made.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise AdapterError(
            "torchvision.io.VideoReader was removed in torchvision 0.26; this is vllm-compat's placeholder "
            "(datasets-videoreader-name), present only so that datasets <= 4.6.0 can import the name. Decode "
            "video with torchcodec, or install a torchvision that has VideoReader."
        )


def unguarded_videoreader_imports() -> list[str]:
    """datasets' formatter files (names) that import ``torchvision.io.VideoReader`` outside a try that catches its
    ImportError; [] where datasets is not installed. Read from the files, nothing is imported."""
    try:
        spec = importlib.util.find_spec("datasets")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    found = []
    for folder in spec.submodule_search_locations:
        for name in FORMATTERS:
            path = Path(folder) / "formatting" / name
            try:
                source = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if "VideoReader" in source and imports_unguarded(source):
                found.append(name)
    return found


def imports_unguarded(source: str) -> bool:
    """Whether ``source`` has ``from torchvision.io import VideoReader`` outside the body of a try that catches
    ImportError (or a broader exception)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    return _walk(tree, guarded=False)


def _walk(node: ast.AST, guarded: bool) -> bool:
    if (
        isinstance(node, ast.ImportFrom)
        and node.module == "torchvision.io"
        and any(alias.name == "VideoReader" for alias in node.names)
        and not guarded
    ):
        return True
    if isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
        catches = any(_catches_import_error(handler) for handler in node.handlers)  # type: ignore[attr-defined]
        body = any(_walk(child, guarded or catches) for child in node.body)  # type: ignore[attr-defined]
        rest = [*node.handlers, *node.orelse, *node.finalbody]  # type: ignore[attr-defined]
        return body or any(_walk(child, guarded) for child in rest)
    return any(_walk(child, guarded) for child in ast.iter_child_nodes(node))


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(k, ast.Name) and k.id in _CAUGHT for k in kinds)
