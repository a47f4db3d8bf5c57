"""``random`` / ``striding``: the fused replicate (no dense ``sent``, a sparse update) equals extract + error
feedback + exchange, and DeMo-SGD applying that sparse update equals applying it dense, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from quietsync.wire.replicators import Replicator, Segments, make_replicator


class _TwoWorkers:
    """All-reduce of two workers whose peer holds ``peer`` (the same length) this step."""

    def __init__(self) -> None:
        self.peer: torch.Tensor | None = None

    def group_size(self, group: str) -> int:
        return 2

    def all_reduce(self, t: torch.Tensor, group: str, op: str = "sum", **_: Any) -> None:
        t.add_(self.peer).div_(2) if op == "avg" else t.add_(self.peer)


@pytest.mark.parametrize("name", ["random", "striding"])
@pytest.mark.parametrize("transfer", ["fp32", "bf16"])
def test_fused_replicate_equals_base_class_steps(name, transfer):
    segments = Segments([(40, 30), (7,), (5, 3, 2)])
    tr_fast, tr_ref = _TwoWorkers(), _TwoWorkers()
    fast = make_replicator(name, compression=1 / 8, transfer_dtype=transfer, transport=tr_fast, group="world")
    ref = make_replicator(name, compression=1 / 8, transfer_dtype=transfer, transport=tr_ref, group="world")
    gen = torch.Generator().manual_seed(1)
    d_fast = torch.randn(segments.numel, generator=gen)
    d_ref = d_fast.clone()
    for step in range(5):
        g = torch.randn(segments.numel, generator=gen)
        # the peer's values by position: the fast path sends positions in ascending order (every rank alike)
        peer = torch.randn(segments.numel, generator=gen).to(fast.transfer_dtype)
        idx = fast.indices(segments, step)
        tr_fast.peer, tr_ref.peer = peer[idx.sort().values], peer[idx]
        d_fast.add_(g)
        d_ref.add_(g)
        up_fast = fast.replicate(d_fast, segments)
        up_ref = Replicator.replicate(ref, d_ref, segments)
        assert torch.equal(d_fast, d_ref) and torch.equal(up_fast, up_ref)
    assert fast.counter == ref.counter == 5


class _DenseOnly:
    """Wraps a replicator so the optimizer only ever sees dense updates."""

    def __init__(self, rep: Replicator) -> None:
        self.rep = rep

    def __getattr__(self, name: str) -> Any:
        return getattr(self.rep, name)

    def replicate_momentum(self, momentum: torch.Tensor, segments: Segments) -> torch.Tensor:
        return self.rep.replicate(momentum, segments)


@pytest.mark.parametrize("name", ["random", "striding"])
@pytest.mark.parametrize("sign,wd", [(True, 0.0), (False, 0.1)])
def test_sparse_update_applied_by_demo_sgd_equals_dense(name, sign, wd):
    from quietsync.optim import DeMoSGD

    def run(dense: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in [(40, 30), (7,), (5, 3, 2)]]
        tr = _TwoWorkers()
        opt = DeMoSGD([{"params": params[:2]}, {"params": params[2:], "lr": 0.05}], lr=0.1, sign=sign,
                      weight_decay=wd, replicator=name, transport=tr, group="world",
                      replicator_kwargs={"compression": 1 / 8})
        if dense:
            opt.replicator = _DenseOnly(opt.replicator)  # type: ignore[assignment]
        gen = torch.Generator().manual_seed(2)
        for step in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            peer = torch.randn(sum(p.numel() for p in params), generator=gen)
            idx = opt.replicator.indices(Segments([p.shape for p in params]), step)
            tr.peer = peer[idx.sort().values]  # values travel in ascending position order either way
            opt.step()
        return [p.detach().clone() for p in params]

    for a, b in zip(run(dense=False), run(dense=True)):
        assert torch.equal(a, b)
