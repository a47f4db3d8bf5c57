"""``random`` / ``striding``: the fused replicate (no dense ``sent``) equals extract + error feedback + exchange."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from quietsync.replicators import Replicator, Segments, make_replicator


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
    for _ in range(5):
        g = torch.randn(segments.numel, generator=gen)
        peer = torch.randn(fast.count(segments), generator=gen).to(fast.transfer_dtype)
        tr_fast.peer, tr_ref.peer = peer, peer
        d_fast.add_(g)
        d_ref.add_(g)
        up_fast = fast.replicate(d_fast, segments)
        up_ref = Replicator.replicate(ref, d_ref, segments)
        assert torch.equal(d_fast, d_ref) and torch.equal(up_fast, up_ref)
    assert fast.counter == ref.counter == 5
