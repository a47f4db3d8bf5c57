"""DeMo's update taken one phase at a time (begin_step, momentum, extract, exchange, apply -- how the ``demo``
strategy spells it) is the optimizer's own ``step()``, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from quietsync.optim import DecoupledAdamW, DeMoSGD


class _Mirror:
    """A replicate group of two whose peer sends this worker's own payload, negated and halved where it can be
    (so the mean is not the worker's own values)."""

    def group_size(self, group: str) -> int:
        return 2

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: str, **_: Any) -> None:
        out.view(2, -1).copy_(inp.expand(2, -1))

    def all_reduce(self, t: torch.Tensor, group: str, op: str = "sum", **_: Any) -> None:
        t.mul_(0.25) if op == "avg" else t.mul_(0.5)


def _phases(opt: Any) -> None:
    step = opt.begin_step()
    if step is None:
        return
    if step.replicates:
        opt.momentum(step)
        update = opt.exchange(step, opt.extract(step))
    else:
        update = opt.local_update(step)
    opt.apply(step, update)


@pytest.mark.parametrize("cls", [DeMoSGD, DecoupledAdamW])
@pytest.mark.parametrize("replicator", ["dct", "random", "full"])
def test_phases_equal_step(cls, replicator):
    def run(by_phases: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in [(70, 130), (9,), (4, 3, 5)]]
        opt = cls([{"params": params[:2]}, {"params": params[2:], "lr": 0.05}], lr=0.1, replicator=replicator,
                  transport=_Mirror(), group="world", replicate_every=2, sign=replicator != "full",
                  replicator_kwargs={"compression": 1 / 8, "chunk": 16})
        gen = torch.Generator().manual_seed(3)
        for _ in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            _phases(opt) if by_phases else opt.step()
        return [p.detach().clone() for p in params] + [opt.state[p]["delta"].clone() for p in params]

    a, b = run(True), run(False)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], run_untrained())


def run_untrained() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(70, 130)
