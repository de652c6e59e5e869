"""A forgotten runner: speculators' script run bare (no ``vllm-compat run``, no ``VLLM_COMPAT_AUTO=1``) next to
transformers 5 stops in ``speculators/__init__.py``; the wheel's start-up ``.pth`` then adds one line to the
traceback saying how to run it with vllm-compat, and does nothing else in the process.

Each test starts a real interpreter that processes the ``.pth`` as start-up does (``site.addsitedir``) and imports a
fake ``speculators`` package from a temporary folder (no real speculators needed).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.unit.test_run import PTH, clean_env

HINT = "vllm-compat: this failure of speculators' import"

# what speculators/__init__.py raises next to transformers 5, per covered failure (adapters/speculators_imports.py)
PYDANTIC_TORCH = """
from pydantic.errors import PydanticUndefinedAnnotation

def reload_and_populate_configs():
    raise PydanticUndefinedAnnotation("torch", "name 'torch' is not defined")

reload_and_populate_configs()
"""
ATTN_MASK_UTILS = "from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask\n"
ATTN_MASK_UTILS_RAISED = (
    "raise ModuleNotFoundError(\"No module named 'transformers.modeling_attn_mask_utils'\", "
    "name='transformers.modeling_attn_mask_utils')\n"
)

RUN = """
import site, sys
before = set(sys.modules)
hook_before = sys.excepthook
site.addsitedir(sys.argv[1])  # processes the .pth exactly as start-up does for site-packages
for _ in range(int(sys.argv[3])):
    site.addpackage(sys.argv[1], "vllm_compat_auto.pth", None)  # the same .pth run again: still one hook
