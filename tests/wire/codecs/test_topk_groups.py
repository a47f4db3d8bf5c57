"""The top-k that DeMo sends picks, row by row, the k largest magnitudes -- the same set a full sort names --
also through its search among the k groups with the largest maxima, and gives ties and NaN rows the positions
the plain introselect over the whole row gives."""

import numpy as np
import pytest
import torch

from quietsync.wire.codecs import topk_picks, topk_positions


def _largest(row: np.ndarray, k: int) -> set[int]:
    """The k largest-magnitude positions by a stable full sort (the reference; unique where no tie at the k-th)."""
    return set(np.argsort(-np.abs(row), kind="stable")[:k].tolist())


@pytest.mark.parametrize("blocks,n,k", [(300, 4096, 85), (200, 4096, 1), (500, 64, 2), (40, 1024, 30), (9, 16, 3)])
def test_same_set_as_a_full_sort(blocks, n, k):
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(blocks, n, generator=gen) * torch.rand(blocks, 1, generator=gen)  # scales differ per row
    pos = topk_positions(x, k)
    assert pos.shape == (blocks, k) and pos.dtype == torch.long
    for row, picked in zip(x.numpy(), pos.tolist()):
        assert set(picked) == _largest(row, k)


def test_ties_and_nan_rows_get_the_introselect_positions():
    n, k = 4096, 85
    x = torch.randn(8, n, generator=torch.Generator().manual_seed(0))
    x[0] = 0.0  # every entry ties
    x[1, :200] = 7.0  # more entries tie at the top than are sent
    x[2, 5] = float("nan")  # NaN counts as largest
    x[3] = x[3].round()  # many ties at the k-th magnitude
    x[4, 0], x[4, 4095] = 100.0, -100.0  # equal magnitudes, both above the k-th: unique
    pos = topk_positions(x, k)
    mag = x.abs().numpy()
    for r in range(8):
        introselect = np.argpartition(mag[r], n - k)[n - k:]
        assert set(pos[r].tolist()) == set(introselect.tolist())
    assert 5 in pos[2].tolist() and {0, 4095} <= set(pos[4].tolist())


def test_scratch_receives_the_magnitudes():
    x = torch.randn(30, 4096, generator=torch.Generator().manual_seed(1))
    scratch = torch.empty_like(x)
    a = topk_positions(x, 85, scratch=scratch)
    assert torch.equal(scratch, x.abs())
    assert [set(r) for r in a.tolist()] == [set(r) for r in topk_positions(x, 85).tolist()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("blocks,n,k", [(300, 4096, 85), (200, 4096, 1), (40, 1024, 30), (9, 16, 3), (5, 64, 64)])
def test_picks_are_the_positions_and_the_values_there(blocks, n, k, dtype):
    # what the extract sends: topk_positions' positions, in the same order, and the signed entries there, bit for
    # bit -- also on rows of ties, NaN, -0.0 and -inf, which fall back to the row's introselect
    gen = torch.Generator().manual_seed(blocks + n + k)
    x = (torch.randn(blocks, n, generator=gen) * torch.rand(blocks, 1, generator=gen)).to(dtype)
    if blocks >= 9:
        x[0] = 0.0
        x[1, : n // 2] = 7.0
        x[2, 5] = float("nan")
        x[3] = x[3].round()
        x[4] = -0.0
        x[5, 3] = -float("inf")
    pos, values = topk_picks(x, k)
    expected = topk_positions(x, k)
    assert pos.dtype == torch.long and values.dtype == dtype
    assert torch.equal(pos, expected)
    assert torch.equal(values.nan_to_num(), torch.gather(x, 1, expected).nan_to_num())
    assert torch.equal(values.isnan(), torch.gather(x, 1, expected).isnan())
