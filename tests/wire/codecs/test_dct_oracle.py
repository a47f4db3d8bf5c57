"""The ``dct`` replicator and its block layout against the fp64 oracle of paper 001 (``reference_demo.py``,
DeMo's equations written independently: nothing there imports quietsync).

Per tensor, through the library's public entry points: the DCT-II coefficients of every block
(``momentum_views`` of ``momentum_from_spatial``) and the inverse (``momentum_to_spatial``); whole replicator
steps of two workers -- top-k per block, error feedback, all-gather, the mean over the senders, decoding -- over
several steps, through the spatial entry point (DiLoCo's) and with the momentum kept in the DCT domain (the
optimizers'), in fp64 to 1e-12 (bf16 transfer included) and in fp32 within rounding. Shapes include padded
matrices, short vectors, higher-rank tensors, a scalar and blocks smaller than the chunk, but no padded block
holding a single row or element: its coefficients come in pairs of exactly equal magnitude (``D[0,0] =
D[n/2,0]`` for an even block), where any choice is right and two implementations may choose differently. Each
comparison checks the data leaves rounding no room to pick another coefficient (the relative gap between the
k-th and k+1-th magnitude of every block).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from quietsync.wire.codecs import BlockLayout
from quietsync.wire.replicators import DCTReplicator, Segments
from tests.strategies.helpers.reference_demo import Blocking, DCTReference, ks_from_compression

SHAPES = [(64, 64), (18, 22), (14,), (98,), (3, 4, 5), (1, 31), (30, 1), (128, 8), (6, 7, 10), (), (70, 130),
          (256,), (96, 64)]
CHUNKS = [4, 8, 16]
SMALL = [s for s in SHAPES if math.prod(s) <= 600]
"""The shapes of the fp32 comparisons: fewer blocks, so none comes within fp32 rounding of a top-k tie."""


def _split(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    return [t.reshape(s) for t, s in zip(flat.split([math.prod(s) for s in shapes]), shapes)]


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def test_shapes_hold_no_single_row_padded_block():
    for chunk in CHUNKS:
        for shape in SHAPES:
            b = Blocking(shape, chunk)
            assert all(d % blk != 1 or blk % 2 for d, blk in zip(b.dims, b.block)), (shape, chunk)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_coefficients_and_inverse_per_tensor_match_the_oracle(chunk):
    segments = Segments(SHAPES)
    rep = DCTReplicator(chunk=chunk)
    x = torch.randn(segments.numel, generator=torch.Generator().manual_seed(chunk), dtype=torch.float64)
    views = rep.momentum_views(rep.momentum_from_spatial(x, segments), segments)
    coeffs = []
    for shape, view, t in zip(SHAPES, views, _split(x, SHAPES)):
        want = Blocking(shape, chunk).encode(t)  # (blocks, block_numel), blocks row-major over the grid
        torch.testing.assert_close(view.reshape(want.shape), want, rtol=0, atol=1e-12)
        coeffs.append(torch.randn(want.shape, dtype=torch.float64))
    momentum = torch.zeros(rep.momentum_numel(segments), dtype=torch.float64)
    for view, c in zip(rep.momentum_views(momentum, segments), coeffs):
        view.copy_(c.reshape(view.shape))
    decoded = rep.momentum_to_spatial(momentum, segments)
    want = _flat([Blocking(s, chunk).decode(c) for s, c in zip(SHAPES, coeffs)])
    torch.testing.assert_close(decoded, want, rtol=0, atol=1e-12)


class _TwoWorkers:
    """A transport of two workers: this one and a peer whose payload is set per step."""

    def __init__(self) -> None:
        self.peer: torch.Tensor | None = None

    def group_size(self, group: str) -> int:
        return 2

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: str, **_: Any) -> None:
        out.view(2, -1).copy_(torch.stack([inp, self.peer]))


CASES = [(16, None, "fp32"), (8, 5, "fp32"), (16, None, "bf16"), (4, 16, "fp32"), (4, 3, "bf16")]
DTYPES = {torch.float64: {"rtol": 0, "atol": 1e-12}, torch.float32: {"rtol": 1e-5, "atol": 1e-6}}
"""Tolerance of the update and residual against the fp64 oracle: the library's rounding (fp32: measured 1.2e-6
relative on values up to ~3, sums of up to 256 products). A coefficient selected otherwise moves some value by
O(1)."""
MARGINS = {torch.float64: 1e-9, torch.float32: 2e-6}
"""The least relative gap between the k-th and k+1-th magnitude of any block the data must keep: many times the
rounding of the library's coefficients (fp32: ~1e-6 relative at most), so it cannot pick another one."""


