"""The KV cache's commitment: the probe on small vLLM-shaped trees, and extensible-kv-cache-off's effect on the config.

The real releases (vLLM 0.33.0 baseline, 0.34.0 on by default) are in tests/drift/test_wheels.py; a 0.34.0 tree whose
resolver ignores an explicit False is refused in tests/drift/test_fail_closed.py; the effect on a GPU (the first call
larger than the warm-up) is in the H200 runs recorded in docs/e2e-matrix.json.
"""

from __future__ import annotations

import dataclasses
import textwrap
import types
from pathlib import Path
from textwrap import dedent

import pytest
from vllm_compat.adapters.kv_cache import ExtensibleKvCacheOff

from vllm_compat.apiview.static import StaticView
from vllm_compat.plan import load_probes, make_plan

PROBE = "kv_cache.commitment"

GUARDED = """
    def _resolve_extensible_kv_cache(self):
        cache_config = self.cache_config
        requested = cache_config.enable_extensible_kv_cache
        unsupported = None if self.cuda else "only on CUDA"
        if requested is None:
            cache_config.enable_extensible_kv_cache = unsupported is None
        elif requested and unsupported is not None:
            raise ValueError(unsupported)
"""
FORCED = """
    def _resolve_extensible_kv_cache(self):
        self.cache_config.enable_extensible_kv_cache = self.cuda
"""


def tree(tmp_path: Path, field: str | None, resolver: str = "") -> Path:
    root = tmp_path / "vllm-tree"
    files = {
        "vllm/__init__.py": "",
        "vllm/config/__init__.py": (
            "from vllm.config.cache import CacheConfig\nfrom vllm.config.vllm import VllmConfig\n"
        ),
        "vllm/config/cache.py": "from dataclasses import dataclass\n\n\n@dataclass\nclass CacheConfig:\n"
        "    block_size: int = 16\n" + (f"    enable_extensible_kv_cache: bool = {field}\n" if field else ""),
        "vllm/config/vllm.py": "class VllmConfig:\n    cuda = True\n" + textwrap.indent(dedent(resolver), "    "),
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    ("field", "resolver", "variant"),
    [
        (None, "", "baseline"),  # vLLM <= 0.33: no extensible cache
        ("False", "", "opt_in"),
        ("Field(default=None)", GUARDED, "on_by_default"),  # vLLM 0.34.0
        ("None", FORCED, "forced"),
        ("None", "", "unknown"),  # a default of None nobody resolves: cannot tell
    ],
)
def test_the_probe_tells_the_commitment(tmp_path: Path, field, resolver: str, variant: str) -> None:
    observation = load_probes()[PROBE].observe(StaticView(tree(tmp_path, field, resolver)))
    assert observation.variant == variant, observation.observed
    if variant != "unknown":
        assert "vllm/config/cache.py:" in " ".join(observation.evidence)


def test_on_by_default_is_covered_and_forced_is_not(tmp_path: Path) -> None:
    covered = make_plan(StaticView(tree(tmp_path / "a", "None", GUARDED)), ["0.3.0", "0.4.0.1"])
    forced = make_plan(StaticView(tree(tmp_path / "b", "None", FORCED)), ["0.3.0", "0.4.0.1"])
    for f in (f for f in covered.findings if f.probe == PROBE):
        assert f.state.value == "drifted" and f.handled and f.adapter == "extensible-kv-cache-off"
    for f in (f for f in forced.findings if f.probe == PROBE):
        assert f.state.value == "drifted" and not f.handled and f.adapter is None
    assert PROBE in {f.probe for f in forced.unhandled_drift}


def generator_module() -> types.ModuleType:
    """speculators' generator module where it matters: it builds CacheConfig itself, without the new keyword, and
    CacheConfig resolves an unset ``enable_extensible_kv_cache`` to True as vLLM 0.34.0 does on CUDA."""

    @dataclasses.dataclass
    class CacheConfig:
        block_size: int = 16
        gpu_memory_utilization: float = 0.9
        enable_prefix_caching: bool | None = None
        enable_extensible_kv_cache: bool | None = None

        def __post_init__(self) -> None:
            if self.enable_extensible_kv_cache is None:
                self.enable_extensible_kv_cache = True

    module = types.ModuleType("stand_in_generator")
    module.CacheConfig = CacheConfig
    return module


def speculators_call(module: types.ModuleType):
    return module.CacheConfig(block_size=16, gpu_memory_utilization=0.8, enable_prefix_caching=False)


def test_the_adapter_keeps_speculators_cache_whole_and_reverts() -> None:
    module = generator_module()
    assert speculators_call(module).enable_extensible_kv_cache is True  # what broke on the GPU
    adapter = ExtensibleKvCacheOff()
    adapter.apply(module)
    try:
        config = speculators_call(module)
        assert config.enable_extensible_kv_cache is False
        assert (config.block_size, config.gpu_memory_utilization, config.enable_prefix_caching) == (16, 0.8, False)
        assert module.CacheConfig(enable_extensible_kv_cache=True).enable_extensible_kv_cache is True  # asked: kept
    finally:
        adapter.revert()
    assert speculators_call(module).enable_extensible_kv_cache is True
    assert not adapter.applied


ENGINE_CORE = """
class EngineCore:
    def __init__(self, vllm_config, executor_class):
        self.model_executor = executor_class(vllm_config)
        self.model_executor.register_failure_callback(print)
        self._initialize_kv_caches(vllm_config)

    def _initialize_kv_caches(self, vllm_config):
        specs = self.model_executor.get_kv_cache_specs()
        self.model_executor.initialize_from_config(specs)
        self.model_executor.compile_or_warm_up_model()
        {extra}
"""


@pytest.mark.parametrize(
    ("extra", "variant"),
    [
        ("pass", "baseline"),
        ("self.model_executor.extend_kv_cache(10)", "baseline"),  # reviewed: extensible-kv-cache-off keeps it whole
        ("self.collective_rpc('pin_pages')", "unreviewed=collective_rpc(pin_pages)"),
        ("self.model_executor.warm_kv_cache(); self.model_executor.pin()", "unreviewed=pin,warm_kv_cache"),
    ],
)
def test_engine_start_up_steps(tmp_path: Path, extra: str, variant: str) -> None:
    root = tmp_path / "tree"
    (root / "vllm/v1/engine").mkdir(parents=True)
    for init in ("vllm", "vllm/v1", "vllm/v1/engine"):
        (root / init / "__init__.py").write_text("")
    (root / "vllm/v1/engine/core.py").write_text(dedent(ENGINE_CORE).replace("{extra}", extra))
    plan = make_plan(StaticView(root), ["0.3.0", "0.4.0.1"])
    found = [f for f in plan.findings if f.probe == "engine.startup_steps"]
    assert found and all(f.variant == variant for f in found)
    if variant != "baseline":
        assert all(not f.handled and "vllm/v1/engine/core.py:" in f.evidence for f in found)
        assert "engine.startup_steps" in {f.probe for f in plan.unhandled_drift}
