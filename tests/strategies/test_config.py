"""What a strategy's config takes from Python, where nothing parses it first: a switch is True or False (a string
such as "false" is truthy and would turn the knob on), and sequences and parameter groups of the wrong type are
refused naming the argument."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import quietsync
from quietsync.models import build_model
from quietsync.strategies.registry import get, ordered, strategy_config


def _switches() -> list[tuple[str, str]]:
    return [(name, f.name) for name in ordered() for f in dataclasses.fields(get(name)[1])
            if f.type in ("bool", bool)]


def test_every_strategy_has_switches_to_check():
    assert {"diloco", "demo", "localsgd"} <= {name for name, _ in _switches()}


@pytest.mark.parametrize("name,switch", _switches())
@pytest.mark.parametrize("value", ["false", 0, 1, None])
def test_a_switch_takes_only_true_or_false(name, switch, value):
    with pytest.raises(ValueError, match=f"{switch} must be True or False, got {value!r}"):
        strategy_config(name, {switch: value})


def test_true_and_false_are_taken():
    assert strategy_config("diloco", {"outer_nesterov": False}).outer_nesterov is False
    assert strategy_config("demo", {"sign": True}).sign is True


def test_worker_speeds_and_param_groups_of_the_wrong_type_name_the_argument():
    with pytest.raises(ValueError, match="worker_speeds must be a sequence of numbers, one per worker, got 1.0"):
        strategy_config("localsgd", {"inner_steps": "adaptive", "worker_speeds": 1.0})
    with pytest.raises(ValueError, match="worker_speeds must be numbers"):
        strategy_config("diloco", {"inner_steps": "adaptive", "worker_speeds": ["fast", "slow"]})
    model = build_model("tiny", vocab_size=4096)
    with pytest.raises(TypeError, match="param_groups must be a list of parameter groups .* got int"):
        quietsync.make_strategy("zero1", model, torch.optim.AdamW, lr=1e-3, param_groups=5)
    with pytest.raises(ValueError, match="param_groups: parameter group 0 has no 'params' key"):
        quietsync.make_strategy("zero1", model, torch.optim.AdamW, lr=1e-3, param_groups=[{"lr": 1e-3}])
