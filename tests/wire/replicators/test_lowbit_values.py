"""Replicators with a low-bit ``transfer_dtype`` (fp4, int2): values quantized per block with a bf16 absmax scale,
positions as before, packed payloads all-gathered and averaged after decoding, the residual keeping what
quantization lost. The expected update and residual are computed here with a quantizer and an orthonormal
DCT-II written from their definitions (``tests/strategies/helpers/reference_bits.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from quietsync.topology import Topology
from quietsync.transport import Transport
from quietsync.wire.replicators import Segments, make_replicator
from tests.distributed import run_ranks
from tests.strategies.helpers.reference_bits import E2M1, INT2, quantize_blocks

GRIDS = {"fp4": E2M1, "int2": INT2}
BITS = {"fp4": 4, "int2": 2}
SEG = Segments([(24, 40), (19,), (2, 3, 7)])
VEC = Segments([(48,)])  # 3 DCT blocks of 16, no padding


def _delta(rank: int, seg: Segments) -> torch.Tensor:
    return torch.randn(seg.numel, generator=torch.Generator().manual_seed(300 + rank))


def _run(rank: int, world: int, name: str, kw: dict, seg: Segments) -> dict:
    transport = Transport(Topology.from_env())
    rep = make_replicator(name, transport=transport, group="world", **kw)
    delta = _delta(rank, seg)
    idx = rep.indices(seg, 0) if name in ("random", "striding") else None
    update = rep.replicate(delta, seg)
    out = {"update": update, "residual": delta, "idx": idx, "payload_bytes": rep.payload_bytes(seg),
           "by_kind": transport.meter.by_kind()}
    transport.close()
    return out


def _dct_matrix(n: int) -> torch.Tensor:
    """Orthonormal DCT-II: row k = sqrt((1 + (k > 0)) / n) cos(pi (2i + 1) k / 2n)."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2 / n)
    d[0] /= math.sqrt(2)
    return d.float()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fmt", ["fp4", "int2"])
def test_values_only_replicators_quantize_gather_and_keep_the_loss(fmt):
    world, block = 2, 16
    for name in ("random", "striding", "full"):
        kw = {"compression": 1 / 8, "transfer_dtype": fmt, "transfer_block": block}
        res = run_ranks(_run, world, name, kw, SEG)
        n = SEG.numel
        # values are blocked in ascending position order
        idx = res[0]["idx"].sort().values if name != "full" else torch.arange(n)
        m = idx.numel()
        payload = math.ceil(m / block) * 2 + math.ceil(m * BITS[fmt] / 8)
        if name != "full":
            assert torch.equal(res[1]["idx"].sort().values, idx)
            more = math.ceil((m + 1) / block) * 2 + math.ceil((m + 1) * BITS[fmt] / 8)
            assert payload <= n * 4 / 8 and (m == n or more > n * 4 / 8)  # the most values the budget holds
        sent = []
        for r in range(world):
            before = _delta(r, SEG)
            q = torch.zeros(n)
            q[idx] = quantize_blocks(before[idx], GRIDS[fmt], block)
            sent.append(q)
            # error feedback: the residual is what did not travel, quantization loss included
            torch.testing.assert_close(res[r]["residual"], before - q, rtol=0, atol=1e-6)
            assert res[r]["payload_bytes"] == payload
            assert res[r]["by_kind"] == {"world/all_gather": (world - 1) * payload}  # packed: gathered
        want = torch.stack(sent).mean(0)
        for r in range(world):
            torch.testing.assert_close(res[r]["update"], want, rtol=0, atol=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["fp4", "int2"])
def test_dct_values_quantized_per_block_positions_as_before(fmt):
    world, chunk, k = 2, 16, 4
    res = run_ranks(_run, world, "dct", {"transfer_dtype": fmt, "chunk": chunk, "topk": k}, VEC)
    d = _dct_matrix(chunk)
    blocks = VEC.numel // chunk
    coeffs, sent = [], []
    for r in range(world):
        x = _delta(r, VEC).view(blocks, chunk)
        c = x @ d.T  # X = D x per block
        pos = c.abs().argsort(dim=1, descending=True)[:, :k]
        vals = c.gather(1, pos)
        q = quantize_blocks(vals.reshape(-1), GRIDS[fmt], k).view(blocks, k)  # one scale per block's k values
        s = torch.zeros_like(c)
        s.scatter_(1, pos, q)
        coeffs.append(c)
        sent.append(s)
        torch.testing.assert_close(res[r]["residual"], ((c - s) @ d).reshape(-1), rtol=0, atol=1e-5)
    # each coefficient averaged over the workers that sent it, then decoded
    total, count = sum(sent), sum((s != 0).float() for s in sent)
    mean = torch.where(count > 0, total / count.clamp_min(1), torch.zeros_like(total))
    want = (mean @ d).reshape(-1)
    payload = blocks * 2 + math.ceil(blocks * k * BITS[fmt] / 8) + blocks * k  # scales, codes, uint8 positions
    for r in range(world):
        torch.testing.assert_close(res[r]["update"], want, rtol=0, atol=1e-5)
        assert res[r]["payload_bytes"] == payload
        assert res[r]["by_kind"] == {"world/all_gather": (world - 1) * payload}


def test_low_bit_budget_and_bad_names():
    seg = Segments([(1000,)])
    # 1/16 of 4000 bytes = 250 bytes: fp4 with a bf16 scale per 64 fits 468 values (234 code bytes + 16 scale)
    rep = make_replicator("random", compression=1 / 16, transfer_dtype="fp4")
    assert rep.payload_bytes(seg) <= 250 and rep.count(seg) == 468
    fp32 = make_replicator("random", compression=1 / 16)
    assert fp32.count(seg) == 62
    with pytest.raises(ValueError, match="transfer_dtype must be one of fp32, bf16, fp16, fp4, fp4_e3m0, int4, int2"):
        make_replicator("random", transfer_dtype="int3")
    with pytest.raises(ValueError, match="transfer_block must be an integer >= 1"):
        make_replicator("full", transfer_dtype="int4", transfer_block=0)
