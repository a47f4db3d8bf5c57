"""Replicators across gloo workers: shared indices, per-coefficient averaging, metered bytes."""

from __future__ import annotations

import pytest
import torch

from quietsync.topology import Topology
from quietsync.transport import Transport
from quietsync.wire.replicators import Segments, make_replicator
from tests.distributed import run_ranks
from tests.strategies.helpers.reference_demo import DCTReference, ks_from_compression

SEG = Segments([(24, 40), (19,), (2, 3, 7)])
NOPAD = Segments([(24, 40), (16,), (2, 3, 8)])  # multiples of chunk 8: re-encoding `sent` is exact


def _delta(rank: int, seg: Segments = SEG, shared: float = 0.0) -> torch.Tensor:
    """This rank's momentum: its own noise plus ``shared`` times a part common to every rank."""
    own = torch.randn(seg.numel, generator=torch.Generator().manual_seed(100 + rank))
    return own + shared * torch.randn(seg.numel, generator=torch.Generator().manual_seed(99))


def _exchange(rank: int, world: int, name: str, kw: dict, seg: Segments = SEG, shared: float = 0.0) -> dict:
    transport = Transport(Topology.from_env())
    rep = make_replicator(name, transport=transport, group="replicate", **kw)
    delta = _delta(rank, seg, shared)
    before = delta.clone()
    msg = rep.extract(delta, seg)
    out = {"sent": msg.sent, "meta": msg.meta if name in ("random", "striding") else None, "payload": msg.payload}
    rep.counter = 0 if hasattr(rep, "counter") else None
    transport.meter.reset()
    update = rep.replicate(delta, seg)
    out.update(update=update, residual=delta, before=before, meter=transport.meter.snapshot(),
               by_kind=transport.meter.by_kind(), payload_bytes=rep.payload_bytes(seg))
    transport.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["random", "striding"])
def test_shared_indices_values_only_all_reduce(name):
    world = 3
    res = run_ranks(_exchange, world, name, {"compression": 1 / 8, "transfer_dtype": "bf16"})
    idx = res[0]["meta"]
    for r in res:
        assert torch.equal(r["meta"], idx)  # identical positions on every rank
        # no indices travel: the payload is values only, in the transfer dtype
        assert r["payload"].dtype == torch.bfloat16 and r["payload"].numel() == idx.numel()
        b = r["payload_bytes"]
        assert b == (SEG.numel * 4 // 8 // 2) * 2
        assert r["by_kind"] == {"replicate/all_reduce": 2 * (world - 1) * b // world}
    # the update is the average of every rank's bf16 values at the shared positions, zero elsewhere: averaged by
    # an all-reduce in bf16 (two additions and a division, each rounding to bf16: at most 2^-8 of the sum of the
    # magnitudes), and a bf16 number itself -- an fp32 average (no bf16 on the wire) would not be
    sent = torch.stack([r["before"][idx].to(torch.bfloat16).float() for r in res])
    want, bound = torch.zeros(SEG.numel), torch.zeros(SEG.numel)
    want[idx], bound[idx] = sent.mean(0), 2**-8 * sent.abs().sum(0)
    assert (sent.mean(0).to(torch.bfloat16).float() != sent.mean(0)).any()  # the check below can fail
    for r in res:
        assert torch.equal(r["update"].to(torch.bfloat16).float(), r["update"])
        assert ((r["update"] - want).abs() <= bound).all(), float((r["update"] - want).abs().max())
        assert (r["update"].count_nonzero() == idx.numel()
                and torch.equal(r["update"].nonzero().view(-1), idx.sort().values))
        torch.testing.assert_close(r["residual"] + r["sent"], r["before"], rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(120)
def test_dct_all_gather_averages_per_coefficient():
    """3 workers: each coefficient is averaged over the workers that sent it (1, 2 or 3 of them), as the fp64
    oracle of paper 001 computes it from every worker's momentum (``tests/strategies/helpers/reference_demo.py``)."""
    world = 3
    kw = {"compression": 1 / 8, "chunk": 8}
    res = run_ranks(_exchange, world, "dct", kw, NOPAD, 1.0)  # a common part: some coefficients chosen by all
    shapes = list(NOPAD.shapes)
    oracle = DCTReference(shapes, 8, ks_from_compression(shapes, 8, 1 / 8))
    split = [t.reshape(s) for t, s in zip(torch.zeros(NOPAD.numel).split(list(NOPAD.sizes)), shapes)]
    qs = [oracle.extract([b.double().view_as(t) for b, t in zip(r["before"].split(list(NOPAD.sizes)), split)])
          for r in res]
    assert oracle.margins.topk_gap > 1e-5  # no top-k choice within fp32 rounding
    counts = torch.cat([sum(q[i][0].to(torch.int64) for q in qs).reshape(-1) for i in range(len(shapes))])
    assert {1, 2, 3} <= set(counts.unique().tolist())  # coefficients sent by one, two and all three workers
    want = torch.cat([u.reshape(-1) for u in oracle.average(qs)])
    for r, q in zip(res, qs):
        torch.testing.assert_close(r["update"].double(), want, rtol=1e-5, atol=1e-6)
        sent = torch.cat([x.reshape(-1) for x in oracle.sent(q)])
        torch.testing.assert_close(r["residual"].double(), r["before"].double() - sent, rtol=1e-5, atol=1e-6)
        b = r["payload_bytes"]
        # by hand: 15 blocks 8x8 (k=round(960*4/8/(15*5))=6), 2 of 8 (k=1), 3 of 2x8 (k=2); 4+1 bytes each
        assert b == make_replicator("dct", **kw).payload_bytes(NOPAD) == 15 * 6 * 5 + 2 * 1 * 5 + 3 * 2 * 5
        assert r["by_kind"] == {"replicate/all_gather": (world - 1) * b}  # grows with the group
        torch.testing.assert_close(r["residual"] + r["sent"], r["before"], rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(120)
def test_full_is_the_mean_and_none_sends_nothing():
    world = 2
    res = run_ranks(_exchange, world, "full", {})
    mean = (res[0]["before"] + res[1]["before"]) / 2
    for r in res:
        torch.testing.assert_close(r["update"], mean)
        assert r["by_kind"] == {"replicate/all_reduce": SEG.numel * 4}
        assert r["residual"].count_nonzero() == 0
    res = run_ranks(_exchange, world, "none", {})
    for r in res:
        assert r["by_kind"] == {}
        torch.testing.assert_close(r["update"], r["before"])
