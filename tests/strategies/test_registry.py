"""The registry can be put back: a strategy registered inside :func:`restored` is gone when the block ends (even
by an exception), :func:`unregister` forgets one name and refuses an unknown one. The suite's autouse fixture
(tests/conftest.py) wraps every test in :func:`restored`, so a test that registers a strategy leaves none behind."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from quietsync.strategies import Strategy, StrategyConfig, available, get, register
from quietsync.strategies.registry import restored, schedules, unregister


@dataclass
class _Config(StrategyConfig):
    """No knob."""


def _define(name: str) -> type[Strategy]:
    @register(name, _Config, schedule=lambda workload, topology, config: None)
    class Probe(Strategy):  # never built: registering is what is tested
        pass

    return Probe


def test_restored_takes_back_a_registration_and_an_unregistration():
    before = available()
    with restored():
        _define("probe-a")
        unregister("ddp")
        assert "probe-a" in available() and "ddp" not in available() and "probe-a" in schedules()
    assert available() == before and "probe-a" not in schedules()
    assert get("ddp")[0].name == "ddp"


def test_restored_holds_when_the_block_raises():
    before = available()
    with pytest.raises(RuntimeError), restored():
        _define("probe-b")
        raise RuntimeError("the test failed inside")
    assert available() == before


def test_unregister_forgets_one_name_and_refuses_an_unknown_one():
    with restored():
        _define("probe-c")
        unregister("probe-c")
        assert "probe-c" not in available() and "probe-c" not in schedules()
        with pytest.raises(ValueError, match="strategy must be one of .*got 'probe-c'"):
            unregister("probe-c")


# The next two tests run in either order (pytest-randomly shuffles them): the first registration must not outlive
# its test, or the other one (which registers a different class under the same name) fails with "registered twice".
def test_a_registration_does_not_outlive_its_test_one():
    _define("probe-left-behind")
    assert "probe-left-behind" in available()


def test_a_registration_does_not_outlive_its_test_two():
    _define("probe-left-behind")
    assert "probe-left-behind" in available()


def test_a_config_that_is_not_a_strategy_config_dataclass_is_refused_when_registered():
    """The front doors call the config's methods (``replace``, ``uneven_steps``): a plain dataclass is refused at
    registration, naming the class to subclass, not deep inside a Trainer."""

    @dataclass
    class Plain:
        lr: float = 0.1

    with pytest.raises(TypeError, match=r"^register\('plain', \.\.\.\): the config must be a dataclass subclassing "
                                        r"quietsync\.strategies\.StrategyConfig"):
        register("plain", Plain)
    assert "plain" not in available()
