"""DeMo-SGD and decoupled AdamW as plain torch optimizers: oracles, groups, skipped params, resume."""

from __future__ import annotations

import copy

import pytest
import torch

from quietsync.optim import DecoupledAdamW, DeMoSGD
from quietsync.topology import Topology
from quietsync.transport import Transport
from tests.distributed import run_ranks
from tests.strategies.helpers.common import flat_params, loss_fn, micro_batch, param_groups, reference_run, tiny_model


def _make(kind: str, model: torch.nn.Module, transport=None, **kw):
    groups = param_groups(model, weight_decay=kw.pop("weight_decay", 0.1))
    if kind == "sgd":
        return DeMoSGD(groups, transport=transport, **kw)
    return DecoupledAdamW(groups, transport=transport, **kw)


def _train(rank: int, world: int, kind: str, steps: int, kw: dict) -> torch.Tensor:
    transport = Transport(Topology.from_env())
    model = tiny_model()
    opt = _make(kind, model, transport, **kw)
    for s in range(steps):
        opt.zero_grad()
        loss_fn(model, micro_batch(s, rank, 0)).backward()
        opt.step()
    transport.close()
    return flat_params(model)


@pytest.mark.timeout(120)
def test_sgd_full_no_decay_no_sign_is_all_reduced_sgd():
    kw = {"lr": 0.05, "beta": 0.0, "sign": False, "replicator": "full"}
    out = run_ranks(_train, 2, "sgd", 4, kw)
    # torch SGD's L2 weight decay equals decoupled decay for momentum-free SGD
    want = reference_run(2, 1, 4, optimizer="sgd", lr=0.05, weight_decay=0.1)
    for params in out:
        torch.testing.assert_close(params, want, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_adamw_full_no_decay_no_sign_is_all_reduced_adamw():
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "beta": 0.0, "sign": False, "replicator": "full"}
    out = run_ranks(_train, 2, "adamw", 4, kw)
    want = reference_run(2, 1, 4, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for params in out:
        torch.testing.assert_close(params, want, rtol=1e-5, atol=1e-6)


def test_world_of_one_is_sign_sgd_on_the_local_gradient():
    model, ref = tiny_model(), tiny_model()
    opt = DeMoSGD(model.parameters(), lr=0.01, beta=0.9, sign=True, weight_decay=0.0)
    for s in range(3):
        opt.zero_grad()
        loss_fn(model, micro_batch(s, 0, 0)).backward()
        opt.step()
        ref.zero_grad()
        loss_fn(ref, micro_batch(s, 0, 0)).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.01 * p.grad.sign()
    torch.testing.assert_close(flat_params(model), flat_params(ref))


def test_params_without_grads_are_skipped_and_groups_keep_their_lr():
    torch.manual_seed(0)
    a, b, frozen = (torch.nn.Parameter(torch.randn(4, 6)) for _ in range(3))
    opt = DeMoSGD([{"params": [a], "lr": 0.1}, {"params": [b, frozen], "lr": 0.01}], beta=0.5, sign=True)
    a0, b0, f0 = a.detach().clone(), b.detach().clone(), frozen.detach().clone()
    a.grad, b.grad = torch.ones(4, 6), -torch.ones(4, 6)
    opt.step()
    assert torch.equal(frozen, f0) and "delta" not in opt.state[frozen]
    torch.testing.assert_close(a, a0 - 0.1)
    torch.testing.assert_close(b, b0 + 0.01)
    frozen.grad = torch.ones(4, 6)  # the set of parameters with grads changes: momenta carried over
    opt.step()
    torch.testing.assert_close(frozen, f0 - 0.01)


def test_periodic_replication_schedule():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = DeMoSGD([p], replicate_every=2, skip_every=3)
    assert [t for t in range(1, 13) if opt.replicates_at(t)] == [2, 4, 8, 10]
    with pytest.raises(ValueError, match="skip_every"):
        DeMoSGD([p], skip_every=1)
    with pytest.raises(ValueError, match="replicate_every"):
        DeMoSGD([p], replicate_every=0)
    with pytest.raises(ValueError, match="replicator must be one of"):
        DeMoSGD([p], replicator="gossip")


@pytest.mark.parametrize("every, skip, message", [
    (0, 0, "replicate_every must be an integer >= 1, got 0"),
    (2.0, 0, "replicate_every must be an integer >= 1, got 2.0"),
    (True, 0, "replicate_every must be an integer >= 1, got True"),
    (1, 1, "skip_every must be 0 (never skip) or an integer >= 2, got 1"),
    (1, -2, "skip_every must be 0 (never skip) or an integer >= 2, got -2"),
    (1, None, "skip_every must be 0 (never skip) or an integer >= 2, got None"),
])
def test_replication_schedule_is_checked_in_one_place(every, skip, message):
    from quietsync.optim import check_replication_schedule

    with pytest.raises(ValueError) as e:
        check_replication_schedule(every, skip)
    assert str(e.value) == message
    with pytest.raises(ValueError) as e:  # the optimizers run the same check
        DecoupledAdamW([torch.nn.Parameter(torch.zeros(3))], replicate_every=every, skip_every=skip)
    assert str(e.value) == message
    check_replication_schedule(3, 0)
    check_replication_schedule(1, 2)


@pytest.mark.parametrize("cls, kwargs, message", [
    (DeMoSGD, {"lr": -1.0}, "lr must be >= 0, got -1.0"),
    (DeMoSGD, {"beta": 1.5}, "beta must be in [0, 1], got 1.5"),
    (DeMoSGD, {"weight_decay": -0.1}, "weight_decay must be >= 0, got -0.1"),
    (DecoupledAdamW, {"weight_decay": float("nan")}, "weight_decay must be >= 0, got nan"),
    (DecoupledAdamW, {"betas": (0.9, 1.0)}, "betas[1] must be in [0, 1), got 1.0"),
    (DecoupledAdamW, {"eps": -1e-8}, "eps must be >= 0, got -1e-08"),
])
def test_bad_hyperparameters_fail_clearly(cls, kwargs, message):
    with pytest.raises(ValueError) as e:
        cls([torch.nn.Parameter(torch.zeros(3))], **kwargs)
    assert str(e.value) == message


def _resume(rank: int, world: int, kind: str, rep: str) -> tuple[torch.Tensor, torch.Tensor]:
    transport = Transport(Topology.from_env())
    kw = {"lr": 0.01, "beta": 0.9, "replicator": rep,
          "replicator_kwargs": {"compression": 1 / 8, "chunk": 4, "transfer_dtype": "bf16"}}
    model = tiny_model()
    opt = _make(kind, model, transport, **kw)

    def run(m, o, steps):
        for s in steps:
            o.zero_grad()
            loss_fn(m, micro_batch(s, rank, 0)).backward()
            o.step()

    run(model, opt, range(3))
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    run(model, opt, range(3, 6))
    straight = flat_params(model)
    model2 = tiny_model(seed=7)
    model2.load_state_dict(saved_model)
    opt2 = _make(kind, model2, transport, **kw)
    opt2.load_state_dict(saved_opt)
    run(model2, opt2, range(3, 6))
    transport.close()
    return straight, flat_params(model2)


@pytest.mark.timeout(120)
# dct / striding+adamw: tests/strategies/decoupled/test_demo.py
@pytest.mark.parametrize("kind,rep", [("sgd", "random")])
def test_resume_is_exact(kind, rep):
    for straight, resumed in run_ranks(_resume, 2, kind, rep):
        assert torch.equal(straight, resumed)


def test_checkpoint_momentum_is_converted_between_domains():
    """A spatial momentum (checkpoints from before momentum domains, or of random/striding/full) loads into a
    dct optimizer as the DCT coefficients of each parameter's blocks, and back, within rounding."""
    from quietsync.wire.replicators import DCTReplicator, Segments

    model = tiny_model()
    spatial = DeMoSGD(model.parameters(), lr=0.1, replicator="full")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    spatial.step()  # a world of one: creates the momenta (then hands them all back, zero)
    gen = torch.Generator().manual_seed(0)
    want = {}
    for i, p in enumerate(model.parameters()):
        spatial.state[p]["delta"].copy_(torch.randn(p.shape, generator=gen))
        want[i] = spatial.state[p]["delta"].clone()
    sd = copy.deepcopy(spatial.state_dict())
    assert sd["decoupled"]["momentum_domain"] == "spatial"

    dct = DeMoSGD(tiny_model().parameters(), lr=0.1, replicator="dct", replicator_kwargs={"chunk": 4})
    dct.load_state_dict(sd)
    rep = DCTReplicator(chunk=4)
    for i, p in enumerate(dct.param_groups[0]["params"]):
        coeffs = dct.state[p]["delta"]
        layout = rep.layout(Segments([p.shape]))
        assert coeffs.shape == (layout.groups[0].num_blocks, *layout.groups[0].block_shape)  # blocks of coefficients
        back = rep.momentum_to_spatial(coeffs.reshape(-1), Segments([p.shape]))
        torch.testing.assert_close(back.view(p.shape), want[i], rtol=1e-5, atol=1e-6)

    dct_sd = copy.deepcopy(dct.state_dict())
    assert dct_sd["decoupled"]["momentum_domain"] == "dct:4"
    again = DeMoSGD(tiny_model().parameters(), lr=0.1, replicator="full")
    again.load_state_dict(dct_sd)
    for i, p in enumerate(again.param_groups[0]["params"]):
        torch.testing.assert_close(again.state[p]["delta"], want[i], rtol=1e-5, atol=1e-6)

    dct_sd["decoupled"]["momentum_domain"] = "fourier"
    with pytest.raises(ValueError, match=r"^momentum domain must be spatial or dct:<chunk>, got 'fourier'$"):
        DeMoSGD(tiny_model().parameters(), lr=0.1, replicator="full").load_state_dict(dct_sd)
