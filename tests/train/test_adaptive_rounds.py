"""`quietsync train --inner-steps adaptive`: a worker that takes fewer inner steps reads fewer windows and no other
worker reads them (the windows of all workers are a prefix of the epoch's permutation, each read once); every worker
meets at the round's end on the same nominal step; a resume at a checkpoint continues identically; bad flags are
refused in one line before any worker starts."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from quietsync.data.sequences import ShardedSequences
from quietsync.train.adaptive_rounds import PlannedSequences
from quietsync.train.metrics import read_jsonl

from ._run import refused, small_job, train

ADAPTIVE = ["--strategy", "diloco", "--sync-every", "4", "--inner-steps", "adaptive", "--worker-speeds", "1",
            "--worker-speeds", "0.5", "--threads", "1", "--no-export"]


def _order(n_tokens: int, seq_len: int, count: int) -> list[tuple[int, int]]:
    """The oracle of the data order: one reader of epoch 0's permutation, one window at a time."""
    one = ShardedSequences(torch.arange(n_tokens), seq_len, 1, 0, 1, seed=0)
    out = []
    for _ in range(count):
        start = int(next(one)[0, 0])
        out.append((one.last_starts[0], start))
    return out


def test_planned_windows_are_the_fixed_order_at_equal_plans_and_a_prefix_at_uneven_ones():
    tokens, seq_len = torch.arange(4000), 8
    rounds = {"n": 0, "plan": [2, 2]}

    def streams(cls, world):
        if cls is ShardedSequences:
            return [ShardedSequences(tokens, seq_len, 2, r, world, seed=0) for r in range(world)]
        return [PlannedSequences(tokens, seq_len, 2, r, world, 0, lambda: (rounds["n"], rounds["plan"]))
                for r in range(world)]

    fixed, planned = streams(ShardedSequences, 2), streams(PlannedSequences, 2)
    for n in range(3):  # equal plans: exactly the fixed per-worker order
        rounds["n"] = n
        for _ in range(2):
            for f, p in zip(fixed, planned):
                assert torch.equal(next(f), next(p))
    # uneven plans: a round's windows of all workers are the next ones of the permutation, each once
    read: list[tuple[int, int]] = []
    three = streams(PlannedSequences, 3)
    for n, plan in enumerate([[3, 1, 2], [1, 1, 1], [2, 3, 1]]):
        rounds["n"], rounds["plan"] = n, plan
        for r, s in enumerate(three):
            for _ in range(plan[r]):
                next(s)
                read += [(s.last_starts[0], int(x)) for x in s.last_starts[1]]
    assert sorted(read) == sorted(_order(4000, seq_len, len(read)))
    state = three[1].state_dict()
    again = PlannedSequences(tokens, seq_len, 2, 1, 3, 0, lambda: (rounds["n"] + 1, [1, 1, 1]))
    again.load_state_dict(state)
    three[1].plan = again.plan
    assert torch.equal(next(again), next(three[1]))
    with pytest.raises(RuntimeError, match="more windows than round"):
        next(again)


