"""What a replica that heals takes from a live peer, per strategy, as quietsync.faults.support states it: the
peer's committed state, with what a replica owes the others (error-feedback residuals, decoupled momentum) empty
and local parameters that drift between syncs taken from the agreed ones. Checked on a world of one: the peer
trains a few steps, the healing replica (another seed, another history) takes its heal state."""

from __future__ import annotations

import pytest
import torch

import quietsync
from quietsync.faults.heal import heal_state, load_heal_state
from quietsync.faults.peer_checkpoint import pack_state, unpack_state
from tests.strategies.helpers.common import loss_fn, micro_batch, param_groups, tiny_model


def _trained(name: str, config: dict, seed: int, steps: int = 3) -> quietsync.Strategy:
    model = tiny_model(seed)
    strategy = quietsync.make_strategy(name, model, torch.optim.AdamW, param_groups=param_groups(model),
                                       config=config, lr=1e-2)
    for step in range(steps):
        strategy.forward_backward(micro_batch(step + 10 * seed, 0, 0), loss_fn)
        assert strategy.step()
    return strategy


def _params(strategy: quietsync.Strategy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in strategy.module.parameters()]


def _healed(name: str, config: dict) -> tuple[quietsync.Strategy, quietsync.Strategy]:
    peer = _trained(name, config, seed=0)
    joiner = _trained(name, config, seed=1, steps=1)
    load_heal_state(joiner, unpack_state(*pack_state(heal_state(peer))))  # what the peer checkpoint sends: packed
    return peer, joiner


@pytest.mark.parametrize("name", ["ddp", "zero1"])
def test_ddp_and_zero1_take_the_peer_state_exactly(name):
    peer, joiner = _healed(name, {})
    assert joiner.steps == peer.steps
    for a, b in zip(_params(peer), _params(joiner)):
        assert torch.equal(a, b)
    batch = micro_batch(99, 0, 0)  # and they go on identically
    for s in (peer, joiner):
        s.forward_backward(batch, loss_fn)
        s.step()
    for a, b in zip(_params(peer), _params(joiner)):
        assert torch.equal(a, b)


def test_localsgd_starts_from_the_last_average_with_the_peer_moments():
    peer, joiner = _healed("localsgd", {"sync_every": 2})  # 3 steps: one local step since the last average
    assert any(not torch.equal(p, s) for p, s in zip(peer.params, peer.synced))  # synced: in param-group order
    for p, s in zip(joiner.params, peer.synced):
        assert torch.equal(p, s)
    for p, q in zip(peer.module.parameters(), joiner.module.parameters()):
        assert torch.equal(peer.optimizer.state[p]["exp_avg"], joiner.optimizer.state[q]["exp_avg"])


def test_diloco_starts_from_theta_global_with_an_empty_residual():
    config = {"sync_every": 2, "outer": "sparseloco", "pseudo_grad_dtype": "int2", "topk_density": 0.25,
              "topk_chunk": 16}
    peer, joiner = _healed("diloco", config)
    slots = peer.outer.worker_slots()
    assert slots and all(float(t.abs().sum()) > 0 for t, _ in slots.values())  # the peer owes something
    assert all(float(t.abs().sum()) == 0 for t, _ in joiner.outer.worker_slots().values())
    with peer.outer.global_params():
        theta_global = _params(peer)
    for a, b in zip(theta_global, _params(joiner)):
        assert torch.equal(a, b)
    for a, b in zip(peer.outer.globals, joiner.outer.globals):
        assert torch.equal(a, b)


def test_diloco_takes_the_outer_momentum():
    peer, joiner = _healed("diloco", {"sync_every": 1})
    for a, b in zip(peer.outer.optimizers, joiner.outer.optimizers):
        (ga,), (gb,) = a.param_groups[0]["params"], b.param_groups[0]["params"]
        assert torch.equal(a.state[ga]["momentum_buffer"], b.state[gb]["momentum_buffer"])


@pytest.mark.parametrize("name", ["demo", "flexdemo"])
def test_demo_and_flexdemo_start_with_an_empty_decoupled_momentum(name):
    config = {"replicator": "random", "compression": 0.25}
    peer = _trained(name, config, seed=0)
    with torch.no_grad():  # what a worker has not sent yet (a world of one sends it all: set it by hand)
        for state in peer.optimizer.state.values():
            state["delta"].add_(1.0)
    joiner = _trained(name, config, seed=1, steps=1)
    load_heal_state(joiner, unpack_state(*pack_state(heal_state(peer))))
    assert joiner.optimizer.state and all(float(st["delta"].abs().sum()) == 0 for st in joiner.optimizer.state.values())
    for a, b in zip(_params(peer), _params(joiner)):
        assert torch.equal(a, b)
