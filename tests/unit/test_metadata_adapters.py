"""accelerator-name-without-driver on a stand-in of speculators 0.4.0.1's config_generator (on a real engine and
speculators' own data-generation code, with a CUDA build of torch on a host without a driver:
tests/e2e/test_training.py::test_the_scripts_defaults)."""

from __future__ import annotations

import types

import pytest
from vllm_compat.adapters import metadata
from vllm_compat.adapters.metadata import NO_ACCELERATOR, AcceleratorNameWithoutDriver


def config_module() -> types.ModuleType:
    """speculators 0.4.0.1's config_generator where it matters: ``_get_gpu_info`` looks ``get_device_name`` up in
    the module when it runs, and the helper asks the accelerator torch was built for."""
    module = types.ModuleType("stand_in_config_generator")

    def get_device_name(idx: int) -> str:
        raise RuntimeError("Found no NVIDIA driver on your system.")

    def _get_gpu_info() -> str:
        name = module.get_device_name(0)
        return "CPU ONLY" if name == NO_ACCELERATOR else name

    module.get_device_name = get_device_name
    module._get_gpu_info = _get_gpu_info
    return module


@pytest.mark.parametrize("usable", [False, True])
def test_the_metadata_says_cpu_only_without_a_usable_accelerator(monkeypatch: pytest.MonkeyPatch, usable: bool) -> None:
    module = config_module()
    monkeypatch.setattr(metadata, "_accelerator_usable", lambda: usable)
    adapter = AcceleratorNameWithoutDriver()
    adapter.apply(module)
    try:
        if usable:  # speculators' own helper answers where an accelerator is there
            with pytest.raises(RuntimeError, match="NVIDIA driver"):
                module._get_gpu_info()
        else:
            assert module._get_gpu_info() == "CPU ONLY"
    finally:
        adapter.revert()
    with pytest.raises(RuntimeError, match="NVIDIA driver"):
        module._get_gpu_info()


def test_without_the_helper_nothing_is_patched() -> None:
    adapter = AcceleratorNameWithoutDriver()
    adapter.apply(types.ModuleType("speculators_0_3_0_config_generator"))
    assert not adapter.applied


def test_only_speculators_0_4_is_served() -> None:
    assert AcceleratorNameWithoutDriver.serves("0.4.0.1") and not AcceleratorNameWithoutDriver.serves("0.3.0")
