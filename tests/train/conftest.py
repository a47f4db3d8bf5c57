"""Shared fixtures of the `quietsync train` tests: small local corpora, no network."""

from __future__ import annotations

import pytest

from quietsync.train.corpus import Corpus

WORDS = (
    "the quick brown fox jumps over the lazy dog while seven wise owls watch from an old oak tree "
    "and a river runs past the mill where the miller grinds wheat into flour for the village bread"
).split()


def synthetic_text(lines: int, seed: int = 0) -> str:
    """Deterministic pseudo-English lines (no randomness from the environment)."""
    out = []
    x = seed + 1
    for i in range(lines):
        n = 6 + i % 7
        words = []
        for _ in range(n):
            x = (x * 1103515245 + 12345) % (2**31)
            words.append(WORDS[x % len(WORDS)])
        out.append(" ".join(words).capitalize() + ".")
    return "\n".join(out) + "\n"


@pytest.fixture
def small_corpus() -> Corpus:
    docs = tuple(synthetic_text(40, seed=s) for s in range(30))
    return Corpus("synthetic", docs, (synthetic_text(40, seed=99),))


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text(synthetic_text(2000), encoding="utf-8")
    return path


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
