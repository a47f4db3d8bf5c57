"""The run's end says whether every worker holds the same committed parameters, bit for bit
(``quietsync.train.replicas``): a fingerprint that any one changed bit changes, compared in the end-of-run agreement."""

from __future__ import annotations

import pytest
import torch

import quietsync
from quietsync.train.nonfinite import NonFiniteGuard
from quietsync.train.replicas import fingerprint_row, verdict, warning
from tests.distributed import run_ranks


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(dtype)


def _flip_one_bit(model: torch.nn.Module, which: int, bit: int) -> None:
    p = list(model.parameters())[which]
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[p.element_size()]
    with torch.no_grad():
        p.view(ints).view(-1)[-1] ^= (1 << bit) if bit < 8 * p.element_size() - 1 else -(1 << bit)  # the sign bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_one_flipped_bit_anywhere_changes_the_fingerprint(dtype):
    a = _model(dtype)
    mark = fingerprint_row(a)
    assert fingerprint_row(_model(dtype)) == mark  # the same bits: the same numbers
    width = 8 * torch.empty((), dtype=dtype).element_size()
    for which in range(len(list(a.parameters()))):
        for bit in range(width):  # the sign and exponent bits of fp64 too (a sum modulo 2**52 would miss them)
            b = _model(dtype)
            _flip_one_bit(b, which, bit)
            assert fingerprint_row(b)[0] != mark[0], (which, bit)


def test_the_numbers_cross_float64_exactly():
    for value in fingerprint_row(_model()):
        assert 0 <= value < 2**52 and value == int(value)


def test_the_workers_outside_the_largest_group_of_equal_fingerprints_are_named():
    same, odd = [1.0, 2.0], [1.0, 3.0]
    assert verdict([same, same]) == {"checked": True, "differ": []}
    assert verdict([same, odd]) == {"checked": True, "differ": [1]}  # a tie: rank 0's group counts as the largest
    assert verdict([odd, same, same]) == {"checked": True, "differ": [0]}
    assert verdict([same, odd, same, odd, same]) == {"checked": True, "differ": [1, 3]}
    assert verdict([[-1.0, -1.0], [-1.0, -1.0]]) == {"checked": False}  # every parameter sharded
    assert "ranks 1, 3 differ" in warning([1, 3], 7) and "after step 7" in warning([1, 3], 7)


def _end(rank: int, world: int, name: str) -> list[dict]:
    s = quietsync.make_strategy(name, _model(), torch.optim.AdamW, lr=0.01)
    guard = NonFiniteGuard("stop", s)
    try:
        g = torch.Generator().manual_seed(rank)
        while not s.step():
            x = torch.randn(4, 6, generator=g)
            s.forward_backward((x, x[:, :3]), lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
        found = [verdict(guard.check_parameters(fingerprint_row))]
        if rank == 1:  # as a flipped bit in a worker's memory would
            with s.committed_params() as m:
                _flip_one_bit(m, 2, 5)
        found.append(verdict(guard.check_parameters(fingerprint_row)))
        return found
    finally:
        guard.close()
        s.close()


@pytest.mark.timeout(120)
def test_replicas_that_agree_are_said_to_and_one_flipped_bit_on_one_worker_is_named_on_every_worker():
    out = run_ranks(_end, 2, "ddp", timeout=100)
    want = [{"checked": True, "differ": []}, {"checked": True, "differ": [1]}]
    assert out == [want, want]


def _every(rank: int, world: int, name: str) -> dict:
    s = quietsync.make_strategy(name, _model(), torch.optim.AdamW, lr=0.01)
    guard = NonFiniteGuard("stop", s)
    try:
        g = torch.Generator().manual_seed(rank)  # each worker its own data: only the commits make them agree
        while s.steps < 3:
            x = torch.randn(4, 6, generator=g)
            s.forward_backward((x, x[:, :3]), lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
            s.step()
        s.finish()
        return verdict(guard.check_parameters(fingerprint_row))
    finally:
        guard.close()
        s.close()


@pytest.mark.timeout(200)
def test_every_strategy_commits_the_same_parameters_on_every_worker():
    for name in ("ddp", "zero1", "acco", "dpu", "wp", "demo", "fsdp", "localsgd", "diloco"):
        out = run_ranks(_every, 2, name, timeout=100)
        assert out == [{"checked": True, "differ": []}] * 2, name
