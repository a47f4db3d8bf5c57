"""Top-k per block, index dtypes, averaging over senders, packing, casts."""

import pytest
import torch

from quietsync.wire.codecs import (
    BlockLayout,
    apply_sign,
    densify,
    index_dtype,
    pack,
    scatter_mean,
    topk_per_block,
    transfer_dtype,
    unpack,
)


@pytest.mark.parametrize(
    "n,dtype", [(1, torch.uint8), (256, torch.uint8), (257, torch.int16), (4096, torch.int16), (2**15 + 1, torch.int32)]
)
def test_index_dtype_is_smallest(n, dtype):
    assert index_dtype(n) == dtype


def test_topk_picks_largest_magnitudes():
    x = torch.tensor([[0.1, -5.0, 2.0, 0.0], [3.0, 0.0, -0.5, -4.0]])
    vals, pos = topk_per_block(x, 2)
    assert pos.dtype == torch.uint8
    for row in range(2):
        got = dict(zip(pos[row].tolist(), vals[row].tolist()))
        want = {1: -5.0, 2: 2.0} if row == 0 else {0: 3.0, 3: -4.0}
        assert got == want


def test_topk_of_every_coefficient_is_identity():
    layout = BlockLayout([(20, 12), (9,), (3, 3, 3)], chunk=8)
    x = torch.randn(layout.numel, dtype=torch.float64)
    coeffs = layout.encode(x)
    sparse = []
    for g, c in zip(layout.groups, coeffs):
        flat = c.reshape(g.num_blocks, -1)
        vals, pos = topk_per_block(flat, flat.shape[1])
        sparse.append(densify(vals, pos, flat.shape[1]).reshape(c.shape))
    torch.testing.assert_close(layout.decode(sparse), x, rtol=0, atol=1e-12)


def test_topk_rejects_k_above_block():
    with pytest.raises(ValueError, match=r"^k must be an integer in \[1, 4\], got 5$"):
        topk_per_block(torch.zeros(2, 4), 5)


def test_scatter_mean_averages_over_senders_only():
    # worker 0 sends positions 0,1 of the block; worker 1 sends 1,2
    values = torch.tensor([[[2.0, 4.0]], [[6.0, 8.0]]])
    positions = torch.tensor([[[0, 1]], [[1, 2]]], dtype=torch.uint8)
    out = scatter_mean(values, positions, 4)
    torch.testing.assert_close(out, torch.tensor([[2.0, 5.0, 8.0, 0.0]]))


def test_pack_unpack_round_trip_mixed_dtypes():
    a = torch.randn(3, 5).to(torch.bfloat16)
    b = torch.randint(0, 200, (3, 5), dtype=torch.uint8)
    c = torch.randint(-3000, 3000, (7,), dtype=torch.int16)
    buf = pack([a, b, c])
    assert buf.dtype == torch.uint8 and buf.numel() == 30 + 15 + 14
    two = torch.stack([buf, buf])
    ua, ub, uc = unpack(two, [((3, 5), torch.bfloat16), ((3, 5), torch.uint8), ((7,), torch.int16)])
    assert torch.equal(ua[1], a) and torch.equal(ub[0], b) and torch.equal(uc[1], c)
    # one worker's buffer: the int16 starts at byte 45, an odd offset, and still reads back
    ua, ub, uc = unpack(buf, [((3, 5), torch.bfloat16), ((3, 5), torch.uint8), ((7,), torch.int16)])
    assert torch.equal(ua[0], a) and torch.equal(ub[0], b) and torch.equal(uc[0], c)


def test_transfer_dtype_names_and_sign():
    assert transfer_dtype("bf16") == torch.bfloat16
    with pytest.raises(ValueError, match="^transfer_dtype must be one of fp32, bf16, fp16, got 'int8'$"):
        transfer_dtype("int8")
    with pytest.raises(ValueError, match="^transfer_dtype must be one of .*, got torch.int8$"):
        transfer_dtype(torch.int8)
    assert apply_sign(torch.tensor([-2.0, 0.0, 3.0])).tolist() == [-1.0, 0.0, 1.0]
    assert apply_sign(torch.tensor([-2.0]), enabled=False).tolist() == [-2.0]
