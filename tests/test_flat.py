"""Flat buffers: parameters become views, padding, shards, group slices, gradient views."""

import pytest
import torch

from quietsync import FlatParams
from quietsync.strategies.parts.lr import LRScaler
from quietsync.strategies.substrates.sharded_optimizer import ShardedOptimizer
from tests.strategies.helpers.common import param_groups, tiny_model


def test_parameters_become_views_of_one_padded_buffer():
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    flat = FlatParams(param_groups(model), pad_to=4)
    assert flat.numel == 174 and flat.padded_numel == 176
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    with torch.no_grad():
        flat.data.zero_()
    assert all(torch.all(p == 0) for p in model.parameters())


def test_gradients_accumulate_into_the_buffer():
    model = tiny_model()
    flat = FlatParams(model.parameters(), pad_to=3)
    grads = flat.new_grad_buffer()
    flat.attach_grads(grads)
    x = torch.randn(2, 7)
    model(x).sum().backward()
    model(x).sum().backward()
    reference = tiny_model()
    (2 * reference(x).sum()).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    torch.testing.assert_close(grads[: flat.numel], expected)
    assert torch.all(grads[flat.numel:] == 0)
    assert flat.grads_attached_to(grads)
    model.zero_grad(set_to_none=True)
    assert not flat.grads_attached_to(grads)


def test_shards_and_group_slices():
    model = tiny_model()
    flat = FlatParams(param_groups(model), pad_to=4)  # weights 156 elements, biases 18
    assert flat.shard_bounds(3, 4) == (132, 176)
    assert flat.group_slices(132, 176) == [(0, 24), (24, 42)]
    assert flat.group_slices(0, 44) == [(0, 44), (0, 0)]
    with pytest.raises(ValueError, match="do not divide"):
        flat.shard_bounds(0, 3)


def test_sharded_optimizer_keeps_group_options():
    model = tiny_model()
    flat = FlatParams(param_groups(model, weight_decay=0.5), pad_to=4)
    opt = ShardedOptimizer(flat, torch.optim.AdamW, {"lr": 1e-3}, index=3, count=4)
    assert [g["weight_decay"] for g in opt.optimizer.param_groups] == [0.5, 0.0]
    LRScaler(opt.optimizer).apply(0.5)
    opt.step()
    assert [g["lr"] for g in opt.optimizer.param_groups] == [5e-4, 5e-4]


def test_bad_inputs():
    with pytest.raises(ValueError, match="at least one parameter that requires grad"):
        FlatParams([torch.nn.Parameter(torch.ones(2), requires_grad=False)])
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="appears twice"):
        FlatParams([{"params": [p]}, {"params": [p]}])
    with pytest.raises(ValueError, match="mixed dtypes"):
        FlatParams([torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2, dtype=torch.float64))])
