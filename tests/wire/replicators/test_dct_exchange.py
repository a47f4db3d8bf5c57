"""The dct exchange, tile by tile: unpadded matrices are summed and decoded in their own layout, the rest through
stacked blocks; either way the update is, bit for bit, the whole-layout decode of every coefficient's mean over the
workers that sent it, and ``sign=True`` gives exactly its sign."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from quietsync.wire.codecs import scatter_mean, unpack
from quietsync.wire.replicators import DCTReplicator, Segments
from quietsync.wire.replicators import dct as dct_module

# unpadded matrices (own layout, several block rows), a padded one, vectors, a 3-D tensor viewed as a matrix
SHAPES = [(384, 384), (100, 70), (4096, 384), (384,), (7,), (130, 3, 2), (64, 1536), (5,)]


class _Pair:
    """A replicate group of two: the peer's payload is set by the test."""

    def __init__(self) -> None:
        self.peer: torch.Tensor | None = None

    def group_size(self, group: str) -> int:
        return 2

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: str, **_: Any) -> None:
        out.view(2, -1)[0].copy_(inp)
        out.view(2, -1)[1].copy_(self.peer)


def _momentum(rep: DCTReplicator, segments: Segments, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return rep.momentum_from_spatial(torch.randn(segments.numel, generator=gen), segments)


@pytest.mark.parametrize("tile_elements", [4096, 3 * 4096, 2**18])
def test_tiled_exchange_is_the_whole_layout_mean_decoded(monkeypatch, tile_elements):
    monkeypatch.setattr(dct_module, "_TILE_ELEMENTS", tile_elements)
    segments = Segments(SHAPES)
    pair = _Pair()
    mine = DCTReplicator(compression=1 / 16, chunk=64, transport=pair, group="world")
    theirs = DCTReplicator(compression=1 / 16, chunk=64, transport=_Pair(), group="world")
    sent_b = theirs.extract_momentum(_momentum(theirs, segments, 1), segments)
    sent_a = mine.extract_momentum(_momentum(mine, segments, 0), segments)
    pair.peer = sent_b.payload

    got = mine.exchange_momentum(sent_a, segments).clone()
    signed = mine.exchange_momentum(sent_a, segments, sign=True).clone()

    # the whole layout at once: unpack both payloads, mean per coefficient over its senders, one decode
    specs, dtype = sent_a.meta
    tensors = unpack(torch.stack([sent_a.payload, sent_b.payload]), specs)
    layout = mine.layout(segments)
    means = [scatter_mean(tensors[2 * i], tensors[2 * i + 1], g.block_numel, dtype=dtype).view(-1, *g.block_shape)
             for i, g in enumerate(layout.groups)]
    want = layout.decode(means)
    # the two workers picked different coefficients, so some were sent by one worker only and some by both
    assert not torch.equal(tensors[1][0], tensors[1][1])
    assert torch.equal(got, want)
    assert torch.equal(signed, want.sign())


def test_the_exchange_check_can_fail():
    # a mean decoded from other coefficients differs: the equality above is not vacuous
    segments = Segments(SHAPES)
    pair = _Pair()
    rep = DCTReplicator(compression=1 / 16, chunk=64, transport=pair, group="world")
    other = DCTReplicator(compression=1 / 16, chunk=64, transport=_Pair(), group="world")
    sent = rep.extract_momentum(_momentum(rep, segments, 0), segments)
    pair.peer = other.extract_momentum(_momentum(other, segments, 1), segments).payload
    a = rep.exchange_momentum(sent, segments).clone()
    pair.peer = other.extract_momentum(_momentum(other, segments, 2), segments).payload
    assert not torch.equal(a, rep.exchange_momentum(sent, segments))
