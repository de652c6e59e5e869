"""The patch engine's lifecycle, on a throwaway target module and a throwaway adapter and probe."""

from __future__ import annotations

import logging
import sys
import threading
import types
from pathlib import Path

import pytest
from packaging.version import Version

from vllm_compat import adapter as adapter_module
from vllm_compat import engine as engine_module
from vllm_compat import findings as findings_module
from vllm_compat import plugin
from vllm_compat.adapter import Adapter
from vllm_compat.errors import UnhandledDrift
from vllm_compat.findings import Observation, probe
from vllm_compat.lines import LineVerdict

TARGET = "vc_test_target"
APPLY_CALLS: list[str] = []


def original(x: int) -> int:
    return x


@pytest.fixture()
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Fresh engine, registries holding only the test adapter and probe, and speculators 0.4.0.1 'installed'."""
    # import every real probe and adapter module first, so none registers into the sandbox's registries later
    adapter_module.load_adapters()
    from vllm_compat.plan import load_probes

    load_probes()
    monkeypatch.setattr(adapter_module, "_REGISTRY", {})
    monkeypatch.setattr(findings_module, "_REGISTRY", {})
    monkeypatch.setattr(adapter_module, "load_adapters", lambda: adapter_module._REGISTRY)
    monkeypatch.setattr(engine_module, "load_adapters", lambda: adapter_module._REGISTRY)
    monkeypatch.setattr("vllm_compat.plan.load_adapters", lambda: adapter_module._REGISTRY)
    monkeypatch.setattr("vllm_compat.plan.load_probes", lambda: findings_module._REGISTRY)
    monkeypatch.setattr(engine_module, "load_probes", lambda: findings_module._REGISTRY)
    fresh = engine_module._Engine()
    monkeypatch.setattr(engine_module, "engine", fresh)
    monkeypatch.setattr(
        engine_module, "installed_version", lambda name: Version("0.4.0.1") if name == "speculators" else None
    )
    monkeypatch.setattr(engine_module, "judge_line", lambda: LineVerdict("0.4.0.1", "metadata", "0.4.0.1"))
    monkeypatch.setenv("VLLM_COMPAT_ACTIVE", "")
    state = {"variant": "renamed"}

    @probe("test.fake", symbol="vc_test_target.thing", summary="a fact", expected={"0.4.0.1": "the old name"})
    def fake(view) -> Observation:
        return Observation(state["variant"], f"variant {state['variant']}", ("vc_test_target.py:1",))

    class FakeAdapter(Adapter):
        """Wraps vc_test_target.thing so it doubles its result."""

        id = "test-fake"
        covers = {"test.fake": {"renamed"}}
        target = TARGET

        def apply(self, module: types.ModuleType) -> None:
            APPLY_CALLS.append(self.id)
            self.wrap(module, "thing", lambda wrapped, instance, args, kwargs: 2 * wrapped(*args, **kwargs))

    (tmp_path / f"{TARGET}.py").write_text("def thing(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    APPLY_CALLS.clear()
    yield fresh, state
    fresh.uninstall()
    sys.modules.pop(TARGET, None)


def test_install_then_import_applies_once(sandbox) -> None:
    engine, _ = sandbox
    engine.install()
    engine.install()
    import vc_test_target

    assert vc_test_target.thing(3) == 6
    engine.install()
    assert APPLY_CALLS == ["test-fake"]
    assert "test-fake" in engine.status()["applied"]


def test_import_then_install_applies_at_once(sandbox) -> None:
    engine, _ = sandbox
    import vc_test_target

    before = vc_test_target.thing
    engine.install()
    assert vc_test_target.thing(3) == 6
    engine.uninstall()
    assert vc_test_target.thing is before  # the very same object comes back
    engine.install()
    assert vc_test_target.thing(3) == 6
    assert APPLY_CALLS == ["test-fake", "test-fake"]


def test_uninstall_without_install_is_harmless(sandbox) -> None:
    engine, _ = sandbox
    engine.uninstall()
    assert engine.status()["installed"] is False


def test_baseline_means_no_patch(sandbox) -> None:
    engine, state = sandbox
    state["variant"] = "baseline"
    engine.install()
    import vc_test_target

    assert vc_test_target.thing(3) == 3
    assert APPLY_CALLS == []


def test_unknown_drift_fails_closed_in_strict_mode(sandbox) -> None:
    engine, state = sandbox
    state["variant"] = "something-new"
    with pytest.raises(UnhandledDrift) as caught:
        engine.install(strict=True)
    message = str(caught.value)
    assert "test.fake" in message and "vc_test_target.thing" in message and "vllm-compat probe" in message


def test_strict_from_the_environment_probes_when_the_generator_is_imported(
    sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """VLLM_COMPAT_STRICT=1 (``vllm-compat run --strict``, VLLM_COMPAT_AUTO) probes when speculators' generator is
    imported, not in install(): that runs at every interpreter's start-up, where probing imports vLLM and torch."""
    engine, state = sandbox
    state["variant"] = "something-new"
    monkeypatch.setenv("VLLM_COMPAT_STRICT", "1")
    monkeypatch.delitem(sys.modules, "vllm", raising=False)  # a fresh interpreter: vLLM not imported yet
    monkeypatch.setattr(engine_module, "GUARD_MODULE", TARGET)  # the throwaway module stands in for the generator
    engine.install()
    assert engine.status()["strict"] is True and engine.observations == {}, "probed at install()"
    with pytest.raises(UnhandledDrift, match="generator module finished importing"):
        import vc_test_target  # noqa: F401
    assert APPLY_CALLS == []


