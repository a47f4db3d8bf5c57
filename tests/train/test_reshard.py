"""Checkpoints that reshard: ddp and zero1 saved on 4 workers resume on 2 and back.

Claims, each against an oracle written here:

* the state a new world loads equals the state the old world saved, unflattened (ZeRO-1's shards of the flat
  buffer concatenated, padding dropped, cut at the parameter offsets — the tests' own unflattening);
* the continued run on the new world equals one process running plain ``torch.optim.AdamW`` from the saved
  weights and optimizer state on the new world's global batch (the DDP ≡ ZeRO-1 ≡ one process oracle);
* at an unchanged world size the logical path continues bit-identically to the uninterrupted run;
* per-worker counters are folded so totals are kept; the data position is carried;
* a strategy whose state cannot be resharded (cdp) refuses, on every worker, naming itself and why.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks

from . import _reshard_workers as w

pytestmark = pytest.mark.timeout(240)


def _flat_layout(model: torch.nn.Module) -> list[tuple[str, int, torch.Size]]:
    """(name, flat offset, shape) of each parameter in ZeRO-1's flat order: the parameter groups in order."""
    names = {id(p): n for n, p in model.named_parameters()}
    out, offset = [], 0
    for g in w.groups(model):
        for p in g["params"]:
            out.append((names[id(p)], offset, p.shape))
            offset += p.numel()
    return out


def _unflatten_shards(held: list[dict], key: str) -> dict[str, torch.Tensor]:
    """The workers' shards of ``key`` concatenated in rank order, padding dropped, cut per parameter."""
    layout = _flat_layout(w.model(0))
    numel = sum(s.numel() for _, _, s in layout)
    pieces = sorted((h["bounds"][0], h[key]) for h in held)
    flat = torch.cat([t for _, t in pieces])
    assert all(h["bounds"][1] - h["bounds"][0] == held[0]["bounds"][1] - held[0]["bounds"][0] for h in held)
    flat = flat[:numel]
    return {n: flat[o:o + s.numel()].view(s) for n, o, s in layout}


def _per_param_state(held: list[dict], name: str) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter: {exp_avg, exp_avg_sq, step}} of a saved or loaded world."""
    if name == "ddp":
        return held[0]["optim"]
    avg, sq = _unflatten_shards(held, "exp_avg"), _unflatten_shards(held, "exp_avg_sq")
    step = held[0]["step"][0]
    return {n: {"exp_avg": avg[n], "exp_avg_sq": sq[n], "step": torch.tensor(step)} for n in avg}


def _oracle(saved: list[dict], name: str, new_world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: plain AdamW from the saved weights and state, on the new world's global batch."""
    return w.adamw_from(saved[0]["params"], _per_param_state(saved, name), new_world)


@pytest.mark.parametrize("name", ["ddp", "zero1"])
@pytest.mark.parametrize("old,new", [(4, 2), (2, 4)])
def test_a_checkpoint_reshards_and_continues_like_one_process(tmp_path, name, old, new):
    folder = str(tmp_path / "step")
    saved = run_ranks(w.train_and_save, old, name, folder)
    loaded = run_ranks(w.load_and_continue, new, name, folder)

    # the state loaded equals the state saved, unflattened
    for h in loaded:
        assert h["steps"] == w.STEPS
        assert h["base_lrs"] == saved[0]["base_lrs"]
        for k, v in saved[0]["params"].items():
            assert torch.equal(h["params"][k], v), k
    want, got = _per_param_state(saved, name), _per_param_state(loaded, name)
    assert set(got) == set(want) == set(saved[0]["params"])
    for p_name in want:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[p_name][key], want[p_name][key]), (p_name, key)
    if name == "zero1":
        assert torch.equal(torch.cat([v.reshape(-1) for v in _unflatten_shards(loaded, "master").values()]),
                           torch.cat([v.reshape(-1) for v in _unflatten_shards(saved, "master").values()]))

    # the continuation equals one process from the same weights and optimizer state
    losses, params = _oracle(saved, name, new)
    for r, h in enumerate(loaded):
        assert h["continued"]["losses"] == pytest.approx([step[r] for step in losses], rel=1e-6, abs=1e-7)
        for k, v in params.items():
            torch.testing.assert_close(h["continued"]["params"][k], v, rtol=1e-5, atol=1e-6)

    # counters folded (totals kept), data position carried
    old_tokens = [100 + q for q in range(old)]
    assert [h["tokens"] for h in loaded] == [sum(t for q, t in enumerate(old_tokens) if q % new == r)
                                             for r in range(new)]
    assert sum(h["micro_batches"] for h in loaded) == old * w.STEPS
    assert {h["position"] for h in loaded} == {saved[0]["position"]} == {(0, old * w.STEPS * w.MBS)}


