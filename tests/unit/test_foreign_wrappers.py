"""uninstall()/install() round trips when someone wrapped our patch again (a tracer such as ddtrace or OpenTelemetry).

Their wrapper must survive our uninstall, our behaviour must be off after it, and install() must not stack a second
copy of our wrapper under theirs. The foreign wrappers here are real wrapt wrappers, as those tools apply them.
"""

from __future__ import annotations

import types

import wrapt

from tests.unit import test_engine as base
from vllm_compat.adapter import Adapter

sandbox = base.sandbox


def trace(calls: list[str]):
    """A tracer's wrapper: records the call and passes it on unchanged."""

    def wrapper(wrapped, instance, args, kwargs):
        calls.append("traced")
        return wrapped(*args, **kwargs)

    return wrapper


def test_uninstall_under_a_foreign_wrapper_then_install_round_trips(sandbox) -> None:
    engine, _ = sandbox
    import vc_test_target

    original = vc_test_target.thing
    engine.install()
    assert vc_test_target.thing(3) == 6
    calls: list[str] = []
    wrapt.wrap_function_wrapper(vc_test_target, "thing", trace(calls))
    theirs = vc_test_target.thing
    for _ in range(3):
        engine.uninstall()
        assert vc_test_target.thing is theirs, "the other wrapper was removed"
        assert vc_test_target.thing(3) == 3, "vllm-compat's behaviour is still on after uninstall()"
        status = engine.status()
        assert "test-fake" not in status["applied"]
        assert status["pass_through"] == {"test-fake": ["test-fake: vc_test_target.thing"]}
        engine.install()
        assert vc_test_target.thing is theirs
        assert vc_test_target.thing(3) == 6, "the adapter's wrapper runs twice (or not at all)"
        status = engine.status()
        assert "test-fake" in status["applied"] and status["pass_through"] == {}
    assert base.APPLY_CALLS == ["test-fake"] * 4
    assert calls == ["traced"] * 6
    # the tracer takes its wrapper away (as its own unwrap does): ours is on top again and reverts exactly
    vc_test_target.thing = theirs.__wrapped__
    engine.uninstall()
    assert vc_test_target.thing is original
    assert engine.status()["pass_through"] == {}


def test_a_shim_wrapped_by_someone_else_stays_applied(sandbox) -> None:
    """A non-wrapper patch (a name set on a module) cannot be switched off: with someone's wrapper on it, the whole
    adapter stays applied and listed, and install() does not apply it again."""
    engine, _ = sandbox

    class Shim(Adapter):
        """Adds a name and wraps another, like a moved-helper shim."""

        id = "test-shim"
        always = "test"
        target = base.TARGET

        def apply(self, module: types.ModuleType) -> None:
            base.APPLY_CALLS.append(self.id)
            self.set_attr(module, "helper", lambda: "shim")
            self.wrap(module, "thing", lambda wrapped, instance, args, kwargs: 10 * wrapped(*args, **kwargs))

    import vc_test_target

    engine.install()
    assert vc_test_target.thing(1) == 20  # test-fake, then test-shim on top
    calls: list[str] = []
    wrapt.wrap_function_wrapper(vc_test_target, "helper", trace(calls))
    engine.uninstall()
    assert vc_test_target.helper() == "shim" and calls == ["traced"]
    assert list(engine.status()["applied"]) == ["test-shim"], "an adapter still in effect is not listed"
    assert vc_test_target.thing(1) == 10, "half of test-shim was reverted"
    engine.install()
    assert vc_test_target.thing(1) == 20
    assert sorted(base.APPLY_CALLS) == ["test-fake", "test-fake", "test-shim"]


def test_a_wrapper_replaced_outright_is_left_alone(sandbox) -> None:
    """Someone replaced our wrapper without keeping it (no chain): uninstall leaves their object, install wraps it."""
    engine, _ = sandbox
    import vc_test_target

    engine.install()
    ours = vc_test_target.thing

    def theirs(x: int) -> int:
        return x + 1

    vc_test_target.thing = theirs
    engine.uninstall()
    assert vc_test_target.thing is theirs
    assert ours(3) == 3, "a stale reference to our wrapper still applies our behaviour"
    engine.install()
    assert vc_test_target.thing(3) == 8


def test_no_foreign_wrapper_still_restores_the_very_same_object(sandbox) -> None:
    engine, _ = sandbox
    import vc_test_target

    original = vc_test_target.thing
    for _ in range(2):
        engine.install()
        assert vc_test_target.thing(3) == 6
        engine.uninstall()
        assert vc_test_target.thing is original
    assert engine.status()["pass_through"] == {}
