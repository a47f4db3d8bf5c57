"""The multi-process harness itself: results come back by rank, a raising rank fails the run, a hung rank fails
it at the timeout with the stack it waited in; under pytest-xdist each test process computes on its share of the
cores (tests/conftest.py)."""

import os
import re
import threading

import pytest
import torch

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


def _one_waits_forever(rank: int, world: int) -> None:
    if rank == 0:
        threading.Event().wait()  # a worker that never returns, as a missed collective would leave it


@pytest.mark.timeout(120)
def test_a_hung_rank_fails_the_run_at_the_timeout_with_its_stack():
    with pytest.raises(TimeoutError) as failed:
        run_ranks(_one_waits_forever, 2, timeout=5)
    message = str(failed.value)
    assert re.match(r"ranks \[0(, 1)?\] of 2 did not finish within 5s", message)  # rank 1 too, on a loaded machine
    assert "rank 0, every thread's stack at the timeout" in message and "in _one_waits_forever" in message


def test_each_xdist_test_process_computes_on_its_share_of_the_cores():
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2:
        pytest.skip("a share of the cores is taken only under pytest-xdist with 2 or more test processes")
    assert torch.get_num_threads() == max(1, (os.cpu_count() or 1) // workers)  # not torch's thread per core


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_long_tests_start_each_test_processs_share_of_the_shuffled_order(workers):
    """tests/conftest.py: pytest-xdist's work stealing gives each test process a contiguous share of the order; the
    long tests (``pytest.mark.long``) are dealt to the front of the shares, the rest keeps its shuffled order."""
    from types import SimpleNamespace

    from tests.conftest import pytest_collection_modifyitems

    class Item:
        def __init__(self, name: str) -> None:
            self.name = name

        def get_closest_marker(self, marker: str):
            return marker if marker == "long" and self.name.startswith("L") else None

    names = ["a", "L1", "b", "c", "L2", "d", "e", "L3", "f", "g", "h"]
    items = [Item(n) for n in names]
    config = SimpleNamespace(workerinput={"workercount": workers}) if workers > 1 else SimpleNamespace()
    pytest_collection_modifyitems(config, items)
    order = [x.name for x in items]
    assert sorted(order) == sorted(names)
    assert [n for n in order if not n.startswith("L")] == [n for n in names if not n.startswith("L")]
    size = len(names) // workers
    starts = [order[k * size] for k in range(workers)]
    assert starts == ["L1", "L2", "L3"][:workers], order  # each share opens with a long test
    assert all(n.startswith("L") for n in order[:3 // workers]), order  # and holds its deal of them first
