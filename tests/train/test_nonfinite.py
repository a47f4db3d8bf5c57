"""The non-finite policy: a NaN/inf loss or gradient never becomes a committed step or a checkpoint; with
``skip`` every worker drops the same round and the replicas stay identical."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch import nn

import quietsync
from quietsync.strategies import available, get
from quietsync.train.args import parse_train_args
from quietsync.train.checkpoint import latest_checkpoint
from quietsync.train.metrics import read_jsonl
from quietsync.train.nonfinite import NonFiniteError, NonFiniteGuard, nonfinite_entries
from quietsync.train.schedule import warmup_cosine
from tests.distributed import run_ranks

from . import _workers
from ._run import OFFLINE, small_job, train

pytestmark = pytest.mark.timeout(240)


class _PoisonGradient(torch.autograd.Function):
    """Identity forward, NaN backward: a finite loss whose gradients are not."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch(i: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * i + rank)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def _loop(rank: int, world: int, name: str, config: dict, poison: set, steps: int, policy: str,
          where: str = "loss") -> dict:
    """The trainer's loop on a toy model; micro-batch ``i`` of rank ``r`` has a NaN loss (``where="loss"``) or
    a finite loss with NaN gradients (``"gradient"``) when (i, r) in poison."""
    s = quietsync.make_strategy(name, _model(), torch.optim.AdamW, config=config, lr=0.01)
    guard = NonFiniteGuard(policy, s, limit=3)
    i, skipped_at, on_guard = 0, [], [0]
    real_agree_rows = s.transport.agree_rows

    def agree_rows(row):  # counts the guard's agreements (on the transport's control group)
        on_guard[0] += s.world_size > 1
        return real_agree_rows(row)

    s.transport.agree_rows = agree_rows
    try:
        while s.steps < steps:
            def loss_fn(model, batch, i=i):
                x, y = batch
                out = model(x)
                if (i, rank) in poison and where == "gradient":
                    out = _PoisonGradient.apply(out)
                loss = ((out - y) ** 2).mean()
                return loss * float("nan") if (i, rank) in poison and where == "loss" else loss
            loss = s.forward_backward(_batch(i, rank), loss_fn)
            i += 1
            guard.see(loss)
            if guard.before_step():
                skipped_at.append(s.steps + 1)
                continue
            s.step()
        with s.committed_params() as m:
            params = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        return {"params": params, "skipped": guard.skipped, "skipped_at": skipped_at, "fed": i,
                "guard_collectives": on_guard[0]}
    except NonFiniteError as e:
        return {"error": str(e), "steps": s.steps}
    finally:
        guard.close()
        s.close()


def _reference(name: str, config: dict, world: int, feed: list[list[int]], steps: int,
               nodes: int | None) -> torch.Tensor:
    """The same run on clean data: micro-batch indices ``feed[r]`` per rank (the poisoned rounds left out)."""
    return run_ranks(_clean, world, name, config, feed, steps, timeout=120, nodes=nodes)[0]