@pytest.mark.timeout(600)
def test_uneven_workers_read_each_window_once_and_resume_identically(tmp_path, monkeypatch):
    monkeypatch.setenv("QUIETSYNC_AUDIT_DATA", "1")
    job = small_job(tmp_path)
    out = tmp_path / "run"
    done = train(*job, *ADAPTIVE, "--max-steps", "16", "--save-every", "8", "--eval-every", "8",
                 "--check-replicas-every", "4", "--out", str(out), timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = {r: [x for x in read_jsonl(out / f"metrics-rank{r}.jsonl") if "event" not in x] for r in range(2)}
    # worker 1 (half the speed) takes 2 inner steps per round of 4, each spanning 2 nominal steps; both meet at 4k
    assert [x["step"] for x in steps[0]] == list(range(1, 17))
    assert [x["step"] for x in steps[1]] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert all(x["tokens"] == 2 * 32 for r in range(2) for x in steps[r])  # one micro-batch per inner step
    # the run's summary says what each worker did
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy_summary"] == {"inner steps per worker": "16, 8 (last round: 4, 2)"}
    # the replica checks meet at round ends, where both workers commit a step
    assert [[x["step"] for x in steps[r] if "replicas" in x] for r in range(2)] == [[4, 8, 12, 16]] * 2
    assert summary["replicas"] == {"checked": True, "differ": [], "first_differ_step": None}
    assert re.search(r"\ninner steps per worker +\| 16, 8 \(last round: 4, 2\)\n", done.stdout), done.stdout
    # nothing read twice or skipped: the windows of both workers are a prefix of the permutation
    windows = [tuple(w) for r in range(2) for x in steps[r] for w in x["windows"]]
    assert len(windows) == 2 * (16 + 8)
    from quietsync.data.corpus import load_corpus
    from quietsync.data.sequences import encode_split
    from quietsync.data.tokenizer import job_tokenizer

    corpus = load_corpus(str(tmp_path / "text.txt"), 0.02)
    tokenizer, eos = job_tokenizer(None, corpus, 300, tmp_path / "cache")
    n = encode_split(tokenizer, corpus.documents, eos, tmp_path / "cache").numel()
    assert sorted(windows) == sorted(_order(n, 32, len(windows)))

    # a resume from the checkpoint at step 8 continues identically (plan, data position, weights)
    again = tmp_path / "again"
    shutil.copytree(out, again)
    resumed = train(*job, *ADAPTIVE, "--max-steps", "16", "--save-every", "8", "--eval-every", "8", "--out",
                    str(again), "--resume", str(again / "checkpoints" / "step-0000008"), timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for r in range(2):
        first = [x for x in read_jsonl(out / f"metrics-rank{r}.jsonl")]
        second = [x for x in read_jsonl(again / f"metrics-rank{r}.jsonl")]
        evals = [(x["step"], x["loss"]) for x in first if x.get("event") == "eval"]
        assert evals == [(x["step"], x["loss"]) for x in second if x.get("event") == "eval"]
        assert evals[-1][0] == 16
        assert ([x["windows"] for x in first if "event" not in x]
                == [x["windows"] for x in second if "event" not in x])


@pytest.mark.parametrize("flags,message", [
    (["--strategy", "ddp", "--inner-steps", "adaptive"],
     "--inner-steps is not a flag of strategy ddp (it belongs to diloco, localsgd)"),
    (["--strategy", "localsgd", "--inner-steps", "adaptive", "--sync-every", "4", "--max-steps", "10"],
     "--max-steps must be a multiple of 4 with --inner-steps adaptive"),
    (["--strategy", "diloco", "--inner-steps", "adaptive", "--sync-every", "8", "--fragments", "2", "--max-steps",
      "16", "--eval-every", "6"], "--eval-every must be a multiple of 4 with --inner-steps adaptive"),
    # typed values that fit no round of 64: both named at once, with values that fit
    (["--strategy", "diloco", "--inner-steps", "adaptive", "--max-steps", "300", "--eval-every", "50"],
     "--max-steps and --eval-every must be multiples of 64 with --inner-steps adaptive (the workers meet only at "
     "round ends, every 64 steps), got --max-steps 300, --eval-every 50; e.g. --max-steps 320 --eval-every 64"),
    # the strategy's own refusal, in the flags the user types (not adapt=False or inner_steps='fixed')
    (["--strategy", "diloco", "--inner-steps", "adaptive", "--adapt", "--sync-every", "4", "--max-steps", "8"],
     "use one of them (--no-adapt or --inner-steps fixed)"),
    (["--strategy", "localsgd", "--inner-steps", "adaptive", "--sync-every", "4", "--max-steps", "8",
      "--check-replicas-every", "1"], "--check-replicas-every must be a multiple of 4 with --inner-steps adaptive"),
    (["--strategy", "localsgd", "--inner-steps", "adaptive", "--sync-every", "4", "--max-steps", "8",
      "--on-nonfinite", "skip"], "--on-nonfinite must be stop with --inner-steps adaptive"),
    (["--strategy", "localsgd", "--inner-steps", "adaptive", "--sync-every", "4", "--max-steps", "8",
      "--worker-speeds", "1"], "--worker-speeds must give one value per worker (2), got 1"),
    (["--strategy", "diloco", "--inner-steps", "adaptive", "--inner", "ddp", "--nodes", "1"],
     "--inner must be local with --inner-steps adaptive"),
    (["--strategy", "diloco", "--inner-steps", "adaptive", "--sync-every", "4", "--max-steps", "8",
      "--fault-tolerance", "torchft", "--nodes", "2"],
     "--inner-steps adaptive is not supported with --fault-tolerance torchft"),
])
def test_bad_flags_refused_in_one_line(tmp_path, monkeypatch, capsys, flags, message):
    line = refused(monkeypatch, capsys, *small_job(tmp_path), *flags, "--out", str(tmp_path / "out"))
    assert message in line, line


def test_defaults_that_fit_no_round_are_moved_up_to_the_next_round_end_and_said_so(monkeypatch, capsys):
    from quietsync.train.args import parse_train_args

    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    # the defaults are 300 steps and an evaluation every 50: no round of 64 ends there
    cfg, strategy_config, _ = parse_train_args(["--strategy", "diloco", "--inner-steps", "adaptive"])
    assert strategy_config.round_length() == 64
    assert (cfg.max_steps, cfg.eval_every, cfg.save_every) == (320, 64, 0)
    assert "--max-steps 300 -> 320, --eval-every 50 -> 64" in capsys.readouterr().err
    # a value the user gave is theirs: kept where it fits
    cfg, _, _ = parse_train_args(["--strategy", "localsgd", "--inner-steps", "adaptive", "--sync-every", "4",
                                  "--max-steps", "12", "--save-every", "8"])
    assert (cfg.max_steps, cfg.eval_every, cfg.save_every) == (12, 52, 8)


@pytest.mark.timeout(300)
def test_a_run_resumed_on_more_workers_ends_at_a_round_end_on_every_worker(tmp_path):
    """On 3 workers a step holds 1.5 steps of 2 workers' tokens, so the schedule reaches --max-steps 16 at step 14,
    inside a round of 4 where the workers' nominal steps differ: the round is finished first, on every worker."""
    flags = ["--strategy", "diloco", "--sync-every", "4", "--inner-steps", "adaptive", "--threads", "1",
             "--no-export", "--save-every", "4", "--out", str(tmp_path / "run")]
    first = train(*small_job(tmp_path, 2), *flags, "--max-steps", "8", timeout=250)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = train(*small_job(tmp_path, 3), *flags, "--max-steps", "16", "--resume", "latest", timeout=250)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 16 and summary["stopped_by"] == "max_steps"
    for r in range(3):
        steps = [x["step"] for x in read_jsonl(tmp_path / "run" / f"metrics-rank{r}.jsonl") if "event" not in x]
        assert steps[-1] == 16, (r, steps)
