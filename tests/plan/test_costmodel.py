"""The cost model's pieces against hand computations: bytes per worker per collective, alpha-beta link times,
the overlap terms, the least-squares link fit, and a described transformer against the one transformers builds."""

from __future__ import annotations

import math

import pytest

from quietsync.cost.compute import ComputeProfile
from quietsync.cost.costmodel import Comm, Ctx, Links, chunk_rows
from quietsync.cost.terms import Adaptive, Buckets, Every, Exposed, Hidden, MicroBatches, Seq, Wire
from quietsync.link import LinkModel
from quietsync.plan.fit import Sample, fit_link
from quietsync.topology import Topology


def _ctx(links: Links | None = None, world: int = 4, nodes: int = 2, rank: int = 0, scale=(), fwd=0.1, bwd=0.2):
    compute = ComputeProfile(forward_s=fwd, backward_s=bwd, optimizer_s_per_element=0.0, elements=1,
                             worker_scale=tuple(scale))
    return Ctx(compute, links or Links(), Topology(rank, world, nodes))


def test_bytes_per_worker_are_the_ring_algorithms_by_hand():
    topo = Topology(1, 4, 2)  # rank 1: node 0; world spans nodes, shard does not, replicate does
    assert Comm("all_reduce", "world", 1000).bytes(topo) == (1500, 1500)  # 2·3/4·1000
    assert Comm("reduce_scatter", "world", 1000).bytes(topo) == (750, 750)  # 3/4
    assert Comm("all_gather", "shard", 1000).bytes(topo) == (500, 500)  # 1/2 over the 2 of the node
    assert Comm("send", "world", 64, peer=3).bytes(topo) == (64, 0)
    assert Comm("recv", "world", 64, peer=0).bytes(topo) == (0, 64)
    assert Comm("exchange", "world", 64, peer=2).bytes(topo) == (64, 64)
    # chain broadcast from group rank 0: every worker but the last forwards, every worker but the root receives
    assert [Comm("broadcast", "world", 10).bytes(Topology(r, 4, 2)) for r in range(4)] == [
        (10, 0), (10, 10), (10, 10), (0, 10)]
    assert Comm("all_reduce", "world", 1000).link(topo) == "inter"
    assert Comm("all_gather", "shard", 1000).link(topo) == "intra"
    assert Comm("send", "world", 1, peer=0).link(topo) == "intra"
    assert Comm("send", "world", 1, peer=2).link(topo) == "inter"


def test_links_are_alpha_beta_and_a_floor_only_ever_slows_a_transfer():
    inter = LinkModel(1e6, 0.01)  # 1 MB/s, 10 ms
    topo = Topology(0, 4, 4)
    c = Comm("all_reduce", "world", 4000)
    assert Links({"inter": inter}).seconds("inter", c, topo) == pytest.approx(6 * 0.01 + 6000 / 1e6)
    fast = Links({"inter": inter}, {"inter": LinkModel(1e9, 0.0)})
    assert fast.seconds("inter", c, topo) == pytest.approx(6 * 0.01 + 6000 / 1e6)
    slow = Links({"inter": inter}, {"inter": LinkModel(1e4, 0.0)})
    assert slow.seconds("inter", c, topo) == pytest.approx(6000 / 1e4)
    assert Links().seconds("inter", c, topo) == 0.0  # no link modeled: free
    assert Links({"inter": inter}).seconds("inter", Comm("send", "world", 500, peer=1), topo) == pytest.approx(
        0.01 + 500 / 1e6)


