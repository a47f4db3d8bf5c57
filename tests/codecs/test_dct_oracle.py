"""The rewritten DeMo codec against the pre-rewrite implementation (``reference_dct_codec.py``), bit for bit.

Block layout, encode, decode, and whole ``dct`` replicator steps (error feedback, all-gather of two
workers, scatter-mean, decode) over several steps, so buffers reused across steps are covered too.
Shapes include padded matrices, short and prime vectors, higher-rank tensors and blocks smaller than
the chunk.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from quietsync.codecs import BlockLayout
from quietsync.replicators import DCTReplicator, Segments
from tests.codecs.reference_dct_codec import RefBlockLayout, RefDCTCodec

SHAPES = [(64, 64), (17, 23), (13,), (97,), (3, 4, 5), (1, 31), (29, 1), (128, 8), (5, 7, 11), (), (70, 130),
          (256,), (96, 64)]


def _exact(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a, b), f"max abs difference {(a - b).abs().max().item()}"


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_encode_decode_bit_identical_to_reference(chunk):
    new, ref = BlockLayout(SHAPES, chunk), RefBlockLayout(SHAPES, chunk)
    assert [(g.block_shape, g.num_blocks, g.real) for g in new.groups] == \
        [(g.block_shape, g.num_blocks, g.real) for g in ref.groups]
    x = torch.randn(new.numel, generator=torch.Generator().manual_seed(chunk))
    enc_new, enc_ref = new.encode(x), ref.encode(x)
    for a, b in zip(enc_new, enc_ref):
        _exact(a, b)
    coeffs = [torch.randn_like(c) for c in enc_ref]
    _exact(new.decode(coeffs), ref.decode(coeffs))


class _TwoWorkers:
    """A transport of two workers: this one and a fixed peer whose payload is set per step."""

    def __init__(self) -> None:
        self.peer: torch.Tensor | None = None

    def group_size(self, group: str) -> int:
        return 2

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: str, **_: Any) -> None:
        out.view(2, -1).copy_(torch.stack([inp, self.peer]))


@pytest.mark.parametrize("chunk,topk,transfer", [(16, None, "fp32"), (8, 5, "fp32"), (64, None, "bf16"),
                                                 (4, 16, "fp32")])
def test_replicator_steps_bit_identical_to_reference(chunk, topk, transfer):
    segments = Segments(SHAPES)
    transport = _TwoWorkers()
    rep = DCTReplicator(compression=1 / 16, transfer_dtype=transfer, transport=transport, group="world",
                        chunk=chunk, topk=topk)
    ref = RefDCTCodec(SHAPES, chunk, rep.ks(segments), rep.transfer_dtype)
    gen = torch.Generator().manual_seed(chunk)
    delta_new = torch.randn(segments.numel, generator=gen)
    delta_ref = delta_new.clone()
    peer_delta = torch.randn(segments.numel, generator=gen)
    for _ in range(4):
        grad = torch.randn(segments.numel, generator=gen)
        peer_delta.mul_(0.9).add_(torch.randn(segments.numel, generator=gen))
        peer = ref.extract(peer_delta)
        peer_delta.sub_(peer.sent)
        transport.peer = peer.payload
        # reference step (the base class's replicate: extract, error feedback, exchange)
        delta_ref.mul_(0.9).add_(grad)
        msg = ref.extract(delta_ref)
        delta_ref.sub_(msg.sent)
        update_ref = ref.exchange(torch.stack([msg.payload, peer.payload]), 2, msg)
        # rewritten step
        delta_new.mul_(0.9).add_(grad)
        update_new = rep.replicate(delta_new, segments)
        _exact(delta_new, delta_ref)
        _exact(update_new, update_ref)


def test_extract_and_exchange_api_still_match_reference():
    segments = Segments(SHAPES)
    transport = _TwoWorkers()
    rep = DCTReplicator(compression=1 / 8, transport=transport, group="world", chunk=8)
    ref = RefDCTCodec(SHAPES, 8, rep.ks(segments))
    x = torch.randn(segments.numel, generator=torch.Generator().manual_seed(3))
    msg_new, msg_ref = rep.extract(x, segments), ref.extract(x)
    _exact(msg_new.payload, msg_ref.payload)
    _exact(msg_new.sent, msg_ref.sent)
    transport.peer = ref.extract(x.flip(0)).payload
    _exact(rep.exchange(msg_new, segments), ref.exchange(torch.stack([msg_ref.payload, transport.peer]), 2, msg_ref))