@pytest.mark.parametrize("name", ["ddp", "zero1"])
def test_the_logical_path_at_the_same_world_size_is_exact(tmp_path, name):
    folder = str(tmp_path / "step")
    saved = run_ranks(w.train_and_save, 2, name, folder)
    loaded = run_ranks(w.load_and_continue, 2, name, folder)
    for r, (s, h) in enumerate(zip(saved, loaded)):
        assert h["continued"]["losses"] == s["continued"]["losses"]
        for k, v in s["continued"]["params"].items():
            assert torch.equal(h["continued"]["params"][k], v), k
        assert h["tokens"] == 100 + r  # each worker keeps its own count


@pytest.mark.parametrize("name", ["cdp"])
def test_a_strategy_that_cannot_reshard_refuses_on_every_worker(tmp_path, name):
    errors = run_ranks(w.refuse, 2, name, str(tmp_path / "step"), "save")
    assert len(set(errors)) == 1 and errors[0].startswith(f"strategy {name} cannot be resharded: ")
    saved = tmp_path / "zero1"
    run_ranks(w.train_and_save, 2, "zero1", str(saved))
    errors = run_ranks(w.refuse, 2, name, str(saved), "load")
    assert len(set(errors)) == 1 and errors[0].startswith(f"strategy {name} cannot be resharded: ")


def _starts(batch: torch.Tensor) -> list[int]:
    return batch[:, 0].tolist()  # windows do not overlap: a window is named by its first token


@pytest.mark.parametrize("old,new", [(4, 2), (2, 4), (3, 2)])
def test_the_data_stream_continues_where_the_old_world_stopped(old, new):
    from quietsync.data.sequences import ShardedSequences

    tokens, seq, mbs, steps = torch.arange(2000), 8, 2, 3
    olds = [ShardedSequences(tokens, seq, mbs, r, old, seed=5) for r in range(old)]
    before = [sum((_starts(next(s)) for s in olds), []) for _ in range(steps)]
    (position,) = {s.logical_position() for s in olds}
    news = [ShardedSequences(tokens, seq, mbs, r, new, seed=5) for r in range(new)]
    for s in news:
        s.continue_from(*position)
    after = [sum((_starts(next(s)) for s in news), []) for _ in range(steps)]
    # oracle: one reader of the epoch's permutation, one window at a time
    one = ShardedSequences(tokens, seq, 1, 0, 1, seed=5)
    order = [_starts(next(one))[0] for _ in range(steps * (old + new) * mbs)]
    i = 0
    for step in before + after:  # each step's windows are the next ones of the permutation: none skipped or repeated
        assert sorted(step) == sorted(order[i:i + len(step)])
        i += len(step)
    # the next epoch is the new world's own partition, as a fresh run on it would read
    while news[0].epoch == 0:
        batches = [next(s) for s in news]
    fresh = [ShardedSequences(tokens, seq, mbs, r, new, seed=5) for r in range(new)]
    for s in fresh:
        s.load_state_dict({**s.state_dict(), "epoch": 1})
    assert all(torch.equal(b, next(f)) for b, f in zip(batches, fresh))
    # and the position (with its offset into the epoch) survives an exact same-world checkpoint
    again = ShardedSequences(tokens, seq, mbs, 1, new, seed=5)
    again.continue_from(*position)
    copy = ShardedSequences(tokens, seq, mbs, 1, new, seed=5)
    copy.load_state_dict(again.state_dict())
    assert torch.equal(next(copy), next(again))


