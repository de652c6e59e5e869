"""adapters/ and probes/ install as vllm_compat.adapters and vllm_compat.probes, never as top-level packages:
in a built wheel, a plain install and an editable install."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = """
import importlib.util, json, importlib.metadata as md
import vllm_compat, vllm_compat.adapters, vllm_compat.probes
from vllm_compat.adapter import load_adapters
from vllm_compat.plan import load_probes
eps = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "vllm_compat"]
print(json.dumps({
    "top_level_adapters": importlib.util.find_spec("adapters") is not None,
    "top_level_probes": importlib.util.find_spec("probes") is not None,
    "adapters": len(load_adapters()), "probes": len(load_probes()), "plugin": eps,
}))
"""


def _check(python: str) -> dict:
    out = subprocess.run([python, "-c", CHECK], capture_output=True, text=True, check=True, cwd="/")
    return json.loads(out.stdout)


def _assert_layout(found: dict) -> None:
    assert not found["top_level_adapters"] and not found["top_level_probes"]
    assert found["adapters"] >= 15 and found["probes"] >= 40
    assert found["plugin"] == ["vllm_compat_plugin:register"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    return next(out.glob("vllm_compat-*.whl"))


def test_wheel_contents(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    # beside the package: the pytest and vLLM plugin modules (top-level so that loading them imports nothing), a .pth
    beside = {"vllm_compat", "pytest_vllm_compat.py", "vllm_compat_plugin.py"}
    assert {t for t in tops if not t.endswith(".pth")} <= beside
    assert not tops & {"adapters", "probes"}
    assert "vllm_compat/adapters/kv_cache.py" in names and "vllm_compat/probes/config.py" in names
    assert "vllm_compat/_bootstrap/hint.py" in names, "the .pth's excepthook reads it by path from the package"
    meta = next(n for n in names if n.endswith("METADATA"))
    requires = [ln for ln in zipfile.ZipFile(wheel).read(meta).decode().splitlines() if ln.startswith("Requires-Dist")]
    assert sorted(r.split(":")[1].split(";")[0].strip().split(">")[0] for r in requires if "extra" not in r) == [
        "packaging",
        "wrapt",
    ]


@pytest.mark.parametrize("mode", ["wheel", "plain"])
def test_install_into_fresh_venv(tmp_path: Path, wheel: Path, mode: str) -> None:
    """A fresh venv gets the package, its two dependencies, and nothing top-level named adapters or probes."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=True)  # wrapt/packaging come from the host
    python = str(env_dir / "bin" / "python")
    target = str(wheel) if mode == "wheel" else str(ROOT)
    # a plain install builds from source in pip's isolated build environment (setuptools from the index)
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", target], check=True, capture_output=True)
    _assert_layout(_check(python))
    help_run = subprocess.run([str(env_dir / "bin" / "vllm-compat"), "probe", "--help"], capture_output=True)
    assert help_run.returncode == 0 and b"--source" in help_run.stdout


def test_editable_install_in_this_environment() -> None:
    """The test environment itself is an editable install (pip install -e .)."""
    _assert_layout(_check(sys.executable))