def _setup(chunk: int, topk: int | None, transfer: str, dtype: torch.dtype):
    """The shapes, the replicator under test and its peer (whose payload the fake transport hands over) on two
    workers, and the oracle with the same k per block."""
    if dtype == torch.float32 and transfer == "bf16":
        pytest.skip("bf16 rounding of fp32 values that differ from fp64 by rounding may land on the neighbouring "
                    "bf16 number: covered in fp64")
    shapes = SHAPES if dtype == torch.float64 else SMALL
    segments = Segments(shapes)
    transport = _TwoWorkers()
    rep = DCTReplicator(compression=1 / 16, transfer_dtype=transfer, transport=transport, group="world",
                        chunk=chunk, topk=topk)
    peer = DCTReplicator(compression=1 / 16, transfer_dtype=transfer, chunk=chunk, topk=topk)
    # k per block: the given topk (at most the block), else the bandwidth rule, checked below against the library's
    if topk is not None:
        ks = [min(topk, math.prod(Blocking(s, chunk).block)) for s in shapes]
    else:
        value_bytes = 2 if transfer == "bf16" else 4
        ks = ks_from_compression(shapes, chunk, 1 / 16, value_bytes=value_bytes, grad_bytes=dtype.itemsize)
    oracle = DCTReference(shapes, chunk, ks, transfer=rep.transfer_dtype)
    library_ks = {g.block_shape: k for g, k in zip(rep.layout(segments).groups, rep.ks(segments, dtype))}
    assert library_ks == {Blocking(s, chunk).block: k for s, k in zip(shapes, ks)}
    return shapes, segments, transport, rep, peer, oracle


def _margin_ok(oracle: DCTReference, dtype: torch.dtype) -> None:
    assert oracle.margins.topk_gap > MARGINS[dtype], f"near-tie in some block's top-k: {oracle.margins.topk_gap:.2g}"


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("chunk,topk,transfer", CASES)
def test_spatial_replicate_steps_match_the_oracle(chunk, topk, transfer, dtype):
    """``replicate`` on a spatial residual (how DiLoCo's outer step calls it): each step the oracle selects both
    workers' coefficients from their residuals, keeps the rest, averages what was sent over the senders and
    decodes -- the library's update and residual equal it, step after step."""
    shapes, segments, transport, rep, peer, oracle = _setup(chunk, topk, transfer, dtype)
    gen = torch.Generator().manual_seed(chunk)
    delta = torch.randn(segments.numel, generator=gen, dtype=dtype)
    peer_delta = torch.randn(segments.numel, generator=gen, dtype=dtype)
    ref = [_split(delta.double().clone(), shapes), _split(peer_delta.double().clone(), shapes)]
    for _ in range(4):
        grad = torch.randn(segments.numel, generator=gen, dtype=dtype)
        peer_grad = torch.randn(segments.numel, generator=gen, dtype=dtype)
        delta.mul_(0.9).add_(grad)
        peer_delta.mul_(0.9).add_(peer_grad)
        msg = peer.extract(peer_delta, segments)  # the peer's message, as the peer's library sends it
        peer_delta.sub_(msg.sent)
        transport.peer = msg.payload
        update = rep.replicate(delta, segments)
        # the oracle
        ref = [[0.9 * d + g for d, g in zip(ref[0], _split(grad.double(), shapes))],
               [0.9 * d + g for d, g in zip(ref[1], _split(peer_grad.double(), shapes))]]
        qs = [oracle.extract(r) for r in ref]
        ref = [[d - s for d, s in zip(r, oracle.sent(q))] for r, q in zip(ref, qs)]
        want = _flat(oracle.average(qs))
        _margin_ok(oracle, dtype)
        torch.testing.assert_close(update.double(), want, **DTYPES[dtype])
        torch.testing.assert_close(delta.double(), _flat(ref[0]), **DTYPES[dtype])
        torch.testing.assert_close(peer_delta.double(), _flat(ref[1]), **DTYPES[dtype])


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("chunk,topk,transfer", CASES)
def test_momentum_kept_in_dct_domain_matches_the_oracle(chunk, topk, transfer, dtype):
    """The optimizers' path: momentum as DCT coefficients, ``C <- beta C + s DCT(g)`` with two parameter groups'
    rules interleaved, error feedback by zeroing what was sent (padded blocks projected back), one inverse
    transform of the mean -- equal to the oracle's spatial momentum step, in update and residual."""
    shapes, segments, transport, rep, peer, oracle = _setup(chunk, topk, transfer, dtype)
    gen = torch.Generator().manual_seed(chunk + 1)
    start = torch.randn(segments.numel, generator=gen, dtype=dtype)
    momentum = rep.momentum_from_spatial(start, segments)
    assert momentum.numel() == rep.momentum_numel(segments) >= segments.numel  # padding has coefficients too
    peer_delta = torch.randn(segments.numel, generator=gen, dtype=dtype)
    ref = [_split(start.double().clone(), shapes), _split(peer_delta.double().clone(), shapes)]
    betas = [0.9 if i % 2 else 0.8 for i in range(len(shapes))]
    scales = [0.5 if i % 2 else 1.0 for i in range(len(shapes))]
    for _ in range(4):
        grads = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
        peer_grad = torch.randn(segments.numel, generator=gen, dtype=dtype)
        peer_delta.mul_(0.9).add_(peer_grad)
        msg = peer.extract(peer_delta, segments)
        peer_delta.sub_(msg.sent)
        transport.peer = msg.payload
        rep.accumulate(momentum, segments, grads, betas, scales)
        update = rep.replicate_momentum(momentum, segments)
        ref = [[b * d + s * g.double() for d, g, b, s in zip(ref[0], grads, betas, scales)],
               [0.9 * d + g for d, g in zip(ref[1], _split(peer_grad.double(), shapes))]]
        qs = [oracle.extract(r) for r in ref]
        ref = [[d - s for d, s in zip(r, oracle.sent(q))] for r, q in zip(ref, qs)]
        want = _flat(oracle.average(qs))
        _margin_ok(oracle, dtype)
        torch.testing.assert_close(update.double(), want, **DTYPES[dtype])
        torch.testing.assert_close(rep.momentum_to_spatial(momentum, segments).double(), _flat(ref[0]),
                                   **DTYPES[dtype])


