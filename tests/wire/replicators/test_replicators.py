"""Replicators in one process: error feedback, identity at full top-k, hand-computed payload bytes."""

import math

import pytest
import torch

from quietsync.wire.replicators import (
    DCTReplicator,
    FullReplicator,
    NoReplicator,
    RandomReplicator,
    Segments,
    StridingReplicator,
    make_replicator,
)

SEG = Segments([(40, 70), (33,), (3, 4, 5), (1, 17)])


def all_replicators(**kw):
    return [
        DCTReplicator(chunk=16, **kw),
        RandomReplicator(**kw),
        StridingReplicator(**kw),
        FullReplicator(**kw),
    ]


class Loopback:
    """A replicate group of 2 in which the other worker sends exactly what this one sends."""

    def group_size(self, group):
        return 2

    def all_gather(self, out, inp, group, **_):
        out.view(2, -1).copy_(inp.view(1, -1).expand(2, -1))

    def all_reduce(self, t, group, op="sum", **_):
        if op == "sum":
            t.mul_(2)


@pytest.mark.parametrize("rep", all_replicators(compression=1 / 16) + all_replicators(transfer_dtype="bf16"),
                         ids=lambda r: f"{r.name}-{r.transfer_dtype}")
def test_sent_plus_residual_is_accumulated(rep):
    rep.bind(Loopback(), "replicate")
    delta = torch.randn(SEG.numel)
    before = delta.clone()
    msg = rep.extract(before.clone(), SEG)  # what replicate() is about to send
    if hasattr(rep, "counter"):
        rep.counter -= 1
    update = rep.replicate(delta, SEG)  # delta is now the residual
    torch.testing.assert_close(delta + msg.sent, before, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(update, msg.sent, rtol=1e-6, atol=1e-6)  # both workers sent the same
    assert msg.sent.abs().sum() > 0
    if rep.name in ("random", "striding"):
        idx = msg.meta
        assert torch.count_nonzero(delta[idx] - (before[idx] - before[idx].to(rep.transfer_dtype).float())) == 0
        untouched = torch.ones(SEG.numel, dtype=torch.bool)
        untouched[idx] = False
        assert torch.equal(delta[untouched], before[untouched])
    elif rep.name == "dct":
        assert delta.abs().sum() > 0.5 * before.abs().sum()  # 1/16 of the bytes leaves most behind
    else:
        assert delta.abs().max() <= (2e-2 if rep.transfer_dtype == torch.bfloat16 else 0)


def test_dct_sent_is_exactly_decoded_topk():
    rep = DCTReplicator(chunk=8, compression=1 / 8)
    seg = Segments([(16, 16)])
    delta = torch.randn(seg.numel, dtype=torch.float64)
    msg = rep.extract(delta, seg)
    # independent oracle: DCT matrix from the cosine formula, top-k per 8x8 block by hand
    n = 8
    d = torch.tensor([[(math.sqrt(1 / n) if k == 0 else math.sqrt(2 / n))
                       * math.cos(math.pi * (2 * i + 1) * k / (2 * n))
                       for i in range(n)] for k in range(n)], dtype=torch.float64)
    (k,) = rep.ks(seg, torch.float64)
    x = delta.reshape(16, 16)
    want = torch.zeros_like(x)
    for br in range(2):
        for bc in range(2):
            c = d @ x[br * 8:(br + 1) * 8, bc * 8:(bc + 1) * 8] @ d.T
            keep = torch.zeros(64, dtype=torch.float64)
            top = c.reshape(-1).abs().argsort(descending=True)[:k]
            keep[top] = c.reshape(-1)[top]
            want[br * 8:(br + 1) * 8, bc * 8:(bc + 1) * 8] = d.T @ keep.reshape(8, 8) @ d
    torch.testing.assert_close(msg.sent.reshape(16, 16), want)


def test_dct_topk_of_every_coefficient_is_identity():
    rep = DCTReplicator(chunk=8, topk=64)
    delta = torch.randn(SEG.numel, dtype=torch.float64)
    msg = rep.extract(delta, SEG)
    # values travel as fp32: identity up to that rounding
    torch.testing.assert_close(msg.sent, delta, rtol=1e-6, atol=1e-6)
    assert msg.sent.count_nonzero() == SEG.numel


def test_payload_bytes_hand_computation():
    seg = Segments([(64, 64), (100,)])  # 4096 + 100 elements, fp32 = 16784 bytes
    full_bytes = (4096 + 100) * 4
    r = 1 / 16
    # random/striding: floor(r * full / value_bytes) values
    assert RandomReplicator(compression=r).payload_bytes(seg) == (full_bytes // 16 // 4) * 4
    assert StridingReplicator(compression=r, transfer_dtype="bf16").payload_bytes(seg) == (full_bytes // 16 // 2) * 2
    # dct, chunk 32: 4 blocks of 32x32 (int16 positions: 1024 > 256) and 100 -> 4 blocks of 32 (uint8)
    rep = DCTReplicator(chunk=32, compression=r)
    k2 = round(r * 4096 * 4 / (4 * (4 + 2)))  # 43
    k1 = round(r * 100 * 4 / (4 * (4 + 1)))  # 1
    assert rep.ks(seg) == [k2, k1]
    assert rep.payload_bytes(seg) == 4 * k2 * (4 + 2) + 4 * k1 * (4 + 1)
    # explicit topk: DeMo's knob, k per block regardless of compression
    assert DCTReplicator(chunk=32, topk=8).payload_bytes(seg) == 4 * 8 * 6 + 4 * 8 * 5
    assert FullReplicator(transfer_dtype="fp16").payload_bytes(seg) == (4096 + 100) * 2
    assert NoReplicator().payload_bytes(seg) == 0


@pytest.mark.parametrize("r", [1 / 16, 1 / 32, 1 / 64])
@pytest.mark.parametrize("name", ["dct", "random", "striding"])
def test_compression_knob_means_bytes_ratio(name, r):
    seg = Segments([(256, 512), (512, 256), (512,)])
    rep = make_replicator(name, compression=r, chunk=64)
    assert rep.achieved_compression(seg) == pytest.approx(r, rel=0.05)


def test_random_indices_depend_on_seed_and_counter_only():
    a, b = RandomReplicator(compression=0.1, seed=3), RandomReplicator(compression=0.1, seed=3)
    assert torch.equal(a.indices(SEG, 5), b.indices(SEG, 5))
    assert not torch.equal(a.indices(SEG, 5), a.indices(SEG, 6))
    idx = a.indices(SEG, 0)
    assert idx.unique().numel() == idx.numel() == a.count(SEG)
    assert idx.min() >= 0 and idx.max() < SEG.numel


def test_striding_rotates_and_covers_everything():
    rep = StridingReplicator(compression=0.25)
    seen = torch.zeros(SEG.numel, dtype=torch.bool)
    stride = SEG.numel // rep.count(SEG)
    for t in range(2 * stride):
        idx = rep.indices(SEG, t)
        assert idx.unique().numel() == idx.numel()
        seen[idx] = True
    assert seen.all()


def test_world_of_one_hands_back_whole_delta():
    for rep in all_replicators(compression=1 / 16) + [NoReplicator()]:
        delta = torch.randn(SEG.numel)
        want = delta.clone()
        update = rep.replicate(delta, SEG)
        assert torch.equal(update, want) and torch.count_nonzero(delta) == 0


def test_bad_knobs_fail_clearly():
    with pytest.raises(ValueError, match="compression must be in"):
        RandomReplicator(compression=0)
    with pytest.raises(ValueError, match="compression must be in"):
        DCTReplicator(compression=1.5)
    with pytest.raises(ValueError, match=r"topk must be an integer in \[1, 16\] or None, got 17"):
        DCTReplicator(chunk=4, topk=17)
    with pytest.raises(ValueError, match="chunk must be an integer >= 1, got 0"):
        DCTReplicator(chunk=0)
    with pytest.raises(ValueError, match="seed must be an integer, got 1.5"):
        RandomReplicator(seed=1.5)
    with pytest.raises(ValueError, match="transfer_dtype"):
        FullReplicator(transfer_dtype="int8")
    with pytest.raises(ValueError, match="replicator must be one of"):
        make_replicator("gossip")


def test_each_replicator_declares_the_knobs_its_init_takes():
    import inspect

    from quietsync.wire.replicators import REPLICATORS

    for cls in REPLICATORS.values():
        params = set(inspect.signature(cls.__init__).parameters) - {"self"}
        assert set(cls.knobs) <= params, cls


def test_make_replicator_passes_each_class_its_own_knobs():
    knobs = {"compression": 1 / 8, "transfer_dtype": "bf16", "chunk": 4, "topk": 3, "seed": 7}
    dct = make_replicator("dct", **knobs)
    assert (dct.chunk, dct.topk, dct.compression, dct.transfer_dtype) == (4, 3, 1 / 8, torch.bfloat16)
    rnd = make_replicator("random", **knobs)
    assert rnd.seed == 7 and rnd.compression == 1 / 8
    assert make_replicator("striding", **knobs).seed == 0  # striding has no seed: not passed on
    assert make_replicator("full", **knobs).transfer_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="got colour$"):  # a knob no replicator declares
        make_replicator("full", colour="red")


def test_make_replicator_reads_knobs_from_the_class(monkeypatch):
    from quietsync.wire.replicators import REPLICATORS

    class Gossip(FullReplicator):
        name = "gossip"
        knobs = (*FullReplicator.knobs, "fanout")

        def __init__(self, fanout: int = 1, **kw):
            super().__init__(**kw)
            self.fanout = fanout

    monkeypatch.setitem(REPLICATORS, "gossip", Gossip)
    rep = make_replicator("gossip", fanout=3, chunk=4, compression=1 / 2)
    assert rep.fanout == 3 and rep.compression == 1 / 2
    assert not hasattr(make_replicator("dct", fanout=3), "fanout")
