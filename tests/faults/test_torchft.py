"""``--fault-tolerance torchft`` for real: replica groups as separate processes against a Lighthouse, killed with
``SIGKILL`` at precise points of the protocol, started again, and checked on what the run wrote.

* **ddp, 3 replicas** -- replica 2 is killed mid-step (its micro-batches computed, before its gradient exchange);
  replicas 0 and 1 go on at their next step without restarting (the step in flight is committed with the two of
  them). Replica 2 is started again and heals from replica 0, which is killed while sending it its state: replica
  2 stops (exit 1, "heal failed"), is started once more and heals from replica 1. The final model equals a
  one-process replay of the logged commits (each step: AdamW on the mean gradient of the windows the replicas
  present committed, at the logged learning rate) -- the oracle of "the step's average over the replicas
  present" and of an exact heal; every window dealt is committed once (the data audit).
* **diloco, 2 replicas** -- replica 1 is killed mid-outer-sync (the survivor is inside the pseudo-gradient
  all-reduce, waiting for it); the survivor commits the sync alone and gives replica 1's windows of the round back;
  replica 1, started again, heals (θ_global, outer momentum, data position) and both finish on the same θ_global.

Each test ends with every process it started gone, and states every exit status.
"""

from __future__ import annotations

import json

import pytest
import torch

import quietsync.faults  # noqa: E402,F401  (before torchft: its Rust log level is read at import)

from .ddp_replay import replay
from .torchft_replicas import KILLED, Replicas, audit, job_flags, merged, records, wait_exit

torchft = pytest.importorskip("torchft")

pytestmark = pytest.mark.timeout(240)



def test_ddp_survivors_go_on_and_returning_replicas_heal_even_when_their_source_dies(tmp_path):
    out = tmp_path / "run"
    release = tmp_path / "replica2-is-up"
    replicas = Replicas(tmp_path, 3, job_flags(tmp_path, out, "--strategy", "ddp", "--max-steps", "30"))
    try:
        go = f"step:0:{tmp_path / 'go'}"  # every replica in the first quorum
        r0 = replicas.start(0, {"QUIETSYNC_FT_KILL": "heal_send:1", "QUIETSYNC_FT_HOLD": f"{go},step:12:{release}"})
        r1 = replicas.start(1, {"QUIETSYNC_FT_HOLD": go})
        r2 = replicas.start(2, {"QUIETSYNC_FT_KILL": "step:6", "QUIETSYNC_FT_HOLD": go})
        replicas.go(tmp_path / "go", [0, 1, 2])
        assert wait_exit(replicas, r2) == KILLED  # killed mid-step
        r2 = replicas.start(2)  # heals from replica 0, which dies sending: it stops
        replicas.wait_restarted(2)
        release.write_text("")
        assert wait_exit(replicas, r0) == KILLED  # killed while replica 2 heals from it
        assert wait_exit(replicas, r2) == 1, replicas.logs()
        assert "heal" in (tmp_path / "replica2.1.log").read_text()
        r2 = replicas.start(2)  # heals from replica 1
        assert wait_exit(replicas, r1) == 0, replicas.logs()
        assert wait_exit(replicas, r2) == 0, replicas.logs()
    finally:
        replicas.close()
    assert replicas.alive() == []

    survivor = records(out, 1)
    members = [tuple(r["members"]) for r in survivor]
    assert members[0] == (0, 1, 2) and (0, 1) in members and members[-1] == (1, 2), sorted(set(members))
    lost = next(r for r in survivor if merged(r)["given_back"])  # the step replica 2 died in: 2 slots committed
    assert len(merged(lost)["committed"]) == 4 and len(merged(lost)["given_back"]) == 2 and lost["retries"] >= 1
    healed = records(out, 2)
    assert healed[-1]["healed"] == 1 and healed[-1]["step"] == survivor[-1]["step"]
    committed, summary = audit(out, 3)
    assert len(set(committed)) == len(committed), "a window trained twice"
    held = summary["windows_held"]  # replica 0's slot of the last step
    assert sorted(committed + held) == list(range(summary["windows_dealt"])), "a window skipped"
    assert len(held) == 2 and summary["schedule_position"] >= 30 and summary["final_members"] == [1, 2]

    from safetensors.torch import load_file

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is faster, and spares the other core
    try:
        reference = replay(tmp_path, [r for r in survivor if "commits" in r]).state_dict()
    finally:
        torch.set_num_threads(threads)
    trained = load_file(str(out / "model" / "model.safetensors"))
    diff = max(float((reference[name] - value).abs().max()) for name, value in trained.items())
    # measured 2.6e-6 on one CPU and up to 4.6e-5 on another (float summation order: gloo's reduction and the
    # replay's sum differ); a replay that skips one step, or shifts the lr by one, is off by 2.2e-4 to 6e-2
    assert diff < 1e-4, f"the run's model differs from the one-process replay of its commits by {diff}"