def test_padded_blocks_keep_no_energy_in_their_padding():
    """After error feedback in the DCT domain, every padded block still decodes to zeros in its padding."""
    shapes = [(70, 130), (97,), (5, 7, 11)]
    segments = Segments(shapes)
    transport = _TwoWorkers()
    rep = DCTReplicator(compression=1 / 4, transport=transport, group="world", chunk=16)
    layout = rep.layout(segments)
    momentum = rep.momentum_from_spatial(torch.randn(segments.numel), segments)
    transport.peer = rep.extract(torch.randn(segments.numel), segments).payload
    rep.replicate_momentum(momentum, segments)
    blocks = [BlockLayout.transform(c, g.block_shape, inverse=True)
              for g, c in zip(layout.groups, layout.stacked_views(momentum))]
    real = layout.empty_blocks(torch.float32, "cpu")
    layout.gather_blocks(torch.ones(segments.numel), real)  # 1 where a block holds the tensor, 0 in padding
    for b, r in zip(blocks, real):
        assert (r == 0).any()  # there is padding to check
        assert b[r == 0].abs().max() < 1e-5


def test_extract_and_exchange_match_the_oracle():
    """The message API: what ``extract`` says was sent decodes to the oracle's top-k; ``exchange`` is the mean over
    the senders of both workers' messages, decoded."""
    segments = Segments(SHAPES)
    transport = _TwoWorkers()
    rep = DCTReplicator(transport=transport, group="world", chunk=8, topk=6)
    oracle = DCTReference(SHAPES, 8, [min(6, math.prod(Blocking(s, 8).block)) for s in SHAPES])
    x = torch.randn(segments.numel, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    y = x.flip(0) + torch.randn(segments.numel, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    mine, theirs = rep.extract(x, segments), rep.extract(y, segments)
    qx, qy = oracle.extract(_split(x, SHAPES)), oracle.extract(_split(y, SHAPES))
    _margin_ok(oracle, torch.float64)
    torch.testing.assert_close(mine.sent, _flat(oracle.sent(qx)), rtol=0, atol=1e-12)
    transport.peer = theirs.payload
    torch.testing.assert_close(rep.exchange(mine, segments), _flat(oracle.average([qx, qy])), rtol=0, atol=1e-12)
