"""Orderings of install()/uninstall() where the drift guard and adapters wrap the same attribute.

The generator's constructor carries the engine's drift guard and, above it, the adapters that wrap ``__init__``.
A further install() after the import must see the guard as in place under those wrappers (not install a second
guard on top, which would leave the adapters' wrappers unrevertable), and uninstall() must bring back the very
same function. Found by the ordering suite on a real vLLM (tests/e2e/test_adapter_ordering.py, "install-twice").
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from tests.unit import test_engine as base
from vllm_compat import engine as engine_module
from vllm_compat.adapter import Adapter

sandbox = base.sandbox
GENERATOR = "vc_test_generator"


@pytest.fixture
def generator_module(sandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / f"{GENERATOR}.py").write_text(
        "class VllmHiddenStatesGenerator:\n    def __init__(self, model_path):\n        self.model_path = model_path\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(engine_module, "GUARD_MODULE", GENERATOR)

    class InitAdapter(Adapter):
        """Wraps the constructor, as constructor-checks and cpu-kv-cache-memory do."""

        id = "test-init"
        always = "test"
        target = GENERATOR

        def apply(self, module: types.ModuleType) -> None:
            self.wrap(module, "VllmHiddenStatesGenerator.__init__", lambda w, i, a, k: w(*a, **k))

    yield sandbox[0]
    sys.modules.pop(GENERATOR, None)


@pytest.mark.parametrize("installs_after_import", [1, 2])
def test_install_again_after_import_keeps_one_guard(generator_module, installs_after_import: int) -> None:
    engine = generator_module
    engine.install()
    engine.install()
    import vc_test_generator

    raw = vc_test_generator.VllmHiddenStatesGenerator.__dict__["__init__"].__wrapped__.__wrapped__
    guard = engine.guard
    for _ in range(installs_after_import):
        engine.install()
    assert engine.guard is guard, "a second drift guard was put on top of the adapters"
    engine.uninstall()
    assert vc_test_generator.VllmHiddenStatesGenerator.__dict__["__init__"] is raw


def test_import_then_install_twice(generator_module) -> None:
    engine = generator_module
    import vc_test_generator

    raw = vc_test_generator.VllmHiddenStatesGenerator.__dict__["__init__"]
    engine.install()
    engine.install()
    assert engine.status()["applied"].keys() == {"test-init"}
    engine.uninstall()
    assert vc_test_generator.VllmHiddenStatesGenerator.__dict__["__init__"] is raw
    engine.install()
    engine.uninstall()
    assert vc_test_generator.VllmHiddenStatesGenerator.__dict__["__init__"] is raw


def test_strict_install_after_a_missing_name_was_guarded(sandbox) -> None:
    """install(strict=True) after the missing-name guard is in place reports the drift itself (not the guard's error
    escaping from hasattr), and the live view sees the guarded name as missing, not as a failed probe."""
    from vllm_compat.probes._kit import import_probe

    from vllm_compat.errors import UnhandledDrift
    from vllm_compat.findings import State

    engine, _ = sandbox
    import_probe(base.TARGET, "gone", ["0.4.0.1"])
    engine.install()
    import vc_test_target  # noqa: F401  (the guard now answers for `gone`)

    engine.observations.clear()  # observe again, through the guard
    with pytest.raises(UnhandledDrift) as caught:
        engine.install(strict=True)
    assert caught.value.where == "install(strict=True)"
    (gone,) = [f for f in caught.value.findings if f.probe == f"import.{base.TARGET}.gone"]
    assert gone.state is State.DRIFTED and gone.variant == "missing"
