"""Tiles of a block layout: every stacked block in exactly one tile, in order; moving a tile's blocks in and out
of the segments' own layouts is the whole-layout move restricted to those blocks."""

import pytest
import torch

from quietsync.wire.codecs import BlockLayout

SHAPES = [(384, 384), (100, 70), (4096, 384), (384,), (7,), (130, 3, 2), (64, 1536), (5,)]


@pytest.mark.parametrize("max_elements", [1, 4096, 5 * 4096, 2**18, 2**30])
def test_tiles_cover_every_block_once_in_order(max_elements):
    layout = BlockLayout(SHAPES, 64)
    tiles = layout.tiles(max_elements)
    for gi, g in enumerate(layout.groups):
        mine = [t for t in tiles if t.group == gi]
        assert mine[0].first == 0 and sum(t.count for t in mine) == g.num_blocks
        assert all(a.first + a.count == b.first for a, b in zip(mine, mine[1:]))
        for t in mine:
            assert sum((r1 - r0) * p.nc for p, r0, r1 in t.pieces) == t.count
            # a tile is over its budget only when one piece (a block row, a vector, a padded matrix) is
            assert t.count <= max(1, max_elements // g.block_numel) or len(t.pieces) == 1


@pytest.mark.parametrize("max_elements", [4096, 3 * 4096, 2**18])
def test_tile_moves_equal_the_whole_layout_moves(max_elements):
    layout = BlockLayout(SHAPES, 64)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen) for s in SHAPES]
    flat = torch.cat([g.reshape(-1) for g in grads])
    whole = layout.empty_blocks(torch.float32, "cpu")
    layout.gather_blocks(grads, whole)
    back = torch.zeros(layout.numel)
    for t in layout.tiles(max_elements):
        for src in (grads, flat):
            mine = torch.full((t.count, *layout.groups[t.group].block_shape), float("nan"))
            layout.tile_gather(t, src, mine)
            assert torch.equal(mine, whole[t.group][t.first : t.first + t.count])  # padding written as zeros
        layout.tile_scatter(t, whole[t.group][t.first : t.first + t.count], back)
    assert torch.equal(back, flat)