def test_terms_compose_as_the_overlap_rules_say():
    links = Links({"inter": LinkModel(1e3, 0.0)})
    ctx = _ctx(links)
    wire = Wire([Comm("all_reduce", "replicate", 1000)])  # 2 nodes: 1000 B each way, 1 s
    assert wire.cost(ctx).time == pytest.approx(1.0)
    two = Seq(MicroBatches(2), wire)
    assert (two.cost(ctx).time, two.cost(ctx).compute) == pytest.approx((1.6, 0.6))
    hidden = Hidden(MicroBatches(2), wire)
    assert (hidden.cost(ctx).time, hidden.cost(ctx).exposed_comm) == pytest.approx((1.0, 0.4))
    assert Hidden(MicroBatches(5), wire).cost(ctx).exposed_comm == pytest.approx(0.0)
    assert Exposed(wire, MicroBatches(2)).cost(ctx).time == pytest.approx(0.4)
    assert Every(Seq(MicroBatches(1), wire), 4).cost(ctx).time == pytest.approx(1.3 / 4)
    assert MicroBatches(3).cost(ctx).global_micro_batches == 12


def test_ddp_buckets_start_as_the_backward_frees_them_one_at_a_time():
    links = Links({"inter": LinkModel(1e3, 0.0)})
    ctx = _ctx(links, fwd=0.5, bwd=1.0)
    b = lambda nbytes: Comm("all_reduce", "replicate", nbytes)  # noqa: E731 - 2 nodes: nbytes/1e3 s each
    # buckets ready at 50% and 100% of the backward, 0.3 s each: 0.5 → 0.8, then max(0.8, 1.0) → 1.3
    cost = Buckets((0.5, 1.0), (b(300), b(300))).cost(ctx)
    assert (cost.time, cost.compute, cost.micro_batches) == pytest.approx((0.5 + 1.3, 1.5, 1.0))
    # all hidden: small buckets finish inside the backward
    assert Buckets((0.2, 0.6), (b(100), b(100))).cost(ctx).time == pytest.approx(1.5)


def test_adaptive_stages_take_micro_batches_until_the_job_is_done_per_worker_speed():
    links = Links({"inter": LinkModel(1e3, 0.0)})
    job = Wire([Comm("all_reduce", "replicate", 250)])  # 0.25 s
    ctx = _ctx(links, world=2, nodes=2, fwd=0.05, bwd=0.05)  # 0.1 s per micro-batch
    c = Adaptive(job).cost(ctx)
    assert (c.time, c.global_micro_batches) == pytest.approx((0.3, 6))  # ceil(0.25 / 0.1) = 3 each
    c = Adaptive(job, high=2).cost(ctx)
    assert (c.time, c.global_micro_batches) == pytest.approx((0.25, 4))  # capped: waits for the job
    c = Adaptive(job, fixed=1).cost(ctx)
    assert (c.time, c.compute) == pytest.approx((0.25, 0.1))
    slow = _ctx(links, world=2, nodes=2, fwd=0.05, bwd=0.05, scale=(1.0, 2.0))
    c = Adaptive(job).cost(slow)  # worker 0: 3 × 0.1; worker 1: ceil(0.25 / 0.2) = 2 × 0.2
    assert (c.time, c.global_micro_batches) == pytest.approx((0.4, 5))
    assert Adaptive(job, low=5).cost(ctx).time == pytest.approx(0.5)


def test_fit_recovers_alpha_and_beta_from_exact_samples_and_keeps_them_non_negative():
    alpha, beta = 2e-4, 12.5e6
    samples = []
    for size in (1 << 10, 1 << 14, 1 << 18, 1 << 22):
        for kind, messages, sent in (("all_reduce", 2, size), ("exchange", 1, size)):
            samples.append(Sample(kind, messages, sent, messages * alpha + sent / beta))
    fit = fit_link(samples)
    assert fit.link.latency == pytest.approx(alpha, rel=1e-6)
    assert fit.link.bandwidth == pytest.approx(beta, rel=1e-6)
    assert fit.rel_error < 1e-9
    pure_bw = fit_link([Sample("exchange", 1, s, s / 1e6) for s in (1000, 10_000, 100_000)])
    assert pure_bw.link.latency == 0.0 and pure_bw.link.bandwidth == pytest.approx(1e6)
    with pytest.raises(ValueError, match="moved bytes"):
        fit_link([Sample("exchange", 1, 0, 0.1)])


