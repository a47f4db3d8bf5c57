"""``flexdemo``: the degenerate cases (one node = sharded training, one worker per node = demo),
2 nodes x 2 workers bytes by group, identical replicas, exact resume."""

from __future__ import annotations

import copy

import pytest
import torch

import quietsync
from quietsync.strategies.decoupled.flexdemo import DimZeroShards
from quietsync.wire.replicators import Segments, make_replicator
from tests.distributed import run_ranks
from tests.strategies.helpers.common import flat_params, loss_fn, micro_batch, param_groups, reference_run, tiny_model

ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}


class _FirstFive(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :5]


def even_model() -> torch.nn.Module:
    """Like ``tiny_model`` but every dim 0 divides by 2 and 4, so FSDP2's shards need no padding."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 12), torch.nn.Tanh(), torch.nn.Linear(12, 8), _FirstFive())


def _train(rank: int, world: int, name: str, config: dict, steps: int, opt: dict, make_model=tiny_model):
    model = make_model()
    strategy = quietsync.make_strategy(name, model, torch.optim.AdamW, param_groups=param_groups(model),
                                       config=config, **opt)
    acc = strategy.config.accumulation
    metrics = []
    for s in range(steps):
        for a in range(acc):
            strategy.backward(loss_fn(strategy.model, micro_batch(s, rank, a)))
            strategy.step()
        metrics.append(strategy.last_step_metrics())
    with strategy.committed_params() as m:
        out = flat_params(m)
    mem = strategy.memory_report() if name == "flexdemo" else None
    strategy.close()
    return out, metrics, mem


def test_dim_zero_shards_pack_and_unpack_round_trip():
    ts = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, 2), torch.randn(())]
    sh = DimZeroShards([t.shape for t in ts], 3)
    assert sh.shard_shapes == [(2, 3), (3,), (1, 2, 2), (1,)]
    buf = sh.pack(ts, torch.float32)
    assert buf.numel() == 3 * (6 + 3 + 4 + 1)
    # shard 1 of the (5, 3) matrix is its rows 2..3
    torch.testing.assert_close(buf.view(3, -1)[1, :6].view(2, 3), ts[0][2:4])
    outs = [torch.empty_like(t) for t in ts]
    sh.unpack_into(buf, outs)
    for a, b in zip(ts, outs):
        assert torch.equal(a, b)


@pytest.mark.timeout(120)
def test_one_node_is_sharded_training_with_the_base_optimizer():
    cfg = {"base": "adamw", "sign": False, "replicator": "dct", "accumulation": 2, "params": "replicated"}
    results = run_ranks(_train, 2, "flexdemo", cfg, 4, ADAMW, nodes=1)
    want = reference_run(2, 2, 4, **ADAMW)
    for params, metrics, mem in results:
        torch.testing.assert_close(params, want, rtol=1e-5, atol=1e-6)
        sent = {g: v["sent"] for g, v in metrics[-1].bytes_by_group.items() if v["sent"]}
        assert set(sent) == {"shard"}  # nothing crosses nodes: there is one
        # state is sharded: rows of (13,7),(13,),(5,13),(5,) split in 2 -> 7*7 + 7 + 3*13 + 3 = 98 of 174
        assert mem["master_shard"] == 98 * 4
        assert mem["optimizer_state"] == 3 * 98 * 4  # momentum, exp_avg, exp_avg_sq of the shard only


@pytest.mark.timeout(120)
def test_one_worker_per_node_is_demo():
    cfg = {"replicator": "dct", "compression": 1 / 8, "chunk": 4, "accumulation": 2}
    flex = run_ranks(_train, 2, "flexdemo", cfg, 3, {"lr": 1e-2}, nodes=2)
    demo = run_ranks(_train, 2, "demo", cfg, 3, {"lr": 1e-2}, nodes=2)
    for (a, ma, _), (b, mb, _) in zip(flex, demo):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert ma[-1].bytes_by_group["replicate"] == mb[-1].bytes_by_group["world"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rep", ["dct", "random"])
def test_two_nodes_two_workers_bytes_by_group(rep):
    cfg = {"replicator": rep, "compression": 1 / 8, "chunk": 4, "params": "replicated"}
    results = run_ranks(_train, 4, "flexdemo", cfg, 2, {"lr": 1e-2}, nodes=2)
    model = tiny_model()
    shards = DimZeroShards([p.shape for p in model.parameters()], 2)
    s_bytes = shards.width * 4  # one worker's fp32 shard
    # reduce-scatter of 2 shards + all-gather of 2 shards inside the node: (n-1)/n of 2*S each
    intra = (2 * s_bytes) // 2 + (2 * s_bytes) // 2
    payload = make_replicator(rep, compression=1 / 8, chunk=4).payload_bytes(Segments(shards.shard_shapes))
    inter = payload if rep == "dct" else 2 * payload // 2  # 2 nodes: all-gather (n-1)B, all-reduce 2(n-1)/n B
    first = results[0][0]
    for params, metrics, _ in results:
        torch.testing.assert_close(params, first, rtol=0, atol=0)  # every worker holds the same model
        m = metrics[-1]
        assert m.bytes_by_group["shard"]["sent"] == intra
        assert m.bytes_by_group["replicate"]["sent"] == inter
    assert inter < intra / 4  # only the compressed shard crosses nodes


def _resume(rank: int, world: int, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    def make(seed=0):
        model = tiny_model(seed)
        return quietsync.make_strategy("flexdemo", model, torch.optim.AdamW, param_groups=param_groups(model),
                                       config=cfg, lr=1e-2)

    def run(st, lo, hi):
        for s in range(lo, hi):
            st.backward(loss_fn(st.model, micro_batch(s, rank, 0)))
            st.step()

    a = make()
    run(a, 0, 3)
    saved = copy.deepcopy(a.state_dict())
    run(a, 3, 6)
    b = make(seed=3)
    b.load_state_dict(saved)
    run(b, 3, 6)
    out = []
    for st in (a, b):
        with st.committed_params() as m:
            out.append(flat_params(m))
    a.close(), b.close()
    return out


@pytest.mark.timeout(120)
def test_resume_is_exact_two_by_two():
    cfg = {"replicator": "random", "compression": 1 / 4, "base": "adamw", "transfer_dtype": "bf16"}
    for straight, resumed in run_ranks(_resume, 4, cfg, nodes=2):
        assert torch.equal(straight, resumed)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("params", ["replicated", "sharded"])
def test_full_replicator_two_by_two_is_hybrid_sharded_adamw(params):
    """The benchmarks' HSDP baseline: full + decoupled AdamW + beta 0 + no sign == AdamW on the global mean."""
    cfg = {"base": "adamw", "sign": False, "beta": 0.0, "replicator": "full", "params": params}
    results = run_ranks(_train, 4, "flexdemo", cfg, 3, ADAMW, nodes=2)
    want = reference_run(4, 1, 3, **ADAMW)
    # 2 nodes: 2(n-1)/n of the fp32 shard; rows split 7|6, 7|6, 3|2, 3|2 (replicated pads shard 1 to 7, 3 rows)
    shard = [98, 98] if params == "replicated" else [98, 6 * 7 + 6 + 2 * 13 + 2]
    for rank, (params_, metrics, _) in enumerate(results):
        torch.testing.assert_close(params_, want, rtol=1e-5, atol=1e-6)
        assert metrics[-1].bytes_by_group["replicate"]["sent"] == shard[rank % 2] * 4


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("cfg", "nodes"), [
    ({"replicator": "dct", "compression": 1 / 8, "chunk": 4, "accumulation": 2}, 2),
    ({"replicator": "dct", "compression": 1 / 4, "chunk": 4, "base": "adamw"}, 2),
    ({"replicator": "full", "base": "adamw", "sign": False, "accumulation": 2}, 1),
])
def test_fsdp2_sharded_parameters_follow_the_flat_substrate(cfg, nodes):
    """The same decoupled optimizer on the same dim-0 shard: FSDP2 (parameters sharded) == flat (replicated).

    On a model whose rows split evenly: where they do not, the last worker's FSDP2 shard is shorter than the
    flat substrate's padded one, and the DCT replicator's blocks of the two differ (both are valid FlexDeMo)."""
    sharded = run_ranks(_train, 4, "flexdemo", {**cfg, "params": "sharded"}, 3, ADAMW, even_model, nodes=nodes)
    flat = run_ranks(_train, 4, "flexdemo", {**cfg, "params": "replicated"}, 3, ADAMW, even_model, nodes=nodes)
    for (a, ma, _), (b, mb, _) in zip(sharded, flat):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        if nodes == 2:  # the dct payload depends on the blocks, which the shard's padding does not change
            assert ma[-1].bytes_by_group["replicate"] == mb[-1].bytes_by_group["replicate"]