def _clean(rank, world, name, config, feed, steps):
    s = quietsync.make_strategy(name, _model(), torch.optim.AdamW, config=config, lr=0.01)
    for i in feed[rank]:
        s.forward_backward(_batch(i, rank), lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
        s.step()
    assert s.steps == steps
    with s.committed_params() as m:
        out = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    s.close()
    return out


SKIPPERS = [
    ("zero1", {"accumulation": 2}, 2, None),
    ("ddp", {}, 2, None),
    ("localsgd", {"sync_every": 2}, 2, None),
    ("demo", {}, 2, None),
    ("flexdemo", {}, 2, None),
    ("flexdemo", {"accumulation": 2}, 2, 1),  # FSDP2 inside one node: unsharded gradients dropped too
    ("fsdp", {"accumulation": 2}, 2, 1),
    ("diloco", {"sync_every": 2}, 2, None),
    ("diloco", {"sync_every": 2, "inner": "ddp"}, 4, 2),  # hierarchical: DDP inside each of 2 nodes
    ("diloco", {"sync_every": 2, "inner": "zero1", "accumulation": 2}, 4, 2),
]


@pytest.mark.parametrize("name,config,world,nodes", SKIPPERS,
                         ids=[f"{n}-{c.get('inner', 'flat')}" if n == "diloco" else f"{n}-{w}x{nodes or w}"
                              for n, c, w, nodes in SKIPPERS])
def test_skip_drops_the_same_round_on_every_worker_and_matches_a_clean_run(name, config, world, nodes):
    """A NaN on rank 1 only, in the 2nd round: every worker drops that round (nothing committed, the schedule
    does not advance) and ends where a run that never saw those micro-batches ends, identical to each other."""
    acc = config.get("accumulation", 1)
    poison = {(acc, 1)}  # first micro-batch of the second round, rank 1 only
    out = run_ranks(_loop, world, name, config, poison, 3, "skip", timeout=150, nodes=nodes)
    assert all(r["skipped_at"] == [2] for r in out)
    assert all(torch.equal(out[0]["params"], r["params"]) for r in out)
    assert torch.isfinite(out[0]["params"]).all()
    kept = [i for i in range(out[0]["fed"]) if i // acc != 1]  # the dropped round's micro-batches
    want = _reference(name, config, world, [kept] * world, 3, nodes)
    torch.testing.assert_close(out[0]["params"], want, rtol=0, atol=0)


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_stop_raises_on_every_worker_before_the_step_commits(where):
    out = run_ranks(_loop, 2, "zero1", {}, {(2, 0)}, 5, "stop", where, timeout=120)
    for r in out:
        assert r["steps"] == 2  # steps 1 and 2 committed, step 3 (micro-batch 2) not
        assert f"non-finite {where} in step 3 on rank 0 (--on-nonfinite stop); nothing of step 3 was committed" \
            == r["error"]


@pytest.mark.parametrize("name,config,policy,agreements", [
    ("localsgd", {"sync_every": 2}, "stop", 0),
    ("diloco", {"sync_every": 2}, "stop", 0),
    ("diloco", {"sync_every": 2}, "skip", 4),
    ("ddp", {}, "stop", 4),
], ids=["localsgd-stop", "diloco-stop", "diloco-skip", "ddp-stop"])
def test_stop_adds_no_collective_to_the_inner_steps_of_local_methods(name, config, policy, agreements):
    """Under stop, localsgd and diloco check each inner step on its own worker: no collective on the guard's
    group, where an agreement would be a cross-node round trip on every inner step. skip agrees on every round
    (a round dropped on one worker only would put the workers out of step), as stop does where every step
    communicates anyway (ddp)."""
    out = run_ranks(_loop, 2, name, config, set(), 4, policy, timeout=120)
    assert [r["guard_collectives"] for r in out] == [agreements, agreements]
    assert torch.equal(out[0]["params"], out[1]["params"])


def test_skip_gives_up_after_the_limit():
    out = run_ranks(_loop, 2, "ddp", {}, {(i, 0) for i in range(1, 10)}, 5, "skip", timeout=120)
    assert all("4 rounds in a row" in r["error"] and r["steps"] == 1 for r in out)


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_a_strategy_that_commits_inside_its_step_stops_on_the_worker_that_saw_it(where):
    out = run_ranks(_loop, 1, "acco", {"deterministic_accumulation": 1}, {(3, 0)}, 6, "stop", where, timeout=120)
    assert out[0]["error"] == f"non-finite {where} in step 2 on rank 0 (--on-nonfinite stop)"
    with pytest.raises(ValueError, match="skip is not supported by ACCO"):
        NonFiniteGuard("skip", quietsync.make_strategy("acco", _model(), torch.optim.AdamW, lr=0.01))


def test_nonfinite_entries_names_the_paths():
    state = {"parts": {"round": {"count": 1}, "opt": [{"exp_avg": torch.tensor([1.0, float("inf")])}]},
             "ints": torch.tensor([1, 2]), "count": float("nan"), "ok": torch.zeros(3)}
    assert nonfinite_entries(state) == ["parts.opt[0].exp_avg", "count"]
    assert nonfinite_entries({"a": torch.ones(2), "b": [1.5, {"c": 2}]}) == []
    # finite values whose sum overflows are finite (the fast check falls back to the exact one)
    assert nonfinite_entries({"big": torch.full((10,), 3e38), "half": torch.full((9,), 6e4, dtype=torch.float16)}) == []
    assert nonfinite_entries({"half": torch.tensor([1.0, float("-inf")], dtype=torch.bfloat16)}) == ["half"]


def _save_check(rank: int, world: int, bad_rank: int) -> str:
    s = quietsync.make_strategy("zero1", _model(), torch.optim.AdamW, lr=0.01)
    guard = NonFiniteGuard("stop", s)
    try:
        s.forward_backward(_batch(0, rank), lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
        s.step()
        state = s.state_dict()
        guard.check_state(state, s.steps)  # all finite: passes on every worker
        if rank == bad_rank:
            state["parts"]["sharded"]["shard"]["optimizer"]["state"][0]["exp_avg_sq"][0] = float("inf")
        try:
            guard.check_state(state, s.steps)
        except NonFiniteError as e:
            return str(e)
        return "saved"
    finally:
        guard.close()
        s.close()


def test_a_state_that_is_not_finite_on_one_worker_is_refused_on_every_worker():
    out = run_ranks(_save_check, 2, 1, timeout=120)
    assert out[0] == "the state after step 1 is not finite on rank 1; no checkpoint of it is written"
    assert out[1] == ("the state after step 1 is not finite on rank 1 (here: parts.sharded.shard.optimizer.state.0"
                      ".exp_avg_sq); no checkpoint of it is written")


def _end_check(rank: int, world: int, name: str) -> str:
    s = quietsync.make_strategy(name, _model(), torch.optim.AdamW, lr=0.01)
    guard = NonFiniteGuard("stop", s)
    try:
        while not s.step():
            s.forward_backward(_batch(s.micro_batches, rank), lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
        guard.check_parameters()  # all finite: passes on every worker
        if rank == 1:
            with torch.no_grad():
                next(s.module.parameters())[0, 0] = float("inf")  # as an overflowing optimizer step would
        try:
            guard.check_parameters()
        except NonFiniteError as e:
            return str(e)
        return "finished"
    finally:
        guard.close()
        s.close()


def test_a_run_whose_parameters_are_not_finite_does_not_end_successfully():
    out = run_ranks(_end_check, 2, "ddp", timeout=120)
    want = "the committed parameters after step 1 are not finite on rank 1; the run is not exported"
    assert out == [want, want]


def test_skip_is_refused_at_parse_time_for_strategies_that_cannot_drop_a_round(capsys):
    refused = [n for n in available() if not get(n)[0].discards_rounds]
    assert {"acco", "dpu", "wp", "cdp"} <= set(refused)
    for strategy in refused:
        with pytest.raises(SystemExit) as e:
            parse_train_args(["--strategy", strategy, "--on-nonfinite", "skip"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--on-nonfinite skip is not supported by strategy {strategy}" in err
        assert "zero1" in err
    for strategy in set(available()) - set(refused):
        cfg, _, _ = parse_train_args(["--strategy", strategy, "--on-nonfinite", "skip"])
        assert cfg.on_nonfinite == "skip"
    with pytest.raises(SystemExit):
        parse_train_args(["--on-nonfinite", "maybe"])
    with pytest.raises(SystemExit):
        parse_train_args(["--nonfinite-skip-limit", "0"])
    assert "--nonfinite-skip-limit must be an integer >= 1, got 0" in capsys.readouterr().err


def _finite_checkpoint(folder) -> bool:
    return all(nonfinite_entries(torch.load(f, weights_only=False)) == [] for f in sorted(folder.glob("rank*.pt")))


@pytest.mark.parametrize("strategy", ["zero1", "acco"])
def test_a_diverging_run_stops_naming_the_step_and_leaves_no_bad_checkpoint(strategy, tmp_path):
    """`--lr 1e6`: the loss is NaN from step 2 (acco: at its first estimate); the job exits non-zero naming the
    step and the newest checkpoint, which is finite; no summary or exported model claims success."""
    out = tmp_path / "run"
    proc = train(*small_job(tmp_path), "--strategy", strategy, "--max-steps", "6", "--save-every", "1",
                 "--lr", "1e6", "--out", str(out))
    assert proc.returncode not in (0, 2), proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    newest = latest_checkpoint(out, [0, 1])
    if strategy == "zero1":  # agreed: both ranks saw it, the launcher reports either
        assert last.endswith("non-finite loss in step 2 on ranks 0, 1 (--on-nonfinite stop); nothing of step 2 "
                             f"was committed; newest checkpoint: {out / 'checkpoints' / 'step-0000001'}"), last
        assert newest.name == "step-0000001" and _finite_checkpoint(newest)
    else:  # the worker that saw it stops alone
        assert re.search(r"worker \d failed: .*NonFiniteError: non-finite loss in step 1 on rank \d "
                         r"\(--on-nonfinite stop\); no checkpoint was written$", last), last
        assert newest is None
    assert not (out / "summary.json").exists() and not (out / "model").exists()


def test_skip_gives_up_on_a_run_that_stays_non_finite(tmp_path):
    out = tmp_path / "run"
    proc = train(*small_job(tmp_path), "--max-steps", "6", "--lr", "1e6", "--on-nonfinite", "skip",
                 "--nonfinite-skip-limit", "2", "--out", str(out))
    assert proc.returncode not in (0, 2), proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "non-finite loss in step 2 on ranks 0, 1: 3 rounds in a row (--on-nonfinite skip gives up after 2, "
        "--nonfinite-skip-limit); nothing of step 2 was committed; no checkpoint was written")


def _train_with_one_nan(rank: int, world: int, argv: list[str], bad_rank: int, bad_call: int) -> dict | None:
    return _workers.train_with_one_nan(argv, bad_rank, bad_call, rank)


def test_skip_drops_a_non_finite_round_and_the_run_finishes_with_identical_workers(tmp_path):
    out = tmp_path / "run"
    argv = [*small_job(tmp_path), "--strategy", "zero1", "--max-steps", "4", "--save-every", "4",
            "--on-nonfinite", "skip", "--no-export", "--out", str(out)]
    cfg, _, _ = parse_train_args(argv)
    lrs = [cfg.lr * warmup_cosine(cfg.warmup, cfg.max_steps, cfg.min_lr_ratio)(k) for k in range(4)]
    summary = run_ranks(_train_with_one_nan, 2, argv, 1, 2, timeout=200, env=OFFLINE)[0]
    assert summary["steps"] == 4 and summary["nonfinite_skips"] == 1
    on_disk = json.loads((out / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert on_disk["nonfinite_skips"] == 1 and on_disk["steps"] == 4 and on_disk["micro_batches"] == 10
    for rank in (0, 1):
        steps = [r for r in read_jsonl(out / f"metrics-rank{rank}.jsonl") if "event" not in r]
        assert [r["step"] for r in steps] == [1, 2, 3, 4]
        assert [r.get("skipped_rounds", 0) for r in steps] == [0, 1, 0, 0]
        assert all(math.isfinite(r["loss"]) for r in steps)
        assert [r["micro_batches"] for r in steps] == [1, 2, 1, 1]  # the dropped micro-batch counts in step 2
        assert [r["lr"] for r in steps] == pytest.approx(lrs)  # the schedule did not advance on the skip
    folder = out / "checkpoints" / "step-0000004"
    assert _finite_checkpoint(folder)
    states = [torch.load(folder / f"rank{r}.pt", weights_only=False)["strategy"] for r in (0, 1)]
    assert torch.equal(states[0]["parts"]["sharded"]["params"], states[1]["parts"]["sharded"]["params"])


@pytest.mark.timeout(120)  # well inside the transport's 300 s timeout: the launcher must stop the peer, not it
@pytest.mark.parametrize("strategy,flags,spawned", [
    ("localsgd", ["--sync-every", "4"], False),
    ("diloco", ["--sync-every", "4", "--fragments", "2", "--overlap-delay", "1"], True),  # streaming, overlapped
], ids=["localsgd-forked", "diloco-streaming-spawned"])
def test_a_nan_on_one_worker_of_a_local_method_stops_the_job_naming_it(strategy, flags, spawned, tmp_path):
    """Rank 1's loss is NaN at inner step 6: it raises before the step commits, alone (no agreement); rank 0
    trains on to its next sync, where it waits for rank 1 until the launcher stops it. The job fails naming
    rank 1 and the step; nothing of the step is in a checkpoint, a summary or an exported model. ``spawned``: the
    real launcher (fresh interpreters, its own teardown); else the tests' forked one."""
    from quietsync.cli.launch import WorkerFailed, launch
    from tests.launcher import launch_forked

    out = tmp_path / "run"
    argv = [*small_job(tmp_path), "--strategy", strategy, *flags, "--max-steps", "12", "--save-every", "4",
            "--out", str(out)]
    with pytest.raises(WorkerFailed) as failed:
        (launch if spawned else launch_forked)(_workers.train_with_one_nan, (argv, 1, 6), nproc=2)
    newest = out / "checkpoints" / "step-0000004"
    message = str(failed.value)
    assert message.startswith("worker 1 failed: ") and message.endswith(
        "NonFiniteError: non-finite loss in step 6 on rank 1 (--on-nonfinite stop); nothing of step 6 was committed "
        f"on rank 1; newest checkpoint: {newest}"), message
    assert latest_checkpoint(out, [0, 1]) == newest and _finite_checkpoint(newest)
    assert not (out / "summary.json").exists() and not (out / "model").exists()
