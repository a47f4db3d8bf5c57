"""The multi-process harness itself: results come back by rank, a raising rank fails the run."""

import pytest

from tests.distributed import run_ranks


def _rank_times_ten(rank: int, world: int) -> int:
    return rank * 10 + world


def _raise_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise KeyError("boom")


@pytest.mark.timeout(120)
def test_results_by_rank():
    assert run_ranks(_rank_times_ten, 3) == [3, 13, 23]


@pytest.mark.timeout(120)
def test_a_raising_rank_fails_the_run():
    with pytest.raises(AssertionError, match="KeyError: 'boom'"):
        run_ranks(_raise_on_one, 2)
