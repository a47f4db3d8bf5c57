"""Memory-mapped token shards give the same data stream as the tokens in memory: the same windows, the same
resume and the same resharding across worker counts (issue 21's logical position), bit for bit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from quietsync.data.sequences import ShardedSequences, eval_batches
from quietsync.data.shards import FORMAT, VERSION, TokenShards, map_file, map_shard, open_prepared

pytestmark = pytest.mark.timeout(60)


def _shards(tmp_path, ids: np.ndarray, cuts: list[int], dtype=np.uint16) -> TokenShards:
    """``ids`` written as files cut at ``cuts``, mapped."""
    arrays, maps = [], []
    for i, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, ids.size])):
        path = tmp_path / f"s{i}.bin"
        ids[lo:hi].astype(dtype).tofile(path)
        maps.append((map_file(path), 0))
        arrays.append(map_shard(path, np.dtype(dtype), 0, hi - lo, maps[-1][0]))
    return TokenShards(arrays, maps)


@pytest.fixture
def ids():
    return np.random.default_rng(0).integers(0, 60_000, size=20_000)


def test_windows_across_shard_boundaries_equal_the_tokens_in_memory(tmp_path, ids):
    mapped = _shards(tmp_path, ids, [7, 5_000, 5_001, 12_345])
    memory = torch.from_numpy(ids.astype(np.int64))
    assert mapped.numel() == ids.size
    starts = torch.tensor([0, 3, 4_990, 5_000, 12_340, 19_900, 6])  # inside, across one and across two shards
    got = mapped.windows(starts, 100)
    assert got.dtype == torch.int64
    assert torch.equal(got, memory[starts[:, None] + torch.arange(100)[None, :]])
    assert np.array_equal(mapped.read(4_000, 13_000), ids[4_000:13_000])
    assert torch.equal(mapped.to_tensor(), memory)
    with pytest.raises(IndexError):
        mapped.read(0, ids.size + 1)


def _batches(stream: ShardedSequences, n: int) -> list[torch.Tensor]:
    return [next(stream) for _ in range(n)]


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_the_stream_over_mapped_shards_is_the_stream_in_memory(tmp_path, ids, dtype):
    """Every worker's batches over two epochs, a resume from state_dict, and a job resumed on another number of
    workers from the logical position (continue_from): each the same on the mapped shards as in memory."""
    mapped = _shards(tmp_path, ids, [3_000, 9_000, 9_100], dtype)
    memory = torch.from_numpy(ids.astype(np.int64))
    seq, mbs = 16, 4
    for world in (1, 3):
        for rank in range(world):
            a = ShardedSequences(memory, seq, mbs, rank, world, seed=5)
            b = ShardedSequences(mapped, seq, mbs, rank, world, seed=5)
            n = 2 * a.windows_per_rank // mbs + 3  # into the third epoch
            for x, y in zip(_batches(a, n), _batches(b, n)):
                assert torch.equal(x, y)
            assert a.state_dict() == b.state_dict() and a.epoch == 2
    # resume (same world) and reshard 3 -> 2 workers at the logical position
    a = ShardedSequences(memory, seq, mbs, 1, 3, seed=5)
    _batches(a, 40)
    state, (epoch, consumed) = a.state_dict(), a.logical_position()
    b = ShardedSequences(mapped, seq, mbs, 1, 3, seed=5)
    b.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(_batches(a, 10), _batches(b, 10)))
    for rank in range(2):
        m = ShardedSequences(memory, seq, mbs, rank, 2, seed=5)
        s = ShardedSequences(mapped, seq, mbs, rank, 2, seed=5)
        m.continue_from(epoch, consumed)
        s.continue_from(epoch, consumed)
        assert all(torch.equal(x, y) for x, y in zip(_batches(m, 60), _batches(s, 60)))
        assert m.logical_position() == s.logical_position()


def test_eval_batches_are_the_same_mapped(tmp_path, ids):
    mapped = _shards(tmp_path, ids, [1_000])
    memory = torch.from_numpy(ids.astype(np.int64))
    for rank in range(2):
        a = eval_batches(memory, 32, 4, 50, rank, 2)
        b = eval_batches(mapped, 32, 4, 50, rank, 2)
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_stream_state_is_a_small_plain_dict(tmp_path, ids):
    # a live peer hands it over as it is (issue 28): ints only, independent of the corpus
    s = ShardedSequences(_shards(tmp_path, ids, []), 16, 4, 0, 2, seed=1)
    _batches(s, 5)
    state = s.state_dict()
    assert all(type(v) is int for v in state.values()) and len(json.dumps(state)) < 120


def test_a_worker_keeps_only_its_share_of_the_epoch_order(tmp_path, ids):
    s = ShardedSequences(_shards(tmp_path, ids, []), 8, 2, 1, 4, seed=0)
    next(s)
    assert s._mine.dtype == torch.int32 and s._mine.is_contiguous()
    assert s._mine.numel() == s.num_windows // 4
    # the int32 order is torch's int64 permutation, element for element
    g = torch.Generator().manual_seed(0)
    torch.randint(0, 8, (1,), generator=g)
    assert torch.equal(s._mine.long(), torch.randperm(s.num_windows, generator=g)[1::4][: s.num_windows // 4])


def _index(folder, dtype, tokens, bytes_):
    return {"format": FORMAT, "version": VERSION, "dtype": dtype, "eos": 0, "vocab_size": 300,
            "tokenizer": {"fingerprint": "x", "about": "test"}, "split": "test",
            "splits": {s: {"documents": 1, "tokens": tokens,
                           "shards": [{"path": f"{s}.bin", "offset": 0, "tokens": tokens, "bytes": bytes_}]}
                       for s in ("train", "eval")}}


def test_a_changed_or_missing_shard_is_named(tmp_path):
    for s in ("train", "eval"):
        np.arange(100, dtype=np.uint16).tofile(tmp_path / f"{s}.bin")
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "index.json").write_text(json.dumps(_index(tmp_path, "uint16", 100, 200)))
    assert open_prepared(tmp_path).train.numel() == 100
    np.arange(50, dtype=np.uint16).tofile(tmp_path / "train.bin")  # truncated since it was indexed
    with pytest.raises(ValueError, match=r"train\.bin is 100 bytes, the index says 200 .*prepare it again"):
        open_prepared(tmp_path)
    (tmp_path / "train.bin").unlink()
    with pytest.raises(ValueError, match=r"train\.bin is missing"):
        open_prepared(tmp_path)
    (tmp_path / "index.json").write_text(json.dumps({**_index(tmp_path, "uint16", 100, 200), "vocab_size": 70_000}))
    with pytest.raises(ValueError, match="uint16 token ids cannot hold a vocabulary of 70000"):
        open_prepared(tmp_path)


def _rss_file() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise KeyError("RssFile")


def test_pages_read_are_let_go_of(tmp_path):
    """Reading windows all over a mapped split does not leave the process holding the pages it touched (the
    kernel maps up to 2 MB of page cache per fault): its file-backed resident memory stays where it was."""
    ids = (np.arange(8 << 20, dtype=np.uint32) % 60_000).astype(np.uint32)  # 32 MB of ids
    mapped = _shards(tmp_path, ids, [4 << 20], dtype=np.uint32)
    memory = torch.from_numpy(ids.astype(np.int64))
    before = _rss_file()
    rng = np.random.default_rng(0)
    for _ in range(200):
        starts = torch.from_numpy(rng.integers(0, ids.size - 128, size=32))
        assert torch.equal(mapped.windows(starts, 128), memory[starts[:, None] + torch.arange(128)[None, :]])
    assert _rss_file() - before < (2 << 20), (_rss_file() - before) / 2**20  # 6 400 windows over 32 MB


def test_the_data_identity_follows_the_ids_not_their_shards(tmp_path, ids):
    """What a checkpoint records of its data: the same ids in other shards (or dtype) are the same data; one id
    changed anywhere a sample reads, or another tokenizer, is other data; an empty split is fine."""
    from quietsync.data.shards import Prepared, data_identity

    def identity(train, held, fingerprint="tok"):
        return data_identity(Prepared(tmp_path, {"tokenizer": {"fingerprint": fingerprint}}, train, held))

    for name in "abce":
        (tmp_path / name).mkdir()
    held = _shards(tmp_path / "e", ids[:3_000], [])
    one = identity(_shards(tmp_path / "a", ids, [5_000]), held)
    assert one == identity(_shards(tmp_path / "b", ids, [7, 12_345], np.uint32), held)
    assert one["train_tokens"] == ids.size and one["eval_tokens"] == 3_000 and one["tokenizer"] == "tok"
    changed = ids.copy()
    changed[-1] += 1  # the last id: the end of a split is sampled
    assert identity(_shards(tmp_path / "c", changed, []), held)["digest"] != one["digest"]
    assert identity(_shards(tmp_path / "a", ids, [5_000]), held, "other")["digest"] != one["digest"]
    assert identity(_shards(tmp_path / "a", ids, [5_000]), TokenShards([]))["eval_tokens"] == 0
