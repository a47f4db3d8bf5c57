"""Compression chains (``quietsync.wire.compression``): chunk-wise top-k and quantization as one packed payload,
checked against a top-k written here with ``torch.sort`` and payload sizes counted by hand."""

from __future__ import annotations

import math

import pytest
import torch

from quietsync.wire.compression import Cast, Chain, Quantize, TopK


def reference_topk(x: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    """Dense: the k largest magnitudes of every zero-padded chunk kept, the rest zero (ties: none in tests)."""
    n = x.numel()
    pad = torch.cat([x, torch.zeros(-n % chunk)]).view(-1, chunk)
    order = pad.abs().argsort(dim=1, descending=True)[:, :k]
    out = torch.zeros_like(pad)
    out.scatter_(1, order, pad.gather(1, order))
    return out.reshape(-1)[:n]


@pytest.mark.parametrize("numel,chunk,density", [(100, 16, 0.25), (64, 64, 1 / 64), (7, 4, 0.5), (300, 256, 0.03)])
def test_topk_chain_equals_reference_and_counts_bytes(numel, chunk, density):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    sel = TopK(chunk=chunk, density=density)
    k = min(chunk, max(1, round(density * chunk)))
    assert sel.k == k
    chain = Chain(select=sel)
    payload = chain.encode(x)
    chunks = math.ceil(numel / chunk)
    pos_size = 1 if chunk <= 256 else 2
    assert payload.numel() == chain.payload_bytes(numel) == chunks * k * (4 + pos_size)
    assert torch.equal(chain.decode(payload, numel), reference_topk(x, chunk, k))


def test_topk_then_quantize_packs_values_and_positions():
    x = torch.tensor([0.1, -3.0, 0.2, 1.0, 5.0, 0.0, -0.5, 0.25])
    chain = Chain(select=TopK(chunk=4, density=0.5), quantize=Quantize("int2", block=2))
    payload = chain.encode(x)
    # 2 chunks x k=2 values in int2 with one bf16 scale per chunk (block = k), then 4 uint8 positions
    assert payload.numel() == chain.payload_bytes(8) == 2 * 2 + 1 + 4
    # chunk 0 keeps -3.0 (pos 1) and 1.0 (pos 3): scale 3/1.5 = 2 -> levels ±1, ±3; chunk 1 keeps 5.0, -0.5
    # (scale 5/1.5, bf16 rounded up): 5 -> 1.5·s, -0.5 -> -0.5·s
    s1 = float(torch.tensor(5 / 1.5).to(torch.bfloat16))
    s1 = s1 if s1 >= 5 / 1.5 else float(torch.nextafter(torch.tensor(s1, dtype=torch.bfloat16),
                                                         torch.tensor(10.0, dtype=torch.bfloat16)))
    want = torch.tensor([0.0, -3.0, 0.0, 1.0, 1.5 * s1, 0.0, -0.5 * s1, 0.0])
    assert torch.equal(chain.decode(payload, 8), want)
    assert sorted(payload[-4:-2].tolist()) == [1, 3] and sorted(payload[-2:].tolist()) == [0, 2]


def test_stacked_payloads_decode_per_worker():
    chain = Chain(select=TopK(chunk=8, density=0.25), quantize=Quantize("fp4", block=2))
    xs = [torch.randn(30) for _ in range(3)]
    out = chain.decode(torch.stack([chain.encode(x) for x in xs]), 30)
    for i, x in enumerate(xs):
        assert torch.equal(out[i], chain.decode(chain.encode(x), 30))


def test_cast_and_plain_quantize_chains():
    x = torch.randn(33)
    c = Chain(quantize=Cast("bf16"))
    assert c.payload_bytes(33) == 66
    assert torch.equal(c.decode(c.encode(x), 33), x.to(torch.bfloat16).float())
    q = Chain(quantize=Quantize("int4", block=8))
    assert q.payload_bytes(33) == 5 * 2 + 17


def test_bad_knobs():
    with pytest.raises(ValueError, match=r"density must be in \(0, 1\]"):
        TopK(density=0.0)
    with pytest.raises(ValueError, match=r"density must be in \(0, 1\]"):
        TopK(density=1.5)
    with pytest.raises(ValueError, match="dtype must be one of fp32, bf16, fp16"):
        Cast("int8")
    with pytest.raises(ValueError, match="format must be one of"):
        Quantize("int3")


def test_chunks_stay_inside_each_tensor():
    sizes = [5, 12, 3]
    x = torch.randn(20, generator=torch.Generator().manual_seed(4))
    chain = Chain(select=TopK(chunk=4, density=0.5, sizes=sizes))
    # chunks: 5 -> 2, 12 -> 3, 3 -> 1; k = 2 each
    assert chain.payload_bytes(20) == 6 * 2 * (4 + 1)
    want = torch.cat([reference_topk(part, 4, 2) for part in x.split(sizes)])
    assert torch.equal(chain.decode(chain.encode(x), 20), want)
    with pytest.raises(ValueError, match="this selector's tensors hold 20"):
        chain.encode(torch.randn(21))
