"""``demo`` strategy: oracles against plain torch, identical replicas, metered bytes, resume, bad knobs."""

from __future__ import annotations

import copy

import pytest
import torch

import quietsync
from quietsync.strategies.decoupled.demo import DecoupledConfig
from quietsync.wire.replicators import Segments, make_replicator
from tests.distributed import run_ranks
from tests.strategies.helpers.common import flat_params, loss_fn, micro_batch, param_groups, reference_run, tiny_model


def _train(rank: int, world: int, name: str, config: dict, steps: int, opt: dict, optimizer=torch.optim.AdamW):
    model = tiny_model()
    strategy = quietsync.make_strategy(name, model, optimizer, param_groups=param_groups(model),
                                       config=config, **opt)
    acc = strategy.config.accumulation
    metrics = []
    for s in range(steps):
        for a in range(acc):
            strategy.backward(loss_fn(strategy.model, micro_batch(s, rank, a)))
            assert strategy.step() == (a == acc - 1)
        metrics.append(strategy.last_step_metrics())
    out = flat_params(strategy.module)
    strategy.close()
    return out, metrics


@pytest.mark.timeout(120)
@pytest.mark.parametrize("base", ["sgd", "adamw"])
def test_full_no_decay_no_sign_is_plain_data_parallel(base):
    cfg = {"replicator": "full", "beta": 0.0, "sign": False, "accumulation": 2, "base": base}
    opt = ({"lr": 0.05, "weight_decay": 0.1} if base == "sgd"
           else {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1})
    results = run_ranks(_train, 2, "demo", cfg, 4, opt)
    if base == "sgd":
        want = reference_run(2, 2, 4, optimizer="sgd", **opt)
    else:
        want = reference_run(2, 2, 4, **opt)
    for params, _ in results:
        torch.testing.assert_close(params, want, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rep", ["dct", "random"])
def test_replicas_stay_identical_and_bytes_match_hand_computation(rep):
    world = 3
    cfg = {"replicator": rep, "compression": 1 / 8, "chunk": 4, "transfer_dtype": "bf16"}
    results = run_ranks(_train, world, "demo", cfg, 3, {"lr": 1e-2})
    first = results[0][0]
    model = tiny_model()
    assert not torch.equal(first, flat_params(model))  # it trained
    seg = Segments([p.shape for p in model.parameters()])
    payload = make_replicator(rep, compression=1 / 8, chunk=4, transfer_dtype="bf16").payload_bytes(seg)
    if rep == "dct":  # all-gather: receive (n-1) payloads
        want = (world - 1) * payload
    else:  # all-reduce of values only: 2(n-1)/n of the payload
        want = 2 * (world - 1) * payload // world
        assert payload == (174 * 4 // 8 // 2) * 2  # 174 params, 1/8 of 696 bytes in bf16 values
    for params, metrics in results:
        torch.testing.assert_close(params, first, rtol=0, atol=0)
        for m in metrics:
            assert m.bytes_by_group == {"world": {"sent": want, "recv": want}}


def _resume(rank: int, world: int, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    def make(seed=0):
        model = tiny_model(seed)
        return quietsync.make_strategy("demo", model, torch.optim.AdamW, param_groups=param_groups(model),
                                       config=cfg, lr=1e-2, lr_schedule=lambda s: 1.0 / (1 + s))

    def run(st, lo, hi, half=False):
        for s in range(lo, hi):
            st.backward(loss_fn(st.model, micro_batch(s, rank, 0)))
            st.step()
            if half and s == hi - 1:
                break
            st.backward(loss_fn(st.model, micro_batch(s, rank, 1)))
            st.step()

    a = make()
    run(a, 0, 3)
    a.backward(loss_fn(a.model, micro_batch(3, rank, 0)))  # save in the middle of an accumulation
    a.step()
    saved = copy.deepcopy(a.state_dict())
    a.backward(loss_fn(a.model, micro_batch(3, rank, 1)))
    a.step()
    run(a, 4, 6)
    b = make(seed=5)
    b.load_state_dict(saved)
    b.backward(loss_fn(b.model, micro_batch(3, rank, 1)))
    b.step()
    run(b, 4, 6)
    assert a.steps == b.steps == 6
    out = flat_params(a.module), flat_params(b.module)
    a.close(), b.close()
    return out


@pytest.mark.timeout(120)
# random: tests/optim and tests/strategies/decoupled/test_flexdemo.py
@pytest.mark.parametrize("rep", ["dct", "striding"])
def test_resume_is_exact(rep):
    cfg = {"replicator": rep, "accumulation": 2, "compression": 1 / 4, "chunk": 4,
           "base": "adamw" if rep == "striding" else "sgd"}
    for straight, resumed in run_ranks(_resume, 2, cfg):
        assert torch.equal(straight, resumed)


def test_world_of_one_needs_no_launcher_and_is_sign_sgd():
    out, metrics = _train(0, 1, "demo", {"beta": 0.5}, 3, {"lr": 1e-2, "weight_decay": 0.0})
    model = tiny_model()
    for s in range(3):
        model.zero_grad()
        loss_fn(model, micro_batch(s, 0, 0)).backward()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("weight"):  # the weights' group has decoupled weight decay 0.1
                    p *= 1 - 1e-2 * 0.1
                p -= 1e-2 * p.grad.sign()
    torch.testing.assert_close(out, flat_params(model))
    assert metrics[-1].bytes_sent == 0


@pytest.mark.parametrize(
    "bad,match",
    [({"topk": 17, "chunk": 4}, "topk must be"), ({"compression": 0.0}, "compression must be in"),
     ({"compression": 1.5}, "compression must be in"), ({"replicator": "gossip"}, "replicator must be one of"),
     ({"transfer_dtype": "int8"}, "transfer_dtype must be one of"), ({"chunk": 0}, "chunk must be"),
     ({"beta": 1.5}, "beta must be"), ({"skip_every": 1}, "skip_every must be"),
     ({"base": "lion"}, "base must be one of")],
)
def test_bad_knobs_fail_with_one_line(bad, match):
    with pytest.raises(ValueError, match=match) as info:
        DecoupledConfig(**bad)
    assert "\n" not in str(info.value)


def test_cli_flags_exist_for_the_knobs():
    from quietsync.cli.flags import flag_name

    names = {flag_name(f) for f in DecoupledConfig.__dataclass_fields__}
    assert {"--replicator", "--compression", "--chunk", "--topk", "--sign", "--transfer-dtype"} <= names


def test_base_optimizer_choice_and_unknown_arguments():
    from quietsync.optim import DecoupledAdamW, DeMoSGD

    def make(optimizer, base, **kw):
        model = tiny_model()
        return quietsync.make_strategy("demo", model, optimizer, config={"base": base}, lr=1e-2, **kw)

    assert isinstance(make(torch.optim.AdamW, "sgd", betas=(0.9, 0.95)).optimizer, DeMoSGD)  # betas dropped
    assert isinstance(make(torch.optim.AdamW, "auto").optimizer, DecoupledAdamW)
    assert isinstance(make(torch.optim.SGD, "auto").optimizer, DeMoSGD)
    assert make(torch.optim.AdamW, "adamw", betas=(0.8, 0.9)).optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    with pytest.raises(ValueError, match="not understood"):
        make(torch.optim.AdamW, "sgd", lookahead=3)


@pytest.mark.timeout(120)
def test_periodic_replication_sends_only_on_replicating_steps():
    cfg = {"replicator": "random", "compression": 1 / 4, "replicate_every": 2}
    results = run_ranks(_train, 2, "demo", cfg, 4, {"lr": 1e-2})
    for _, metrics in results:
        assert [m.extra["replicated"] for m in metrics] == [False, True, False, True]
        assert [m.bytes_by_group["world"]["sent"] > 0 for m in metrics] == [False, True, False, True]
    # local steps use each worker's own gradient: the replicas differ
    assert not torch.equal(results[0][0], results[1][0])
