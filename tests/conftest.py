"""Fixtures for the whole suite.

Every test leaves the process as it found it (:func:`_restore_process_state`), so the suite passes in any order
(``make test`` shuffles it: pytest-randomly).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_OWN = (ROOT / "src", ROOT / "tests")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each test process takes its share of the cores for the work it does itself (and gives that
    share to the processes it starts, through ``OMP_NUM_THREADS``): with torch's default of a thread per core, two
    test processes on two cores run four compute threads, whose busy waits cost ~10% of an in-process test's time.
    Workers a test launches set their own count (``quietsync train --threads``)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        share = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


@pytest.hookimpl(trylast=True)  # after pytest-randomly's shuffle
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Long tests (``pytest.mark.long``: real processes for tens of seconds) first in each test process's share of
    the order. pytest-xdist's work stealing hands each process a contiguous share of the collected order and moves
    queued tests, never running ones: a long test started last keeps one process busy while the others are idle.
    The shuffled order is kept within the long and the other tests, and every test process computes the same one
    (they must collect alike)."""
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    long = [item for item in items if item.get_closest_marker("long")]
    if not long:
        return
    rest = [item for item in items if not item.get_closest_marker("long")]
    shares = [long[k::workers] for k in range(workers)]  # the long tests dealt out in turn
    size = len(items) // workers  # each share's length as the scheduler cuts it (the last takes the remainder)
    order: list[pytest.Item] = []
    for k, share in enumerate(shares):
        take = (len(items) - size * (workers - 1) if k == workers - 1 else size) - len(share)
        order += share + rest[:max(0, take)]
        rest = rest[max(0, take):]
    items[:] = order + rest


def _loaded_from_a_script(module: object) -> bool:
    """A module a test loaded from a file of this checkout that no package owns (``examples/custom_strategy.py``,
    a benchmark script): importing it again must run it again, as in a fresh process."""
    path = getattr(module, "__file__", None)
    if not path:
        return False
    path = Path(path).resolve()
    installed = "site-packages" in path.parts or path.is_relative_to(Path(sys.prefix).resolve())  # a venv inside
    return path.is_relative_to(ROOT) and not installed and not any(path.is_relative_to(own) for own in _OWN)


def _accelerate_states() -> dict[str, dict]:
    """🤗 Accelerate's process-wide states, by class (once accelerate is imported): every ``Accelerator`` -- the HF
    Trainer's included -- keeps its settings there, and a later one in the process reads them back (a Trainer
    built with ``fp16=True`` made the next ``QuietAccelerator()`` fp16)."""
    state = sys.modules.get("accelerate.state")
    names = ("PartialState", "AcceleratorState", "GradientState")
    return {} if state is None else {n: getattr(state, n)._shared_state for n in names if hasattr(state, n)}


@pytest.fixture(autouse=True)
def _restore_process_state() -> Iterator[None]:
    """Put back what a test may change for the rest of its process: the strategy registry (the example registers
    ``signsgd``), the modules it loaded from example or benchmark scripts, the environment, 🤗 Accelerate's
    process-wide states, torch's default dtype, thread count and CPU random state (a test draws the same numbers
    whatever ran before it)."""
    import torch

    from quietsync.strategies.registry import restored

    modules = set(sys.modules)
    environ = dict(os.environ)
    accelerate = {name: dict(shared) for name, shared in _accelerate_states().items()}
    dtype, threads, rng = torch.get_default_dtype(), torch.get_num_threads(), torch.random.get_rng_state()
    with restored():
        yield
    for name in [n for n in sys.modules if n not in modules and _loaded_from_a_script(sys.modules[n])]:
        del sys.modules[name]
    for key in [k for k in os.environ if k not in environ]:
        del os.environ[key]
    for key, value in environ.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    for name, shared in _accelerate_states().items():  # in place: the class attribute is a descriptor
        shared.clear()
        shared.update(accelerate.get(name, {}))
    torch.set_default_dtype(dtype)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    torch.random.set_rng_state(rng)


@pytest.fixture
def forked_launch():
    """For this test, quietsync's local launcher forks its workers from the test harness's forkserver instead of
    spawning fresh interpreters (tests/launcher.py: same worker code, same failure report; not for tests of the
    launcher's processes)."""
    from tests.launcher import forked_launcher

    with forked_launcher():
        yield
