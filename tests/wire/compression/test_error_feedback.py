"""Error feedback (``quietsync.wire.compression.ErrorFeedback``): transmitted + residual = accumulated, step after
step, for every quantizer, for top-k and for their chain; the accumulated value is recomputed here."""

from __future__ import annotations

import pytest
import torch

from quietsync.wire.compression import Cast, Chain, ErrorFeedback, Quantize, TopK

EXACT = {  # nearest rounding on grids with 0 whose gaps are at most the smaller level: e = a - sent is exact
    "topk": lambda: Chain(select=TopK(chunk=16, density=0.125)),
    "fp4": lambda: Chain(quantize=Quantize("fp4", block=16)),
    "fp4_e3m0": lambda: Chain(quantize=Quantize("fp4_e3m0", block=16)),
    "int4": lambda: Chain(quantize=Quantize("int4", block=16)),
    "topk+int4": lambda: Chain(select=TopK(chunk=16, density=0.25), quantize=Quantize("int4", block=4)),
    "topk+fp4": lambda: Chain(select=TopK(chunk=16, density=0.25), quantize=Quantize("fp4", block=4)),
    "bf16": lambda: Chain(quantize=Cast("bf16")),
}
ROUNDED = {  # int2 has no zero level; stochastic rounding may pick the far level: e is one rounding off
    "int2": lambda: Chain(quantize=Quantize("int2", block=16)),
    "topk+int2": lambda: Chain(select=TopK(chunk=16, density=0.125), quantize=Quantize("int2", block=2)),
    "fp4-stochastic": lambda: Chain(quantize=Quantize("fp4", block=16, rounding="stochastic", seed=3)),
    "int2-stochastic": lambda: Chain(quantize=Quantize("int2", block=16, rounding="stochastic", seed=3)),
}


def steps(n: int = 6, numel: int = 103):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(numel, generator=gen) * 10.0 ** torch.randint(-4, 2, (1,), generator=gen).item()
            for _ in range(n)]


@pytest.mark.parametrize("decay", [1.0, 0.9])
@pytest.mark.parametrize("name", list(EXACT))
def test_transmitted_plus_residual_is_accumulated_bit_for_bit(name, decay):
    xs = steps()
    ef = ErrorFeedback(EXACT[name](), xs[0].numel(), decay=decay)
    e = torch.zeros(xs[0].numel())
    total_sent = torch.zeros(xs[0].numel(), dtype=torch.float64)
    for x in xs:
        acc = e * decay + x if decay != 1.0 else e + x  # the accumulated value, in fp32
        payload, sent = ef.compress(x)
        assert payload.dtype == torch.uint8 and payload.numel() == ef.payload_bytes()
        assert torch.equal(sent, ef.compressor.decode(payload, x.numel()))
        assert torch.equal(sent + ef.residual, acc)
        e = ef.residual.clone()
        total_sent += sent.double()
    if decay == 1.0:  # over the steps: everything sent plus what is left is everything given (to fp32 rounding)
        given = torch.stack(xs).double().sum(0)
        assert torch.allclose(total_sent + e.double(), given, rtol=0, atol=1e-5 * given.abs().max().item())


@pytest.mark.parametrize("name", list(ROUNDED))
def test_transmitted_plus_residual_within_one_rounding(name):
    xs = steps()
    ef = ErrorFeedback(ROUNDED[name](), xs[0].numel())
    e = torch.zeros(xs[0].numel())
    for x in xs:
        acc = e + x
        _, sent = ef.compress(x)
        ulp = torch.nextafter(sent.abs(), torch.tensor(float("inf"))) - sent.abs()
        assert torch.all((sent + ef.residual - acc).abs() <= ulp)
        e = ef.residual.clone()


def test_checkpoint_resumes_exactly():
    make = ROUNDED["int2-stochastic"]
    xs = steps(5)
    a = ErrorFeedback(make(), xs[0].numel(), decay=0.95)
    for x in xs[:2]:
        a.compress(x)
    saved = a.state_dict()
    b = ErrorFeedback(make(), xs[0].numel(), decay=0.95)
    b.load_state_dict(saved)
    for x in xs[2:]:
        pa, _ = a.compress(x)
        pb, _ = b.compress(x)
        assert torch.equal(pa, pb)
    assert torch.equal(a.residual, b.residual)
    assert a.memory_report() == {"residual": 4 * xs[0].numel()}


def test_wrong_size_rejected():
    ef = ErrorFeedback(Chain(), 10)
    with pytest.raises(ValueError, match="x has 11 elements"):
        ef.compress(torch.zeros(11))
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\]"):
        ErrorFeedback(Chain(), 10, decay=1.5)
