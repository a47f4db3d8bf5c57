"""``fsdp`` (FSDP2 HSDP through the transport) ≡ ``zero1`` ≡ ``ddp`` ≡ one process on the concatenated batch;
parameters are really sharded inside the node and every byte is metered on its group."""

from __future__ import annotations

import pytest
import torch

import quietsync
from tests.distributed import run_ranks
from tests.strategies.helpers.common import flat_params, loss_fn, micro_batch, param_groups, reference_run, tiny_model

OPT = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}


def _train(rank: int, world: int, name: str, accumulation: int, steps: int):
    model = tiny_model()
    strategy = quietsync.make_strategy(name, model, torch.optim.AdamW, param_groups=param_groups(model),
                                       config={"accumulation": accumulation}, **OPT)
    for s in range(steps):
        for a in range(accumulation):
            strategy.backward(loss_fn(strategy.model, micro_batch(s, rank, a)))
            assert strategy.step() == (a == accumulation - 1)
    local = sum(t.numel() for t in strategy.shards.local) if name == "fsdp" else None
    metrics = strategy.last_step_metrics()
    with strategy.committed_params() as model:
        out = flat_params(model)
    strategy.close()
    return out, local, metrics


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("world", "nodes"), [(4, 2), (4, 1), (2, 2)])
def test_fsdp_equals_one_process_and_zero1(world, nodes):
    steps, accumulation = 4, 2
    reference = reference_run(world, accumulation, steps, **OPT)
    for params, _, _ in run_ranks(_train, world, "fsdp", accumulation, steps, nodes=nodes):
        torch.testing.assert_close(params, reference, rtol=1e-5, atol=1e-6)
    zero1 = run_ranks(_train, world, "zero1", accumulation, steps, nodes=nodes)[0][0]
    torch.testing.assert_close(zero1, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_fsdp_shards_parameters_inside_the_node_and_meters_both_groups():
    results = run_ranks(_train, 4, "fsdp", 1, 2, nodes=2)
    # rows of (13,7),(13,),(5,13),(5,) split in 2 by dim 0: 7 and 6 rows, 3 and 2 rows
    assert [r[1] for r in results] == [7 * 7 + 7 + 3 * 13 + 3, 6 * 7 + 6 + 2 * 13 + 2] * 2
    padded = 2 * (7 * 7 + 7 + 3 * 13 + 3)  # FSDP pads every parameter to ceil(rows / 2) rows per worker
    for _, local, m in results:
        by = m.bytes_by_group
        # one unit: all-gather in forward and in backward, one reduce-scatter; (n-1)/n of the padded buffer
        assert by["shard"]["sent"] == (2 * padded * 4) // 2 + (padded * 4) // 2
        # one all-reduce of this worker's gradient shard across 2 nodes: 2(n-1)/n of its bytes
        assert by["replicate"]["sent"] == local * 4


def test_world_of_one_needs_no_launcher():
    out, _, _ = _train(0, 1, "fsdp", 2, 3)
    torch.testing.assert_close(out, reference_run(1, 2, 3, **OPT), rtol=1e-5, atol=1e-6)


def _train_cuda(rank: int, world: int, name: str, config: dict, steps: int):
    torch.cuda.set_device(rank)
    model = tiny_model().cuda()
    strategy = quietsync.make_strategy(name, model, torch.optim.AdamW, param_groups=param_groups(model),
                                       config=config, **OPT)
    assert strategy.transport.backend == "nccl"
    for s in range(steps):
        x, y = micro_batch(s, rank, 0)
        strategy.backward(loss_fn(strategy.model, (x.cuda(), y.cuda())))
        strategy.step()
    with strategy.committed_params() as model:
        out = flat_params(model).cpu()
    strategy.close()
    return out


@pytest.mark.gpu
@pytest.mark.timeout(240)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL: one per worker)")
@pytest.mark.parametrize(("name", "config"), [("fsdp", {}), ("flexdemo", {"base": "adamw", "sign": False,
                                                                           "replicator": "full", "beta": 0.0})])
def test_fsdp2_on_nccl_equals_one_process(name, config):
    """FSDP2 with the transport's collectives on NCCL (one node of 2 GPUs): AdamW on the global mean."""
    reference = reference_run(2, 1, 3, **OPT)
    for params in run_ranks(_train_cuda, 2, name, config, 3, nodes=1):
        torch.testing.assert_close(params, reference, rtol=1e-4, atol=1e-5)