@pytest.mark.timeout(600)
def test_quietsync_train_resumes_on_half_and_then_twice_the_workers(tmp_path):
    import json

    from quietsync.train.metrics import read_jsonl

    from ._run import small_job, train

    out = tmp_path / "run"
    job = [*small_job(tmp_path, nproc=4), "--strategy", "zero1", "--out", str(out)]
    first = train(*job, "--max-steps", "2", "--save-every", "2", timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / "checkpoints" / "step-0000002" / "logical" / ".metadata").is_file()
    half = train(*job, "--nproc", "2", "--max-steps", "4", "--save-every", "2", "--resume", timeout=300)
    assert half.returncode == 0, half.stderr[-3000:]
    assert "resharding a checkpoint of 4 workers onto 2" in half.stdout
    twice = train(*job, "--max-steps", "5", "--resume", timeout=300)
    assert twice.returncode == 0, twice.stderr[-3000:]
    assert "resharding a checkpoint of 2 workers onto 4" in twice.stdout
    rows = [r for r in read_jsonl(out / "metrics-rank0.jsonl") if "event" not in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    # --batch-policy global (the default): on 2 workers each step holds 2 micro-batches per worker, the run's
    # first global batch of 4
    assert [r["micro_batches"] for r in rows] == [1, 1, 2, 2, 1]
    window = 2 * 32  # micro-batch size x sequence length
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["tokens"] == (4 * 2 + 2 * 2 * 2 + 4 * 1) * window


@pytest.mark.timeout(600)
def test_quietsync_train_flexdemo_resumes_on_fewer_workers_per_node_and_on_fewer_nodes(tmp_path):
    from quietsync.train.metrics import read_jsonl

    from ._run import small_job, train

    out = tmp_path / "run"
    job = [*small_job(tmp_path, nproc=4), "--strategy", "flexdemo", "--nodes", "2", "--out", str(out)]
    first = train(*job, "--max-steps", "2", "--save-every", "2", timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / "checkpoints" / "step-0000002" / "logical" / ".metadata").is_file()
    half = train(*job, "--nproc", "2", "--max-steps", "3", "--save-every", "3", "--resume", timeout=300)
    assert half.returncode == 0, half.stderr[-3000:]
    assert "resharding a checkpoint of 4 workers onto 2" in half.stdout
    one_node = train(*job, "--nproc", "2", "--nodes", "1", "--max-steps", "4", "--resume", timeout=300)
    assert one_node.returncode == 0, one_node.stderr[-3000:]
    assert "moving a checkpoint of 2 nodes onto 1" in one_node.stdout
    assert [r["step"] for r in read_jsonl(out / "metrics-rank0.jsonl") if "event" not in r] == [1, 2, 3, 4]


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_logical_metadata_is_read_safely_and_an_open_round_is_not_saved(tmp_path, monkeypatch):
    import pickle

    from quietsync.strategies import make_strategy
    from quietsync.strategies.checkpoint.logical import ReshardError
    from quietsync.train.logical_checkpoint import load_logical, save_logical, saved_tensors

    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    m = w.model(0)
    strategy = make_strategy("ddp", m, torch.optim.AdamW, lr=w.LR, config={"accumulation": 2})
    stream = w._stream(0, 1)
    strategy.forward_backward(w.batch(0, 0), w.loss_fn)
    assert not strategy.step()
    with pytest.raises(ReshardError, match="strategy ddp holds an open round \\(round=1\\)"):
        save_logical(tmp_path / "open", strategy, stream, 0)
    strategy.forward_backward(w.batch(1, 0), w.loss_fn)
    assert strategy.step()
    save_logical(tmp_path / "ok", strategy, stream, 7)  # one process: no process group
    saved = saved_tensors(tmp_path / "ok")
    assert saved["model.0.weight"] == (torch.Size([7, 5]), torch.float32)
    assert saved["optim.0.weight.exp_avg"][0] == torch.Size([7, 5])
    fresh = make_strategy("ddp", w.model(1), torch.optim.AdamW, lr=w.LR, config={"accumulation": 2})
    assert load_logical(tmp_path / "ok", fresh, w._stream(0, 1)) == 7
    assert all(torch.equal(a, b) for a, b in zip(fresh.module.parameters(), strategy.module.parameters()))
    strategy.close()
    fresh.close()

    marker = tmp_path / "pwned"
    (tmp_path / "ok" / "logical" / ".metadata").write_bytes(pickle.dumps(_Exploit(str(marker))))
    with pytest.raises(ValueError, match="refusing to load checkpoint metadata .*posix.system is not part"):
        saved_tensors(tmp_path / "ok")
    assert not marker.exists()


def test_a_step_folder_is_complete_for_another_world_when_its_writers_all_finished(tmp_path, monkeypatch):
    from quietsync.strategies import make_strategy
    from quietsync.train.checkpoint import latest_checkpoint, rank_file, resolve_resume, save_checkpoint
    from quietsync.train.logical_checkpoint import save_logical

    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    strategy = make_strategy("zero1", w.model(0), torch.optim.AdamW, lr=w.LR)
    strategy.forward_backward(w.batch(0, 0), w.loss_fn)
    assert strategy.step()
    folder = tmp_path / "checkpoints" / "step-0000001"
    save_logical(folder, strategy, w._stream(0, 1), 0)  # written by one worker
    strategy.close()
    assert latest_checkpoint(tmp_path, range(4)) is None  # its writer's rank file is missing: not complete
    save_checkpoint(tmp_path, 1, 0, {"strategy": {}})
    assert latest_checkpoint(tmp_path, range(4)) == folder  # complete: 4 workers may reshard it
    assert resolve_resume(str(folder), tmp_path, range(4)) == folder
    rank_file(folder, 0).unlink()
    with pytest.raises(ValueError, match="lacks rank files for ranks \\[0, 1, 2, 3\\]"):
        resolve_resume(str(folder), tmp_path, range(4))