def _layout(rank: int, world: int) -> dict:
    model = tiny_model()
    strategy = quietsync.make_strategy("flexdemo", model, torch.optim.AdamW, config={"chunk": 4}, lr=1e-2)
    strategy.backward(loss_fn(strategy.model, micro_batch(0, rank, 0)))
    strategy.step()
    out = {"local": [tuple(t.shape) for t in strategy.shards.local],
           "module": [type(p).__name__ for p in strategy.module.parameters()],
           "bytes": strategy.last_step_metrics().bytes_by_group}
    strategy.close()
    return out


@pytest.mark.timeout(120)
def test_default_flexdemo_shards_parameters_inside_the_node():
    results = run_ranks(_layout, 4, nodes=2)
    for rank, r in enumerate(results):
        rows = [(7, 6), (7, 6), (3, 2), (3, 2)]
        assert r["local"] == [(rows[0][rank % 2], 7), (rows[1][rank % 2],), (rows[2][rank % 2], 13),
                              (rows[3][rank % 2],)]
        assert set(r["module"]) == {"DTensor"}  # the model holds shards only
        padded = 2 * (7 * 7 + 7 + 3 * 13 + 3)  # FSDP's padded unit: ceil(rows / 2) rows per worker
        # forward all-gather + backward all-gather + reduce-scatter inside the node, (n-1)/n each
        assert r["bytes"]["shard"]["sent"] == (padded * 4) // 2 * 3
        assert 0 < r["bytes"]["replicate"]["sent"] < padded * 4 / 8
