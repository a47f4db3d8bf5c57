"""DCT-II basis and block layout: orthonormality and exact round trips (odd and prime sizes too)."""

import math

import pytest
import torch

from quietsync.wire.codecs import BlockLayout, dct_basis


def cosine_formula(n: int) -> torch.Tensor:
    """DCT-II written element by element from its definition (independent of the library)."""
    out = torch.empty(n, n, dtype=torch.float64)
    for k in range(n):
        scale = math.sqrt(1.0 / n) if k == 0 else math.sqrt(2.0 / n)
        for i in range(n):
            out[k, i] = scale * math.cos(math.pi * (2 * i + 1) * k / (2 * n))
    return out


@pytest.mark.parametrize("n", [1, 2, 7, 13, 16, 31, 64])
def test_basis_matches_formula_and_is_orthonormal(n):
    d = dct_basis(n, torch.float64)
    torch.testing.assert_close(d, cosine_formula(n), rtol=0, atol=1e-12)
    torch.testing.assert_close(d @ d.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)


def test_basis_is_cached_per_size_dtype_device():
    assert dct_basis(8, torch.float32) is dct_basis(8, torch.float32)
    assert dct_basis(8, torch.float32) is not dct_basis(8, torch.float64)


def test_first_coefficient_is_scaled_mean():
    x = torch.randn(16, dtype=torch.float64)
    assert torch.isclose(dct_basis(16, torch.float64)[0] @ x, x.sum() / 4)


SHAPES = [(64, 64), (17, 23), (13,), (97,), (3, 4, 5), (1, 31), (29, 1), (128, 8), (5, 7, 11), ()]


@pytest.mark.parametrize("chunk", [1, 4, 8, 16])
def test_round_trip_exact_with_padding(chunk):
    layout = BlockLayout(SHAPES, chunk)
    x = torch.randn(layout.numel, dtype=torch.float64)
    y = layout.decode(layout.encode(x))
    torch.testing.assert_close(y, x, rtol=0, atol=1e-12)


def test_prime_sizes_get_real_chunks_not_chunk_one():
    layout = BlockLayout([(97, 89)], chunk=16)
    (group,) = layout.groups
    assert group.block_shape == (16, 16)
    assert group.num_blocks == math.ceil(97 / 16) * math.ceil(89 / 16)
    assert group.real == 97 * 89


def test_2d_block_equals_matrix_dct_of_that_block():
    x = torch.randn(8, 8, dtype=torch.float64)
    layout = BlockLayout([(8, 8)], chunk=4)
    coeffs = layout.encode(x.reshape(-1))[0]
    d = cosine_formula(4)
    # block (0, 1) = rows 0..3, cols 4..7
    torch.testing.assert_close(coeffs[1], d @ x[:4, 4:] @ d.T)


def test_energy_preserved_without_padding():
    layout = BlockLayout([(32, 48), (64,)], chunk=16)
    x = torch.randn(layout.numel, dtype=torch.float64)
    energy = sum(c.pow(2).sum() for c in layout.encode(x))
    torch.testing.assert_close(energy, x.pow(2).sum())


def test_wrong_size_and_bad_chunk_fail():
    with pytest.raises(ValueError, match="^chunk must be an integer >= 1, got 0$"):
        BlockLayout([(4, 4)], chunk=0)
    with pytest.raises(ValueError, match="^n must be an integer >= 1, got 0$"):
        dct_basis(0)
    with pytest.raises(ValueError, match="elements"):
        BlockLayout([(4, 4)], chunk=2).encode(torch.zeros(15))
