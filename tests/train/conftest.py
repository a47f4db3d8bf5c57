"""Shared fixtures of the `quietsync train` tests: the data room's small local corpora (tests/data/conftest.py,
re-exported here: other tests import ``synthetic_text`` from this module) and finished runs shared by the tests
that only read what a run writes."""

from __future__ import annotations

import pytest

from tests.data.conftest import small_corpus, synthetic_text, text_file  # noqa: F401  (fixtures shared with tests/data)


@pytest.fixture(scope="session")
def finished_ddp_run(tmp_path_factory):
    """OUT of one finished 2-worker ddp run shared by the tests that only read what a run writes (computed once
    per test session): 4 steps, a checkpoint every 2, emulated links on both groups, --trace, the profiler on
    step 2, the model exported. Do not write into it."""
    from ._run import shared_run

    out, _ = shared_run(tmp_path_factory, "finished-ddp-run", "--strategy", "ddp", "--max-steps", "4",
                        "--save-every", "2", "--trace", "--link", "inter=200mbit,1ms", "--link", "intra=200mbit,1ms",
                        "--profile-steps", "2:2")
    return out


@pytest.fixture(scope="session")
def finished_zero1_run(tmp_path_factory):
    """``(OUT, job flags)`` of one finished 2-worker zero1 run with checkpoints at steps 2 and 4 (computed once per
    test session); tests that resume or overwrite it work on a copy (tests.shared.copy_of)."""
    from ._run import shared_run

    return shared_run(tmp_path_factory, "finished-zero1-run", "--strategy", "zero1", "--max-steps", "4",
                      "--save-every", "2", "--no-export")
