"""Token sequences: disjoint deterministic shards per worker, exact resume, fixed eval batches."""

from __future__ import annotations

import pytest
import torch

from quietsync.data.sequences import ShardedSequences, encode_documents, encode_split, eval_batches
from quietsync.data.tokenizer import eos_id, load_or_train_tokenizer

pytestmark = pytest.mark.timeout(60)


def _starts(stream: ShardedSequences, batches: int) -> list[int]:
    seen = []
    for _ in range(batches):
        b = next(stream)
        assert b.shape == (stream.micro_batch_size, stream.seq_len)
        seen.extend(b[:, 0].tolist())
    return seen


def test_shards_are_disjoint_and_cover_an_epoch():
    tokens = torch.arange(10_000)  # token value == position, so a window is identified by its first token
    world, mbs, seq = 3, 4, 16
    per_rank = []
    for r in range(world):
        s = ShardedSequences(tokens, seq, mbs, rank=r, world_size=world, seed=7)
        per_rank.append(_starts(s, s.windows_per_rank // mbs))
    flat = [x for shard in per_rank for x in shard]
    assert len(flat) == len(set(flat))  # disjoint across workers
    offset = flat[0] % seq
    assert all(x % seq == offset for x in flat)  # one offset per epoch, windows don't overlap
    assert all(len(shard) == len(per_rank[0]) for shard in per_rank)


def test_windows_are_contiguous_text():
    tokens = torch.arange(5_000)
    b = next(ShardedSequences(tokens, 32, 2, seed=1))
    assert torch.equal(b[:, 1:] - b[:, :-1], torch.ones(2, 31, dtype=torch.long))


def test_deterministic_and_seed_dependent():
    tokens = torch.arange(20_000)
    a = _starts(ShardedSequences(tokens, 16, 4, 1, 2, seed=3), 20)
    b = _starts(ShardedSequences(tokens, 16, 4, 1, 2, seed=3), 20)
    c = _starts(ShardedSequences(tokens, 16, 4, 1, 2, seed=4), 20)
    assert a == b and a != c


def test_epochs_roll_over_and_resume_exactly():
    tokens = torch.arange(2_000)
    s = ShardedSequences(tokens, 16, 4, 0, 2, seed=0)
    n = s.windows_per_rank // 4
    first_epoch = _starts(s, n)
    second_epoch = _starts(s, n)
    assert s.epoch == 1 and sorted(first_epoch) != sorted(second_epoch)  # new offset/permutation
    s = ShardedSequences(tokens, 16, 4, 0, 2, seed=0)
    _starts(s, n + 3)
    state = s.state_dict()
    expect = _starts(s, 5)
    t = ShardedSequences(tokens, 16, 4, 0, 2, seed=0)
    t.load_state_dict(state)
    assert _starts(t, 5) == expect
    with pytest.raises(ValueError, match="world size"):
        ShardedSequences(tokens, 16, 4, 0, 4, seed=0).load_state_dict(state)


def test_too_short_text():
    with pytest.raises(ValueError, match="too short"):
        ShardedSequences(torch.arange(100), 16, 4, 0, 2)
    with pytest.raises(ValueError, match=r"^rank must be an integer in \[0, 1\], got 2$"):
        ShardedSequences(torch.arange(1_000), 16, 4, 2, 2)
    with pytest.raises(ValueError, match="^world_size must be an integer >= 1, got 0$"):
        ShardedSequences(torch.arange(1_000), 16, 4, 0, 0)


def test_eval_batches_split_fixed_windows():
    tokens = torch.arange(1_000)
    whole = torch.cat(eval_batches(tokens, 10, 4, 30))
    assert whole.shape == (30, 10) and torch.equal(whole[:, 0], torch.arange(30) * 10)
    parts = [torch.cat(eval_batches(tokens, 10, 4, 30, rank=r, world_size=2)) for r in range(2)]
    assert sorted(torch.cat(parts)[:, 0].tolist()) == whole[:, 0].tolist()
    with pytest.raises(ValueError, match="shorter than seq_len"):
        eval_batches(torch.arange(5), 10, 4, 30)


def test_encode_split_cached(small_corpus, tmp_path):
    tok = load_or_train_tokenizer(small_corpus, 300, tmp_path)
    eos = eos_id(tok)
    ids = encode_split(tok, small_corpus.documents, eos, tmp_path)
    assert ids.dtype == torch.int64 and int((ids == eos).sum()) == len(small_corpus.documents)
    assert tok.decode(ids[: ids.tolist().index(eos)].tolist()) == small_corpus.documents[0]
    cached = list(tmp_path.glob("tokens-*.npy"))
    assert len(cached) == 1
    again = encode_split(tok, small_corpus.documents, eos, tmp_path)
    assert torch.equal(ids, again) and len(list(tmp_path.glob("tokens-*.npy"))) == 1
    raw = encode_documents(tok, small_corpus.documents[:1], eos)
    assert raw.dtype.itemsize == 2  # a 300-entry vocabulary fits uint16