def test_diloco_survivor_commits_the_outer_sync_alone_and_the_returning_replica_heals(tmp_path):
    out = tmp_path / "run"
    release = tmp_path / "replica1-is-up"
    replicas = Replicas(tmp_path, 2, job_flags(tmp_path, out, "--strategy", "diloco", "--sync-every", "4",
                                            "--max-steps", "24"))
    try:
        # exchanges: 1 the start check, 2 the sync after step 4, 3 the sync after step 8 (killed inside it)
        go = f"step:0:{tmp_path / 'go'}"  # both replicas in the first quorum
        r0 = replicas.start(0, {"QUIETSYNC_FT_HOLD": f"{go},step:14:{release}"})
        r1 = replicas.start(1, {"QUIETSYNC_FT_KILL": "exchange:3", "QUIETSYNC_FT_HOLD": go})
        replicas.go(tmp_path / "go", [0, 1])
        assert wait_exit(replicas, r1) == KILLED
        r1 = replicas.start(1)
        replicas.wait_restarted(1)
        release.write_text("")
        assert wait_exit(replicas, r0) == 0, replicas.logs()
        assert wait_exit(replicas, r1) == 0, replicas.logs()
    finally:
        replicas.close()
    assert replicas.alive() == []

    survivor = records(out, 0)
    sync = next(r for r in survivor if r["step"] == 8)
    assert sync["retries"] >= 1 and sync["members"] == [0] and sync["extra"]["synced"]
    assert len(merged(sync)["committed"]) == 8 and len(merged(sync)["given_back"]) == 8  # 4 steps x 2 windows
    returned = records(out, 1)
    assert returned[-1]["healed"] == 1 and returned[-1]["members"] == [0, 1]
    # the closing line (printed by replica group 0, which led the end) names the group that healed, not its own
    closing = (tmp_path / "replica0.0.log").read_text()
    assert "; replica group 1 healed 1 time; results in" in closing, closing[-2000:]
    committed, summary = audit(out, 2)
    assert len(set(committed)) == len(committed), "a window trained twice"
    held = summary["windows_held"]
    assert sorted(committed + held) == list(range(summary["windows_dealt"])) and held == [], "a window skipped"
    assert summary["heals"] == [0, 1]
    # the job's committed micro-batches, not the present replicas' own counters (replica 1's restarted at 0)
    whole = json.loads((out / "summary.json").read_text())
    assert whole["micro_batches"] * 2 == len(committed) and whole["tokens"] == len(committed) * 32, whole
    evals = [[json.loads(line)["loss"] for line in (out / f"metrics-rank{k}.jsonl").read_text().splitlines()
              if '"eval"' in line][-1] for k in (0, 1)]
    assert evals[0] == evals[1], f"the replicas ended on different theta_global: {evals}"


def test_the_closing_line_names_every_group_that_healed():
    from quietsync.train.replica_loop import heals_text

    assert heals_text([0, 1]) == "replica group 1 healed 1 time"
    assert heals_text([2, 0, 1]) == "replica group 0 healed 2 times, replica group 2 healed 1 time"
    assert heals_text([0, 0]) == "no replica group healed"
    # a group gone at the end took its own count with it: it is not said to have healed 0 times
    assert heals_text([0, 0], present=[0]) == "no replica group present at the end healed (replica group 1 not " \
        "present at the end)"
    assert heals_text([1, 0, 0], present=[0]) == "replica group 0 healed 1 time (replica groups 1, 2 not present " \
        "at the end)"
