"""Shared fixtures of the data room's tests (and of the trainer's, which import them): small local corpora, no
network."""

from __future__ import annotations

import pytest

from quietsync.data.corpus import Corpus

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