def test_guard_stops_the_generator_before_it_loads(sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, state = sandbox
    state["variant"] = "something-new"
    built: list[str] = []

    class VllmHiddenStatesGenerator:
        def __init__(self, model_path: str) -> None:
            built.append(model_path)

    fake = types.ModuleType(engine_module.GUARD_MODULE)
    fake.VllmHiddenStatesGenerator = VllmHiddenStatesGenerator
    monkeypatch.setitem(sys.modules, engine_module.GUARD_MODULE, fake)
    engine.install()
    with pytest.raises(UnhandledDrift, match="before the model loads"):
        fake.VllmHiddenStatesGenerator("model")
    assert built == []
    state["variant"] = "renamed"
    engine.observations.clear()
    fake.VllmHiddenStatesGenerator("model")
    assert built == ["model"]


def test_install_from_two_threads_applies_each_patch_once(sandbox) -> None:
    engine, _ = sandbox
    import vc_test_target

    barrier = threading.Barrier(2)

    def go() -> None:
        barrier.wait()
        engine.install()

    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert APPLY_CALLS == ["test-fake"]
    assert vc_test_target.thing(3) == 6


def test_plugin_is_a_no_op_unless_the_parent_opted_in(sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _ = sandbox
    monkeypatch.delenv("VLLM_COMPAT_ACTIVE", raising=False)
    plugin.register()
    assert engine.status()["installed"] is False
    monkeypatch.setenv("VLLM_COMPAT_ACTIVE", "1")
    plugin.register()
    plugin.register()  # loaded twice in one process (fork, then the loader again): still one install
    assert engine.status()["installed"] is True
    assert engine.status()["plugin_loaded"] is True


def test_the_variables_workers_inherit_are_set_only_while_the_generator_starts(
    sandbox, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """VLLM_COMPAT_ACTIVE (the plugin's opt-in) and model-runner-v1's VLLM_USE_V2_MODEL_RUNNER=0 reach the processes
    the generator's constructor starts (its vLLM workers), and no other child of the process (a `vllm serve` the
    script starts later): they are set while the constructor runs, not on import or install()."""
    import os
    import subprocess

    from vllm_compat.adapters.config import ForceV1ModelRunner

    engine, _ = sandbox
    variables = ("VLLM_COMPAT_ACTIVE", "VLLM_USE_V2_MODEL_RUNNER")
    for name in variables:
        monkeypatch.delenv(name, raising=False)
    adapter_module._REGISTRY["model-runner-v1"] = ForceV1ModelRunner

    @probe(
        "config.model_runner_default",
        symbol="vllm.config.VllmConfig.use_v2_model_runner",
        summary="x",
        expected={"0.4.0.1": "V1"},
    )
    def model_runner_default(view) -> Observation:
        return Observation("v2_default", "V2 by default")

    for fact in ("model_runner.v1_attributes", "scheduler.batch_order"):  # V1's facts hold: the choice takes V1
        probe(fact, symbol="x", summary="x", expected={"0.4.0.1": "V1"})(lambda view: Observation("baseline", "x"))
    monkeypatch.delenv("VLLM_COMPAT_MODEL_RUNNER", raising=False)

    child = f"import os; print([os.environ.get(n) for n in {variables!r}])"
    seen: list[str] = []

    class VllmHiddenStatesGenerator:
        def __init__(self, model_path: str, fail: bool = False) -> None:
            # as vLLM starts its workers: a child process inherits this process's environment now
            seen.append(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.strip())
            if fail:
                raise RuntimeError("KV-cache planning failed")

    fake = types.ModuleType(engine_module.GUARD_MODULE)
    fake.VllmHiddenStatesGenerator = VllmHiddenStatesGenerator
    monkeypatch.setitem(sys.modules, engine_module.GUARD_MODULE, fake)  # imported: install() applies at once
    engine.install()
    assert "model-runner-v1" in engine.status()["applied"] and engine.status()["guarded"]
    assert [os.environ.get(n) for n in variables] == [None, None], "set process-wide on import/install()"
    model = tmp_path / "model"  # a local folder: no hub lookup for its architectures
    model.mkdir()
    fake.VllmHiddenStatesGenerator(str(model))
    with pytest.raises(RuntimeError):
        fake.VllmHiddenStatesGenerator(str(model), fail=True)
    assert seen == ["['1', '0']", "['1', '0']"]
    assert [os.environ.get(n) for n in variables] == [None, None], "left set after the constructor"


def test_a_removed_name_fails_closed_at_import(sandbox) -> None:
    """speculators' `from vllm... import NAME` of a name no adapter restores raises UnhandledDrift, naming the probe."""
    from vllm_compat.probes._kit import import_probe

    engine, _ = sandbox
    import_probe(TARGET, "gone", ["0.4.0.1"])
    engine.install()
    with pytest.raises(UnhandledDrift) as caught:
        from vc_test_target import gone  # noqa: F401
    assert "import.vc_test_target.gone" in str(caught.value) and "vc_test_target.gone" in str(caught.value)
    import vc_test_target

    assert vc_test_target.thing(2) == 4  # other names are untouched
    with pytest.raises(AttributeError):
        vc_test_target.other  # noqa: B018
    engine.uninstall()
    assert "__getattr__" not in vars(vc_test_target)


def test_the_guard_logs_one_summary_line_per_process(sandbox, caplog: pytest.LogCaptureFixture) -> None:
    """Versions, the line and how it was judged, the drifts covered and by which adapters: once, at INFO."""
    engine, _state = sandbox
    import vc_test_target  # noqa: F401  (the covered drift's adapter applies)

    engine.install()
    with caplog.at_level(logging.INFO, logger="vllm_compat"):
        engine.check(where="VllmHiddenStatesGenerator.__init__")
        engine.check(where="VllmHiddenStatesGenerator.__init__")  # a second generator in the same process
    lines = [r for r in caplog.records if r.getMessage().startswith("vllm-compat: vLLM")]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    message = lines[0].getMessage()
    assert "speculators 0.4.0.1 (line 0.4.0.1, judged from the metadata" in message
    assert "1 drift(s) covered by test-fake" in message and "0 unhandled" in message


def test_the_native_line_gets_only_the_adapters_that_serve_it(sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    """speculators 0.9.0 installed (no generator code: the line comes from the metadata as ``native-0.9``): on import
    of its target, an adapter serving 0.5 to 0.9 is applied (its run-time condition holds); the in-process adapter of
    the same target, which serves 0.3 and 0.4, is not."""
    engine, _ = sandbox
    monkeypatch.setattr(engine_module, "judge_line", lambda: LineVerdict(None, "absent", "0.9.0"))
    applied: list[str] = []

    class NativeAdapter(Adapter):
        """Marks vc_test_target for the native line."""

        id = "test-native"
        covers = {}
        speculators = ">=0.5,<0.10"
        always = "a run-time condition: always, in this test"
        target = TARGET

        def apply(self, module: types.ModuleType) -> None:
            applied.append(self.id)
            self.set_attr(module, "native_mark", True)

    engine.install()
    import vc_test_target

    assert applied == ["test-native"] and vc_test_target.native_mark is True
    assert vc_test_target.thing(3) == 3  # test-fake (0.4.0.1's) left alone
    assert APPLY_CALLS == []
    assert sorted(engine.status()["applied"]) == ["test-native"]
    engine.uninstall()
    assert not hasattr(vc_test_target, "native_mark")


def test_a_companion_applies_only_where_its_own_facts_hold(sandbox) -> None:
    """A companion (async-output-under-v2, say) goes with its principal, and only where its relies_on facts hold;
    where one does not, the principal applies alone."""
    engine, _ = sandbox
    fact = {"variant": "baseline"}

    @probe("test.companion_fact", symbol="vc_test_target.thing", summary="a fact", expected={"0.4.0.1": "it holds"})
    def companion_fact(view) -> Observation:
        return Observation(fact["variant"], f"variant {fact['variant']}", ("vc_test_target.py:2",))

    class Companion(Adapter):
        """Adds one to vc_test_target.thing's result, outside test-fake's wrapper."""

        id = "test-companion"
        covers: dict = {}
        companion_of = "test-fake"
        relies_on = {"test.companion_fact": {"baseline"}}
        target = TARGET
        order = 1

        def apply(self, module: types.ModuleType) -> None:
            APPLY_CALLS.append(self.id)
            self.wrap(module, "thing", lambda wrapped, instance, args, kwargs: 1 + wrapped(*args, **kwargs))

    engine.install()
    import vc_test_target

    assert vc_test_target.thing(3) == 7  # both
    assert APPLY_CALLS == ["test-fake", "test-companion"]
    engine.uninstall()
    fact["variant"] = "changed"
    APPLY_CALLS.clear()
    engine.install()
    assert vc_test_target.thing(3) == 6  # the principal alone
    assert APPLY_CALLS == ["test-fake"]
    assert "test-companion" not in engine.status()["applied"]
