"""The activation meter counts what autograd saves, once per storage, and sees it released after backward."""

from __future__ import annotations

import torch

from quietsync.activation_memory import ActivationMeter, exclude_storages


def test_counts_saved_tensors_and_their_release():
    w = torch.randn(64, 64, requires_grad=True)
    meter = ActivationMeter(exclude=exclude_storages(lambda: [w]))
    x = torch.randn(32, 64)
    with meter.track():
        h = torch.tanh(x @ w)  # saves x (mm) and the tanh output; w is excluded
        y = (h * h).sum()      # saves h twice: one storage
    assert meter.current == 2 * 32 * 64 * 4
    meter.sample("forward")
    y.backward()
    assert meter.current == 0 and meter.peak == 2 * 32 * 64 * 4
    s = meter.sample("backward")
    assert s.bytes == 0 and s.peak == 2 * 32 * 64 * 4  # the window's peak includes the forward's high point
    assert [p.label for p in meter.timeline] == ["forward", "backward"]


def test_views_of_one_storage_count_once_and_backward_releases_everything():
    meter = ActivationMeter()
    a = torch.randn(100, requires_grad=True)
    with meter.track():
        b = a * 2
        d = (b[:10] * b[10:20]).sum() + (b[20:30] * b[30:40]).sum()  # four views of b saved: one storage
    assert meter.current == 100 * 4
    d.backward()
    assert meter.current == 0 and meter.peak == 400


def test_nothing_counted_outside_track():
    meter = ActivationMeter()
    a = torch.randn(10, requires_grad=True)
    (a.exp()).sum().backward()
    assert meter.current == 0 and meter.peak == 0
