"""ZeRO-1 ≡ DDP ≡ one process on the concatenated batch; ours ≡ PyTorch's DDP + ZeroRedundancyOptimizer."""

from __future__ import annotations

import pytest
import torch

import quietsync
from tests.distributed import run_ranks
from tests.strategies.helpers.common import flat_params, loss_fn, micro_batch, param_groups, reference_run, tiny_model

OPT = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}


def _train(rank: int, world: int, name: str, accumulation: int, steps: int) -> torch.Tensor:
    model = tiny_model()
    strategy = quietsync.make_strategy(name, model, torch.optim.AdamW, param_groups=param_groups(model),
                                       config={"accumulation": accumulation}, **OPT)
    committed = 0
    for s in range(steps):
        for a in range(accumulation):
            strategy.backward(loss_fn(strategy.model, micro_batch(s, rank, a)))
            did = strategy.step()
            assert did == (a == accumulation - 1)
            committed += did
    assert strategy.steps == committed == steps
    m = strategy.last_step_metrics()
    assert m.micro_batches == accumulation and m.step == steps
    out = flat_params(strategy.module)
    strategy.close()
    return out


def _torch_ddp_zero(rank: int, world: int, accumulation: int, steps: int) -> torch.Tensor:
    """PyTorch's own DDP + ZeroRedundancyOptimizer, written in the plainest way (the oracle)."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    model = tiny_model()
    ddp = DistributedDataParallel(model)
    groups = param_groups(model)
    opt = ZeroRedundancyOptimizer(groups[0]["params"], torch.optim.AdamW, lr=OPT["lr"], betas=OPT["betas"],
                                  weight_decay=0.1)
    opt.add_param_group(groups[1])
    for s in range(steps):
        for a in range(accumulation):
            if a < accumulation - 1:
                with ddp.no_sync():
                    (loss_fn(ddp, micro_batch(s, rank, a)) / accumulation).backward()
            else:
                (loss_fn(ddp, micro_batch(s, rank, a)) / accumulation).backward()
        opt.step()
        opt.zero_grad()
    return flat_params(model)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 4])
def test_zero1_equals_ddp_equals_one_process(world):
    steps, accumulation = 5, 2
    reference = reference_run(world, accumulation, steps, **OPT)
    for name in ("zero1", "ddp"):
        results = run_ranks(_train, world, name, accumulation, steps)
        for r, params in enumerate(results):
            torch.testing.assert_close(params, reference, rtol=1e-5, atol=1e-6, msg=f"{name} rank {r}")


@pytest.mark.timeout(180)
def test_zero1_equals_pytorch_ddp_with_zero_redundancy_optimizer():
    ours = run_ranks(_train, 2, "zero1", 2, 4)
    theirs = run_ranks(_torch_ddp_zero, 2, 2, 4)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_world_of_one_needs_no_launcher():
    reference = reference_run(1, 3, 3, **OPT)
    out = _train(0, 1, "zero1", 3, 3)
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-7)


def _resume(rank: int, world: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    accumulation = 2

    def run(strategy, steps, start=0, stop_mid_round=False):
        for s in range(start, steps):
            for a in range(accumulation):
                strategy.backward(loss_fn(strategy.model, micro_batch(s, rank, a)))
                strategy.step()
                if stop_mid_round and s == steps - 1 and a == 0:
                    return

    def make():
        model = tiny_model()
        return quietsync.make_strategy(name, model, torch.optim.AdamW, param_groups=param_groups(model),
                                       config={"accumulation": accumulation}, **OPT)

    straight = make()
    run(straight, 6)
    expected = flat_params(straight.module)
    straight.close()

    first = make()
    run(first, 4, stop_mid_round=True)  # stop in the middle of step 3's accumulation
    state = first.state_dict()
    first.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.steps == 3
    for a in range(1, accumulation):  # finish the interrupted round
        resumed.backward(loss_fn(resumed.model, micro_batch(3, rank, a)))
        assert resumed.step()
    run(resumed, 6, start=4)
    got = flat_params(resumed.module)
    resumed.close()
    return expected, got


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["zero1", "ddp"])
def test_resume_from_state_dict_continues_exactly(name):
    for expected, got in run_ranks(_resume, 2, name):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_bad_arguments_fail_at_construction():
    model = tiny_model()
    with pytest.raises(ValueError, match="accumulation must be an integer >= 1"):
        quietsync.make_strategy("zero1", model, config={"accumulation": 0})
    with pytest.raises(ValueError, match="reduce_dtype must be one of"):
        quietsync.make_strategy("zero1", tiny_model(), config={"reduce_dtype": "int8"})
    with pytest.raises(ValueError, match="strategy must be one of"):
        quietsync.make_strategy("zero2", tiny_model())
    with pytest.raises(ValueError, match="could not build optimizer AdamW"):
        quietsync.make_strategy("zero1", tiny_model(), torch.optim.AdamW, lr=1e-3, nonsense=1)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        quietsync.make_strategy("ddp", "not a model")
    with pytest.raises(ValueError, match="not a parameter of model"):
        quietsync.make_strategy("zero1", tiny_model(), param_groups=[{"params": [torch.nn.Parameter(torch.ones(2))]}])


def test_replacing_owned_gradients_is_an_error():
    model = tiny_model()
    strategy = quietsync.make_strategy("zero1", model, torch.optim.SGD, lr=0.1)
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="the strategy owns the gradients"):
        strategy.backward(loss_fn(strategy.model, micro_batch(0, 0, 0)))


def test_memory_report_counts_every_buffer():
    model = tiny_model()
    strategy = quietsync.make_strategy("zero1", model, torch.optim.AdamW, lr=1e-3)
    strategy.backward(loss_fn(strategy.model, micro_batch(0, 0, 0)))
    strategy.step()
    report = strategy.memory_report()
    psi = strategy.flat.padded_numel * 4
    # world of one: the shard is everything; AdamW keeps two moments (+ a scalar step per group)
    assert report["params"] == report["grads"] == report["master_shard"] == report["grad_shard"] == psi
    assert 2 * psi <= report["optimizer_state"] <= 2 * psi + 64


def test_time_between_calls_counts_as_compute():
    import time

    model = tiny_model()
    strategy = quietsync.make_strategy("zero1", model, torch.optim.SGD, lr=0.1)
    strategy.backward(loss_fn(strategy.model, micro_batch(0, 0, 0)))
    time.sleep(0.2)  # e.g. a simulated slow worker sleeping after its micro-batch
    assert strategy.step()
    assert strategy.last_step_metrics().compute_s >= 0.2


def test_paused_time_is_not_compute():
    import time

    model = tiny_model()
    strategy = quietsync.make_strategy("zero1", model, torch.optim.SGD, lr=0.1)
    strategy.backward(loss_fn(strategy.model, micro_batch(0, 0, 0)))
    with strategy.paused():
        time.sleep(0.3)  # e.g. evaluation or a checkpoint between micro-batches
    assert strategy.step()
    assert strategy.last_step_metrics().compute_s < 0.3
