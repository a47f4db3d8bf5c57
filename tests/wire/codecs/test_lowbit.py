"""Low-bit block quantizers (``quietsync.wire.codecs.lowbit``) against grids, scales and byte layouts written here
by hand from the formats' definitions (OCP FP4 E2M1, E3M0, symmetric int4, mid-rise 2-bit)."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from quietsync.wire.codecs.lowbit import LOWBIT_FORMATS, BlockQuantizer, pack_codes, unpack_codes

# The grids, written from the formats' definitions (levels in units of the block scale).
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # OCP MX spec, FP4 E2M1 magnitudes
E3M0 = [0.0] + [2.0 ** (e - 3) for e in range(1, 8)]  # exponent bias 3, no mantissa: 0.25 .. 16
GRIDS = {
    "fp4": sorted({s * m for m in E2M1 for s in (1, -1)}),
    "fp4_e3m0": sorted({s * m for m in E3M0 for s in (1, -1)}),
    "int4": [float(q) for q in range(-7, 8)],
    "int2": [-1.5, -0.5, 0.5, 1.5],
}
BITS = {"fp4": 4, "fp4_e3m0": 4, "int4": 4, "int2": 2}


def bf16_round_up(x: float) -> float:
    """The smallest bfloat16 value >= x (x >= 0), computed on the fp32 bit pattern."""
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    if bits & 0xFFFF:
        bits = (bits & 0xFFFF0000) + 0x10000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def stored_scales(payload: torch.Tensor, blocks: int) -> list[float]:
    """The bf16 scales at the head of a payload, read byte by byte."""
    raw = bytes(payload[: 2 * blocks].tolist())
    return [struct.unpack("<f", b"\x00\x00" + raw[2 * i: 2 * i + 2])[0] for i in range(blocks)]


def test_formats_are_the_ones_named():
    assert set(LOWBIT_FORMATS) == set(GRIDS)
    for name, grid in GRIDS.items():
        assert [float(v) for v in BlockQuantizer(name).format.levels] == grid


@pytest.mark.parametrize("name", list(GRIDS))
def test_round_trip_exact_on_representable_values(name):
    grid = GRIDS[name]
    gen = torch.Generator().manual_seed(1)
    block, blocks = 16, 5
    scale_of_block = [2.0 ** -3, 2.0 ** 4, 0.75, 2.0 ** -20, 1.0]  # bf16-exact scales
    rows = []
    for b in range(blocks):
        idx = torch.randint(0, len(grid), (block,), generator=gen)
        idx[0] = len(grid) - 1  # the largest level is present: the absmax scale is the block's scale
        rows.append(torch.tensor([grid[i] for i in idx]) * scale_of_block[b])
    x = torch.cat(rows)
    for rounding in ("nearest", "stochastic"):
        q = BlockQuantizer(name, block=block, rounding=rounding)
        y = q.decode(q.encode(x, generator=torch.Generator().manual_seed(0)), x.numel())
        assert torch.equal(y, x), rounding


@pytest.mark.parametrize("name", list(GRIDS))
@pytest.mark.parametrize("numel", [1, 3, 63, 64, 65, 200])
def test_nearest_error_at_most_half_a_step(name, numel):
    grid = torch.tensor(GRIDS[name], dtype=torch.float64)
    qmax = float(grid.abs().max())
    block = 64
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * torch.logspace(-3, 2, numel)
    q = BlockQuantizer(name, block=block)
    payload = q.encode(x)
    nb = math.ceil(numel / block)
    assert payload.dtype == torch.uint8 and payload.numel() == q.payload_bytes(numel)
    assert payload.numel() == 2 * nb + math.ceil(numel * BITS[name] / 8)
    scales = stored_scales(payload, nb)
    y = q.decode(payload, numel).double()
    for b in range(nb):
        xb = x[b * block: (b + 1) * block].double()
        amax = float(xb.abs().max())
        assert scales[b] == bf16_round_up(float(torch.tensor(amax, dtype=torch.float32) / qmax))
        levels = grid * scales[b]
        yb = y[b * block: (b + 1) * block]
        # every decoded value is a level; it is the nearest one; its error is at most half the gap there
        dist = (xb[:, None] - levels[None, :]).abs()
        assert torch.all(dist.min(1).values == (xb - yb).abs())
        pos = torch.searchsorted(levels, xb.clamp(levels[0], levels[-1])).clamp(1, len(levels) - 1)
        half_gap = (levels[pos] - levels[pos - 1]) / 2
        assert torch.all((xb - yb).abs() <= half_gap * (1 + 1e-6))


def test_nearest_ties():
    # fp4 ties go to the even mantissa (IEEE round-to-nearest-even on E2M1); int4 to the even integer.
    fp4 = BlockQuantizer("fp4", block=8)
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])  # scale 1
    assert fp4.decode(fp4.encode(x), 8).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    int4 = BlockQuantizer("int4", block=8)
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 6.5, -7.0])  # scale 1
    assert int4.decode(int4.encode(x), 8).tolist() == [0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 6.0, -7.0]


def test_packing_layout_by_hand():
    one_bf16 = [0x80, 0x3F]  # 1.0 as bfloat16, little-endian
    # int4, scale 7/7 = 1: codes are two's complement nibbles, element 2i low, 2i+1 high; 5 elements pad one
    q = BlockQuantizer("int4", block=8)
    assert q.encode(torch.tensor([1.0, -1.0, 7.0, -7.0, 0.0])).tolist() == one_bf16 + [0xF1, 0x97, 0x00]
    # fp4 (E2M1), scale 6/6 = 1: 0.5 -> 0b0001, -6 -> 0b1111, 1.5 -> 0b0011, 0 -> 0
    q = BlockQuantizer("fp4", block=4)
    assert q.encode(torch.tensor([0.5, -6.0, 1.5, 0.0])).tolist() == one_bf16 + [0xF1, 0x03]
    # fp4_e3m0, scale 16/16 = 1: 0.25 -> 0b0001, -16 -> 0b1111, 2 -> 0b0100
    q = BlockQuantizer("fp4_e3m0", block=4)
    assert q.encode(torch.tensor([0.25, -16.0, 2.0])).tolist() == one_bf16 + [0xF1, 0x04]
    # int2, scale 1.5/1.5 = 1: levels -1.5,-0.5,0.5,1.5 are codes 0..3, four to a byte, element 4i+j at bits 2j
    q = BlockQuantizer("int2", block=8)
    assert q.encode(torch.tensor([-1.5, -0.5, 0.5, 1.5, 1.5])).tolist() == one_bf16 + [0b11100100, 0b11]
    # two blocks: the scales come first, in block order
    q = BlockQuantizer("int4", block=2, scale_dtype="fp32")
    payload = q.encode(torch.tensor([7.0, 0.0, 0.0, -14.0]))
    assert list(struct.unpack("<2f", bytes(payload[:8].tolist()))) == [1.0, 2.0]
    assert payload[8:].tolist() == [0x07, 0x90]


def test_pack_unpack_codes_round_trip():
    for bits in (2, 4):
        codes = torch.randint(0, 1 << bits, (3, 37), dtype=torch.uint8)
        packed = pack_codes(codes, bits)
        assert packed.shape == (3, math.ceil(37 * bits / 8))
        assert torch.equal(unpack_codes(packed, bits, 37), codes)


@pytest.mark.parametrize("name", list(GRIDS))
def test_zeros_and_all_equal_blocks(name):
    q = BlockQuantizer(name, block=4)
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.3, 0.3, -2.0, -2.0, -2.0])
    payload = q.encode(x)
    assert stored_scales(payload, 3)[0] == 0.0
    y = q.decode(payload, x.numel())
    assert torch.equal(y[:4], torch.zeros(4))
    qmax = max(GRIDS[name])
    for b, c in ((1, 0.3), (2, -2.0)):
        s = stored_scales(payload, 3)[b]
        # |c| / s is within the float rounding of qmax: the nearest level is ±qmax
        assert torch.allclose(y[4 * b: 4 * b + 4],
                              torch.full((4,), math.copysign(qmax * s, c))[: len(y[4 * b:4 * b + 4])])


@pytest.mark.parametrize("name", list(GRIDS))
def test_stochastic_rounding_is_unbiased(name):
    grid = torch.tensor(GRIDS[name], dtype=torch.float64)
    x = torch.randn(48, generator=torch.Generator().manual_seed(3))
    q = BlockQuantizer(name, block=16, rounding="stochastic")
    gen = torch.Generator().manual_seed(7)
    draws = 4000
    ys = torch.stack([q.decode(q.encode(x, gen), x.numel()) for _ in range(draws)]).double()
    scales = torch.tensor(stored_scales(q.encode(x, gen), 3), dtype=torch.float64).repeat_interleave(16)
    # each draw is one of the two levels around x
    v = x.double() / scales
    hi = torch.searchsorted(grid, v.clamp(grid[0], grid[-1])).clamp(1, len(grid) - 1)
    lo_v, hi_v = grid[hi - 1] * scales, grid[hi] * scales
    assert torch.all((ys == lo_v) | (ys == hi_v))
    # unbiased: the mean is within 5 standard errors (a draw's deviation is at most the gap)
    tol = 5 * (hi_v - lo_v) / 2 / math.sqrt(draws) + 1e-7
    assert torch.all((ys.mean(0) - x.double()).abs() <= tol)
    # and nearest rounding is not (the same test fails it): a point a tenth of the way up a gap
    qn = BlockQuantizer(name, block=16)
    pt = (lo_v + 0.1 * (hi_v - lo_v)).float()
    assert not torch.allclose(qn.decode(qn.encode(pt), 48).double(), pt.double(), atol=0, rtol=1e-3)


def test_stochastic_is_seeded():
    x = torch.randn(100)
    q = BlockQuantizer("int2", rounding="stochastic")
    a = q.encode(x, torch.Generator().manual_seed(5))
    b = q.encode(x, torch.Generator().manual_seed(5))
    c = q.encode(x, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    with pytest.raises(ValueError, match="generator"):
        q.encode(x)


def test_stacked_payloads_decode_per_worker():
    q = BlockQuantizer("fp4", block=8)
    xs = [torch.randn(13) for _ in range(3)]
    stack = torch.stack([q.encode(x) for x in xs])
    out = q.decode(stack, 13)
    for i, x in enumerate(xs):
        assert torch.equal(out[i], q.decode(q.encode(x), 13))


@pytest.mark.parametrize("scale_dtype,size", [("fp32", 4), ("fp16", 2), ("bf16", 2)])
def test_payload_bytes_counts_scales(scale_dtype, size):
    q = BlockQuantizer("int2", block=32, scale_dtype=scale_dtype)
    for n in (0, 1, 31, 32, 33, 1000):
        assert q.payload_bytes(n) == math.ceil(n / 32) * size + math.ceil(n / 4)
        assert q.encode(torch.randn(n)).numel() == q.payload_bytes(n)
    # fp16 scales round up too: no element exceeds the grid after the cast
    q16 = BlockQuantizer("int4", block=4, scale_dtype="fp16")
    x = torch.tensor([0.1234567, -0.05, 0.02, 0.0])
    assert (q16.decode(q16.encode(x), 4) - x).abs().max() <= 0.1234567 / 7 / 2 * 1.01


def test_bad_arguments_name_the_allowed_values():
    with pytest.raises(ValueError, match=r"format must be one of fp4, fp4_e3m0, int4, int2, got 'int3'"):
        BlockQuantizer("int3")
    with pytest.raises(ValueError, match=r"rounding must be one of nearest, stochastic"):
        BlockQuantizer("fp4", rounding="up")
    with pytest.raises(ValueError, match=r"scale_dtype must be one of bf16, fp16, fp32"):
        BlockQuantizer("fp4", scale_dtype="fp8")
    with pytest.raises(ValueError, match=r"block must be an integer >= 1"):
        BlockQuantizer("fp4", block=0)
    q = BlockQuantizer("fp4", block=8)
    with pytest.raises(ValueError, match="payload has"):
        q.decode(torch.zeros(3, dtype=torch.uint8), 8)
