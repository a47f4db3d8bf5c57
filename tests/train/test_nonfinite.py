"""The non-finite policy: a NaN/inf loss or gradient never becomes a committed step or a checkpoint; with
``skip`` every worker drops the same round and the replicas stay identical."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import quietsync
from quietsync.strategies import available, get
from quietsync.train.args import parse_train_args
from quietsync.train.checkpoint import latest_checkpoint
from quietsync.train.nonfinite import NonFiniteError, NonFiniteGuard, nonfinite_entries
from tests.distributed import run_ranks

from .conftest import synthetic_text

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
    i, skipped_at = 0, []
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
        return {"params": params, "skipped": guard.skipped, "skipped_at": skipped_at, "fed": i}
    except NonFiniteError as e:
        return {"error": str(e), "steps": s.steps}
    finally:
        guard.close()
        s.close()


def _reference(name: str, config: dict, world: int, feed: list[list[int]], steps: int, nodes: int | None) -> torch.Tensor:
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
    ("diloco", {"sync_every": 2}, 2, None),
    ("diloco", {"sync_every": 2, "inner": "ddp"}, 4, 2),  # hierarchical: DDP inside each of 2 nodes
    ("diloco", {"sync_every": 2, "inner": "zero1", "accumulation": 2}, 4, 2),
]


@pytest.mark.parametrize("name,config,world,nodes", SKIPPERS,
                         ids=[f"{n}-{c.get('inner', 'flat')}" if n == "diloco" else n for n, c, _, _ in SKIPPERS])
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


def test_a_diverging_run_stops_naming_the_step_and_leaves_no_bad_checkpoint(tmp_path):
    """`--lr 1e6`: the loss is NaN from step 2; the job exits non-zero naming it, and the newest checkpoint
    is step 1's (finite); no summary claims success."""
    data = tmp_path / "text.txt"
    data.write_text(synthetic_text(2000))
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run([
        sys.executable, "-m", "quietsync.train.cli", "train", "--nproc", "2", "--model", "tiny", "--max-steps", "6",
        "--micro-batch-size", "2", "--seq-len", "32", "--vocab-size", "300", "--dataset", str(data),
        "--cache-dir", str(tmp_path / "cache"), "--eval-every", "0", "--eval-windows", "4", "--no-progress",
        "--no-plot", "--no-export", "--save-every", "1", "--lr", "1e6", "--out", str(out),
    ], capture_output=True, text=True, env=env, timeout=200)
    assert proc.returncode != 0
    assert "non-finite loss or gradient in step 2" in proc.stderr.strip().splitlines()[-1]
    assert latest_checkpoint(out, [0, 1]).name == "step-0000001"
    assert not (out / "summary.json").exists()