def test_chunk_rows_is_torch_chunk():
    import torch

    for rows in (1, 5, 7, 8, 61):
        for n in (1, 2, 3, 4):
            sizes = [c.shape[0] for c in torch.chunk(torch.zeros(rows), n)]
            sizes += [0] * (n - len(sizes))
            assert [chunk_rows(rows, n, i) for i in range(n)] == sizes


def test_a_described_transformer_has_the_shapes_transformers_builds():
    pytest.importorskip("transformers")
    from quietsync.cost.workload import Workload
    from quietsync.models import ModelPreset, build_model, param_groups

    model = build_model(ModelPreset(hidden_size=24, num_layers=3, num_heads=2, max_positions=16), 61, seed=0)
    built = Workload.from_model(model, tokens_per_micro_batch=32, param_groups=param_groups(model, 0.1))
    described = Workload.transformer(hidden=24, layers=3, vocab=61, seq_len=16, micro_batch_size=2)
    assert described.params == built.params == sum(p.numel() for p in model.parameters())
    assert sorted(described.shapes) == sorted(built.shapes)
    assert described.group_sizes == built.group_sizes
    assert sorted(sorted(described.shapes[i] for i in u) for u in described.units) == sorted(
        sorted(built.shapes[i] for i in u) for u in built.units)
    assert described.tokens_per_micro_batch == 32
    assert described.flops_per_token == pytest.approx(6 * described.params + 12 * 3 * 24 * 16)
    assert math.prod(described.shapes[0]) > 0


def test_fit_follows_large_transfers_through_a_token_bucket():
    """tc tbf lets a burst through at line rate: small transfers look fast, a megabyte sees the shaped rate."""
    rate, burst, line = 12.5e6, 64e3, 1.25e9

    def seconds(nbytes: float) -> float:
        return 1e-4 + (min(nbytes, burst) / line) + max(0.0, nbytes - burst) / rate

    samples = [Sample("exchange", 1, s, seconds(s)) for s in (1 << k for k in range(10, 23))]
    fit = fit_link(samples)
    assert fit.link.bandwidth == pytest.approx(rate, rel=0.1)
    for size in (1 << 21, 1 << 24):  # what a gradient takes is predicted within 10%
        assert fit.link.time("send", size, 2) == pytest.approx(seconds(size), rel=0.1)


def test_a_cdp_cycle_is_its_time_steps_stretched_by_each_workers_hops_not_a_hop_per_time_step():
    """N = 2 stages on 2 workers (2 nodes): a cycle of 2N = 4 time steps of a quarter micro-batch each (0.3 s / 4),
    every worker sending 2 hops. A hop slower than a time step stretches the time step it feeds by the difference,
    and one worker's hops go one after the other on its link (measured: benchmarks/results/plan_cdp.md)."""
    from quietsync.strategies.cdp.cost import CyclicTimeline

    def cycle(bandwidth: float) -> float:
        hops = tuple(Comm("send", "world", 1000, peer=1 - src) for src in (0, 0, 1, 1))
        term = CyclicTimeline(2, 2, 4, (0.5, 0.5), hops, (0, 0, 1, 1), elements=1)
        return term.cost(_ctx(Links({"inter": LinkModel(bandwidth, 0.0)}), world=2, nodes=2)).time

    t_step = 0.3 / 4
    assert cycle(1e3) == pytest.approx(4 * t_step + 2 * (1.0 - t_step))  # 1 s hops: 2.15 s, not 4 x 1 s
    assert cycle(1e6) == pytest.approx(4 * t_step)  # 1 ms hops hide inside the time steps
    assert cycle(1e4) == pytest.approx(4 * t_step + 2 * (0.1 - t_step))  # 0.1 s hops: 0.025 s over each
