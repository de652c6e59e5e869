"""Adapters of the requests speculators builds, on a stand-in generator class (their effect on a real engine:
tests/e2e/test_extraction.py)."""

from __future__ import annotations

import types

from vllm_compat.adapters.request import BlockHashesOnlyForPrefixCaching


def generator_module() -> types.ModuleType:
    module = types.ModuleType("stand_in_generator")

    class VllmHiddenStatesGenerator:
        def __init__(self, prefix_caching: bool) -> None:
            cache = types.SimpleNamespace(enable_prefix_caching=prefix_caching)
            self.vllm_config = types.SimpleNamespace(cache_config=cache)
            self.block_hasher = lambda request: []

    module.VllmHiddenStatesGenerator = VllmHiddenStatesGenerator
    return module


def test_block_hasher_is_dropped_only_where_prefix_caching_is_off() -> None:
    module = generator_module()
    adapter = BlockHashesOnlyForPrefixCaching()
    adapter.apply(module)
    try:
        assert module.VllmHiddenStatesGenerator(prefix_caching=False).block_hasher is None
        assert module.VllmHiddenStatesGenerator(prefix_caching=True).block_hasher is not None, "the cache uses it"
    finally:
        adapter.revert()
    assert module.VllmHiddenStatesGenerator(prefix_caching=False).block_hasher is not None, "reverted"


def test_a_generator_without_a_hasher_is_left_alone() -> None:
    """speculators 0.3.0's generator has no ``block_hasher``: nothing is added."""
    module = generator_module()
    cls = module.VllmHiddenStatesGenerator
    original = cls.__init__

    def init(self, prefix_caching: bool) -> None:
        original(self, prefix_caching)
        del self.block_hasher

    cls.__init__ = init
    adapter = BlockHashesOnlyForPrefixCaching()
    adapter.apply(module)
    try:
        assert not hasattr(cls(prefix_caching=False), "block_hasher")
    finally:
        adapter.revert()
