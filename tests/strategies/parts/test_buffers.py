"""Module buffers across replicas: persistent buffers start equal (rank 0's), running statistics (BatchNorm) stay
equal — averaged at every committed step, at every sync for the local methods, torch DDP's rule for ddp — and
cdp refuses a model that has them, naming the buffer."""

from __future__ import annotations

import pytest
import torch

import quietsync
from tests.distributed import run_ranks
from tests.strategies.helpers.common import loss_fn, micro_batch

SGD = {"lr": 0.1}


def bn_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.BatchNorm1d(13), torch.nn.Tanh(),
                               torch.nn.Linear(13, 5))


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.named_buffers()}


def _train(rank: int, world: int, cases: list[tuple[str, dict]], steps: int) -> dict:
    out = {}
    for name, config in cases:
        model = bn_model()
        model[1].running_mean.fill_(float(rank))  # a rank-dependent start: the broadcast must even it out
        s = quietsync.make_strategy(name, model, torch.optim.SGD, config=config, **SGD)
        start = _buffers(model)
        per_step = []
        index = 0
        while s.steps + s.steps_in_flight < steps:
            s.forward_backward(micro_batch(0, rank, index, size=8), loss_fn)
            index += 1
            if s.step():
                per_step.append(_buffers(model))
        s.finish()
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out[name] = {"start": start, "per_step": per_step, "end": _buffers(model), "params": params}
        s.close()
    return out


def _reference(world: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """Data parallelism in one process, written from the rule: each replica normalises its own batch (BatchNorm
    per worker), the gradient is the mean over replicas, and after each step the running statistics are the
    replicas' mean."""
    models = [bn_model() for _ in range(world)]
    for m in models:
        m[1].running_mean.zero_()  # rank 0's start, broadcast to all
    opt = torch.optim.SGD(models[0].parameters(), **SGD)
    out = []
    for s in range(steps):
        for m in models[1:]:
            m.load_state_dict(models[0].state_dict())
        grads = None
        for r, m in enumerate(models):
            m.zero_grad()
            loss_fn(m, micro_batch(0, r, s, size=8)).backward()
            g = [p.grad / world for p in m.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(models[0].parameters(), grads):
            p.grad = g
        opt.step()
        with torch.no_grad():
            for name, t in models[0].named_buffers():
                mean = torch.stack([dict(m.named_buffers())[name].double() for m in models]).mean(0)
                t.copy_(mean.round() if not t.is_floating_point() else mean)
        out.append(_buffers(models[0]))
    return out


@pytest.mark.timeout(240)
def test_running_statistics_stay_equal_across_replicas_in_every_strategy_that_can():
    steps = 3
    cases = [("zero1", {}), ("ddp", {}), ("fsdp", {}), ("demo", {}), ("flexdemo", {}),
             ("acco", {"deterministic_accumulation": 1}), ("dpu", {"deterministic_accumulation": 1}),
             ("wp", {"deterministic_accumulation": 1}), ("localsgd", {"sync_every": 2}), ("diloco", {"sync_every": 2})]
    out = run_ranks(_train, 2, cases, steps, timeout=230)
    for name, _ in cases:
        a, b = out[0][name], out[1][name]
        assert torch.equal(a["start"]["1.running_mean"], torch.zeros(13)), name  # rank 0's, broadcast
        for key in a["end"]:
            assert torch.equal(a["end"][key], b["end"][key]), (name, key)  # equal replicas after finish
        # averaged at every commit: equal after each (ddp: at each forward)
        if name not in ("localsgd", "diloco", "ddp"):
            for sa, sb in zip(a["per_step"], b["per_step"]):
                assert all(torch.equal(sa[k], sb[k]) for k in sa), name
        assert int(a["end"]["1.num_batches_tracked"]) >= steps, name
    # zero1: the running statistics and parameters of data parallelism with per-replica BatchNorm whose running
    # statistics are the replicas' mean after every step
    ref = _reference(2, steps)
    for t in range(steps):
        for key, want in ref[t].items():
            torch.testing.assert_close(out[0]["zero1"]["per_step"][t][key], want, rtol=1e-5, atol=1e-6)
    # ddp keeps torch DDP's rule (rank 0's buffers before every forward), so its statistics are rank 0's alone
    assert not torch.allclose(out[0]["ddp"]["end"]["1.running_var"], out[0]["zero1"]["end"]["1.running_var"])


def test_cdp_refuses_a_model_with_running_statistics_naming_the_buffer():
    with pytest.raises(ValueError, match="strategy cdp cannot keep the module buffer '1.running_mean'"):
        quietsync.make_strategy("cdp", bn_model(), torch.optim.SGD, **SGD)
    model = bn_model()
    model[1].track_running_stats = False
    model[1].running_mean = model[1].running_var = model[1].num_batches_tracked = None
    quietsync.make_strategy("cdp", model, torch.optim.SGD, **SGD).close()  # batch statistics only: accepted