new = sorted(set(sys.modules) - before)
sys.stdout.write("new modules: %s; hook: %s\\n" % (new, sys.excepthook is not hook_before))
sys.stdout.flush()
sys.path.insert(0, sys.argv[2])
exec(sys.argv[4])
"""


def run(tmp_path: Path, speculators_init: str, code: str = "import speculators", again: int = 0, **env: str):
    site_dir = tmp_path / "site-packages"
    site_dir.mkdir(exist_ok=True)
    (site_dir / PTH.name).write_text(PTH.read_text())
    pkgs = tmp_path / "pkgs"
    (pkgs / "speculators" / "utils").mkdir(parents=True, exist_ok=True)
    (pkgs / "speculators" / "__init__.py").write_text(textwrap.dedent(speculators_init))
    (pkgs / "speculators" / "utils" / "__init__.py").write_text("")
    return subprocess.run(
        [sys.executable, "-c", RUN, str(site_dir), str(pkgs), str(again), code],
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("init", "error"),
    [
        (PYDANTIC_TORCH, "pydantic.errors.PydanticUndefinedAnnotation: name 'torch' is not defined"),
        (ATTN_MASK_UTILS_RAISED, "ModuleNotFoundError: No module named 'transformers.modeling_attn_mask_utils'"),
    ],
    ids=["pydantic-torch", "attn-mask-utils"],
)
def test_a_covered_import_failure_gets_the_hint_once_after_the_traceback(tmp_path: Path, init: str, error: str) -> None:
    done = run(tmp_path, init, again=1)
    assert done.returncode == 1, "the failure stays a failure"
    assert done.stdout == "new modules: []; hook: True\n", "the .pth imports nothing and only sets the hook"
    lines = done.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):" and error in lines, "the normal traceback, unchanged"
    hints = [line for line in lines if "vllm-compat" in line]
    assert len(hints) == 1 and hints[0].startswith(HINT), done.stderr
    assert "`vllm-compat run -- COMMAND`" in hints[0] and "VLLM_COMPAT_AUTO=1" in hints[0]
    assert lines[-1] == hints[0], "the hint comes after the traceback"


def test_a_real_missing_transformers_module_gets_the_hint(tmp_path: Path) -> None:
    """The import statement speculators' EAGLE-1 module runs, where transformers (a stand-in, as 5.x) has no such
    module."""
    (tmp_path / "pkgs" / "transformers").mkdir(parents=True)
    (tmp_path / "pkgs" / "transformers" / "__init__.py").write_text("__version__ = '5.5.3'\n")
    done = run(tmp_path, "import speculators.utils\n" + ATTN_MASK_UTILS, code="import speculators")
    assert done.returncode == 1
    assert sum(line.startswith(HINT) for line in done.stderr.splitlines()) == 1, done.stderr


@pytest.mark.parametrize(
    ("init", "code"),
    [
        ("raise ValueError('a bug of its own')\n", "import speculators"),  # another error in speculators
        (PYDANTIC_TORCH.replace('"torch"', '"numpy"'), "import speculators"),  # another undefined name
        ("raise ModuleNotFoundError(\"No module named 'flash_attn'\", name='flash_attn')\n", "import speculators"),
        ("", "from pydantic.errors import PydanticUndefinedAnnotation as P; raise P('torch', 'not in speculators')"),
        ("", "raise KeyboardInterrupt"),
    ],
    ids=["value-error", "other-name", "other-module", "not-through-speculators", "keyboard-interrupt"],
)
def test_other_exceptions_pass_through_unchanged(tmp_path: Path, init: str, code: str) -> None:
    done = run(tmp_path, init, code=code)
    assert done.returncode != 0
    assert "vllm-compat" not in done.stderr, done.stderr
    assert done.stderr.startswith("Traceback (most recent call last):")


def test_no_hint_where_vllm_compat_is_already_active(tmp_path: Path) -> None:
    """Under `vllm-compat run` (vllm_compat imported at start-up) the adapters are there: advice would be wrong."""
    done = run(tmp_path, PYDANTIC_TORCH, code="import vllm_compat; import speculators")
    assert done.returncode == 1 and "PydanticUndefinedAnnotation" in done.stderr
    assert HINT not in done.stderr


@pytest.mark.parametrize(("name", "value"), [("VLLM_COMPAT_DISABLE", "1"), ("VLLM_COMPAT_AUTO", "1")])
def test_no_hook_when_disabled_or_auto(tmp_path: Path, name: str, value: str) -> None:
    done = run(tmp_path, "raise ValueError('x')\n", **{name: value})
    assert done.stdout.endswith("hook: False\n"), done.stdout


def test_the_hint_knows_the_failures_the_import_adapters_cover() -> None:
    """The hint names what adapters/speculators_imports.py covers; an adapter renamed or dropped shows here."""
    from pydantic.errors import PydanticUndefinedAnnotation
    from vllm_compat.adapters import speculators_imports

    from vllm_compat._bootstrap import hint

    assert hint.COVERED_MODULE == speculators_imports.ATTN_MASK_UTILS
    assert 'exc.name != "torch"' in Path(speculators_imports.__file__).read_text()
    assert {speculators_imports.AttentionMaskUtilsShim.id, speculators_imports.PydanticTorchNamespace.id} == {
        "transformers-attn-mask-utils",
        "pydantic-torch-namespace",
    }
    torch = PydanticUndefinedAnnotation("torch", "name 'torch' is not defined")
    assert hint.covered(type(torch), torch)
    other = PydanticUndefinedAnnotation("numpy", "name 'numpy' is not defined")
    assert not hint.covered(type(other), other)
    gone = ModuleNotFoundError("No module named 'transformers.modeling_attn_mask_utils'", name=hint.COVERED_MODULE)
    assert hint.covered(type(gone), gone)
    assert not hint.covered(NameError, NameError("torch"))


def test_the_pth_hot_path_imports_nothing_and_reads_the_hint_only_on_an_uncaught_exception() -> None:
    """At start-up the .pth compiles one small function; hint.py is read (by path) only when an exception reaches it."""
    code = PTH.read_text()
    hot, _, cold = code.partition("def vllm_compat_hint")
    assert "import vllm_compat\\n" in hot and hot.count("import ") == 2, "os, sys, and vllm_compat under AUTO only"
    assert "_bootstrap/hint.py" in cold and "find_spec('vllm_compat')" in cold
