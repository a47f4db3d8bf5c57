"""Harder failures of a ``--fault-tolerance torchft`` job, with real processes (``SIGKILL``), each run audited:
no step committed twice, no window lost or read twice (:func:`~tests.faults.torchft_replicas.audit`).

* **Two replicas lost at the same moment** -- of 3 (ddp), replicas 1 and 2 die in the same step, after computing
  their micro-batches: replica 0 commits that step alone (their windows given back) and trains on alone; both are
  started again, heal from replica 0 and all three finish together.
* **A replica lost while another heals** -- replica 2 returns and heals from replica 0; while replica 0 is inside
  the transfer (held there), replica 1 is killed. The heal completes, replicas 0 and 2 commit their next step
  without replica 1 (retried among the survivors; replica 2, just healed, takes it without data of its own: the
  asynchronous join), replica 1 is started again and heals in turn.
* **The Lighthouse lost and started again** -- the replicas go on: a round start the Lighthouse does not answer is
  asked again (``faults/quorum.py``), and the Lighthouse started again at the same address forms the quorum afresh
  from the replicas that ask. Every replica says so in one line; a replica lost before the Lighthouse died (so the
  new Lighthouse's quorum numbers repeat ones the job used) heals after it came back.
* **A replica group out of restarts** -- under the local launcher, replica group 1 dies more often than
  ``--replica-restarts`` allows (``QUIETSYNC_FT_KILL_GROUP``): it is left dead, replica group 0 finishes the run
  alone and the job's last line names group 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import quietsync.faults  # noqa: F401  (before torchft: its Rust log level is read at import)

from .torchft_replicas import AUDIT, KILLED, OFFLINE, Replicas, audit, job_flags, merged, records, wait_exit

torchft = pytest.importorskip("torchft")

pytestmark = pytest.mark.timeout(240)


def _audited(out: Path, replicas: int) -> dict:
    """The audit (every window committed once, none skipped), and the summary's fault-tolerance section."""
    committed, summary = audit(out, replicas)
    assert len(set(committed)) == len(committed), "a window trained twice"
    held = summary["windows_held"]
    assert sorted(committed + held) == list(range(summary["windows_dealt"])), "a window skipped"
    return summary


def _steps(out: Path, rank: int) -> list[int]:
    steps = [r["step"] for r in records(out, rank)]
    assert steps == sorted(set(steps)), f"worker {rank} logged a step twice: {steps}"
    return steps


def test_two_replicas_lost_at_once_the_survivor_goes_on_and_both_heal(tmp_path):
    out = tmp_path / "run"
    replicas = Replicas(tmp_path, 3, job_flags(tmp_path, out, "--strategy", "ddp", "--max-steps", "24"))
    try:
        go = f"step:0:{tmp_path / 'go'}"
        back = tmp_path / "both-back"
        r0 = replicas.start(0, {"QUIETSYNC_FT_HOLD": f"{go},step:12:{back}"})
        r1 = replicas.start(1, {"QUIETSYNC_FT_KILL": "step:5", "QUIETSYNC_FT_HOLD": go})
        r2 = replicas.start(2, {"QUIETSYNC_FT_KILL": "step:5", "QUIETSYNC_FT_HOLD": go})
        replicas.go(tmp_path / "go", [0, 1, 2])
        assert wait_exit(replicas, r1) == KILLED and wait_exit(replicas, r2) == KILLED
        ready = [tmp_path / f"ready{k}" for k in (1, 2)]
        r1 = replicas.start(1, {"QUIETSYNC_FT_READY": str(ready[0])})
        r2 = replicas.start(2, {"QUIETSYNC_FT_READY": str(ready[1])})
        for path in ready:
            replicas.wait_file(path)
        replicas.wait_asking(2, [back])
        back.write_text("")
        for proc in (r0, r1, r2):
            assert wait_exit(replicas, proc) == 0, replicas.logs()
    finally:
        replicas.close()
    assert replicas.alive() == []

    survivor = records(out, 0)
    members = [tuple(r["members"]) for r in survivor]
    assert members[0] == (0, 1, 2) and members[-1] == (0, 1, 2) and (0,) in members, members
    lost = next(r for r in survivor if r["step"] == 5)  # both died in it: replica 0's slot alone committed
    assert lost["retries"] >= 1 and lost["members"] == [0]
    assert len(merged(lost)["committed"]) == 2 and len(merged(lost)["given_back"]) == 4
    for k in (1, 2):
        returned = records(out, k)
        assert returned[-1]["healed"] == 1 and returned[-1]["step"] == survivor[-1]["step"]
        _steps(out, k)
    _steps(out, 0)
    summary = _audited(out, 3)
    assert summary["final_members"] == [0, 1, 2] and summary["schedule_position"] >= 24


def test_a_replica_lost_while_another_heals_from_a_third(tmp_path):
    out = tmp_path / "run"
    replicas = Replicas(tmp_path, 3, job_flags(tmp_path, out, "--strategy", "ddp", "--max-steps", "24"))
    try:
        go = f"step:0:{tmp_path / 'go'}"
        sending, back = tmp_path / "sending", tmp_path / "back"
        # replica 2 heals from replica 0 (torchft's choice: the first up-to-date replica in id order), which holds
        # inside the transfer until replica 1 is gone; replicas 0 and 2 then wait at step 14 for replica 1's return
        r0 = replicas.start(0, {"QUIETSYNC_FT_HOLD": f"{go},heal_send:1:{sending},step:14:{back}"})
        r1 = replicas.start(1, {"QUIETSYNC_FT_HOLD": go})
        r2 = replicas.start(2, {"QUIETSYNC_FT_KILL": "step:4", "QUIETSYNC_FT_HOLD": go})
        replicas.go(tmp_path / "go", [0, 1, 2])
        assert wait_exit(replicas, r2) == KILLED
        r2 = replicas.start(2, {"QUIETSYNC_FT_HOLD": f"step:14:{back}"})
        replicas.wait_file(Path(f"{sending}.waiting"))  # replica 0 is sending replica 2 its state
        r1.kill()
        assert wait_exit(replicas, r1) == KILLED
        sending.write_text("")
        ready = tmp_path / "ready1"
        r1 = replicas.start(1, {"QUIETSYNC_FT_READY": str(ready)})
        replicas.wait_file(ready)
        replicas.wait_asking(1, [back])
        back.write_text("")
        for proc in (r0, r1, r2):
            assert wait_exit(replicas, proc) == 0, replicas.logs()
    finally:
        replicas.close()
    assert replicas.alive() == []

    survivor = records(out, 0)
    members = [tuple(r["members"]) for r in survivor]
    assert (0, 1) in members and members[-1] == (0, 1, 2), members
    # the step after the heal: its quorum held replica 1, dead; committed by replicas 0 and 2 alone -- replica 2,
    # just healed, abstains from it (faults/async_join.py) -- so it holds replica 0's slot, replica 1's and replica
    # 2's given back
    after = next(r for r in survivor if r.get("rounds") and r["step"] > 4 and r["members"] == [0, 2])
    assert after["retries"] >= 1 and len(merged(after)["committed"]) == 2 and len(merged(after)["given_back"]) == 4
    assert [c["members"] for c in after["commits"]] == [[0]], after["commits"]
    healed = records(out, 2)
    assert healed[-1]["healed"] == 1 and records(out, 1)[-1]["healed"] == 1
    for k in range(3):
        _steps(out, k)
    summary = _audited(out, 3)
    assert summary["final_members"] == [0, 1, 2]


@pytest.mark.long
def test_the_replicas_go_on_when_the_lighthouse_is_lost_and_started_again(tmp_path):
    out = tmp_path / "run"
    replicas = Replicas(tmp_path, 3, job_flags(tmp_path, out, "--strategy", "ddp", "--max-steps", "24"),
                        lighthouse_process=True)
    try:
        go = f"step:0:{tmp_path / 'go'}"
        held = [tmp_path / f"lighthouse-gone{k}" for k in (0, 1)]
        back = tmp_path / "back"
        # replica 2 dies first, so the survivors' quorum numbers moved on (the new Lighthouse counts from 1 again)
        r0 = replicas.start(0, {"QUIETSYNC_FT_HOLD": f"{go},step:8:{held[0]},step:16:{back}"})
        r1 = replicas.start(1, {"QUIETSYNC_FT_HOLD": f"{go},step:8:{held[1]},step:16:{back}"})
        r2 = replicas.start(2, {"QUIETSYNC_FT_KILL": "step:3", "QUIETSYNC_FT_HOLD": go})
        replicas.go(tmp_path / "go", [0, 1, 2])
        assert wait_exit(replicas, r2) == KILLED
        for path in held:  # both survivors at the top of step 8, before its quorum
            replicas.wait_file(Path(f"{path}.waiting"))
        replicas.kill_lighthouse()
        for path in held:
            path.write_text("")
        for k in (0, 1):  # each asked for step 8's quorum and got no answer
            replicas.wait_text(f"replica{k}.0.log", "did not answer a quorum request")
        replicas.start_lighthouse()
        ready = tmp_path / "ready2"
        r2 = replicas.start(2, {"QUIETSYNC_FT_READY": str(ready)})
        replicas.wait_file(ready)
        replicas.wait_asking(1, [back])
        back.write_text("")
        for proc in (r0, r1, r2):
            assert wait_exit(replicas, proc) == 0, replicas.logs()
    finally:
        replicas.close()
    assert replicas.alive() == []

    for k in (0, 1):
        log = (tmp_path / f"replica{k}.0.log").read_text()
        assert log.count(f"the Lighthouse at {replicas.address} did not answer") == 1, log
        assert "answered again; training goes on" in log, log
    survivor = records(out, 0)
    members = [tuple(r["members"]) for r in survivor]
    assert (0, 1) in members and members[-1] == (0, 1, 2), members
    # no step lost or repeated: each survivor's steps go up one by one, except where the other formed a quorum with
    # the restarted Lighthouse first (each reconnects after its own retry back-off): the late one heals there
    for k in (0, 1):
        _one_by_one_or_healed(records(out, k))
    every = sorted({r["step"] for k in range(3) for r in records(out, k)})
    assert every == list(range(1, every[-1] + 1)), every
    assert records(out, 2)[-1]["healed"] == 1
    for k in range(3):
        _steps(out, k)
    summary = _audited(out, 3)
    assert summary["final_members"] == [0, 1, 2] and summary["schedule_position"] >= 24


def _one_by_one_or_healed(rows: list[dict]) -> None:
    """The steps of one replica's records go up by one, or jump where that replica healed (it took the state of the
    steps it missed from a peer)."""
    for before, after in zip(rows, rows[1:]):
        assert after["step"] == before["step"] + 1 or (after["step"] > before["step"]
                                                       and after["healed"] == before["healed"] + 1), (before, after)


def test_a_quorum_number_names_the_lighthouse_number_and_the_incarnations_not_their_order():
    from quietsync.faults.quorum import quorum_number

    a, b, b2 = "quietsync_replica_0:1111", "quietsync_replica_1:2222", "quietsync_replica_1:3333"
    assert quorum_number(1, [a, b]) == quorum_number(1, [b, a])
    # a restarted Lighthouse's quorum 1 over other incarnations, or its quorum 2 over the same ones, is another
    assert len({quorum_number(1, [a, b]), quorum_number(1, [a, b2]), quorum_number(2, [a, b])}) == 3
    assert all(0 <= quorum_number(n, [a, b]) < 2 ** 48 for n in range(50))


def test_a_replica_group_out_of_restarts_is_left_dead_and_the_job_says_so_in_one_line(tmp_path, monkeypatch):
    """--replica-restarts 0 and both groups killed at their second step: neither is started again, each is named
    once, and the job's last line says every group ran out (exit 1) -- no hang, no restart."""
    from tests.train._run import train_subprocess

    monkeypatch.setenv("QUIETSYNC_FT_KILL", "step:2")  # both replica groups
    out = tmp_path / "run"
    proc = train_subprocess(*job_flags(tmp_path, out, "--strategy", "ddp", "--max-steps", "6"), "--fault-tolerance",
                            "torchft", "--nproc", "2", "--replica-restarts", "0", timeout=120)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text
    assert "starting it again" not in text
    for k in (0, 1):
        assert (f"replica group {k} ended (killed by SIGKILL) and was restarted 0 time(s) already (--replica-restarts "
                "0): it is not started again, the others go on without it") in proc.stderr, proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1] == ("quietsync train: error: every replica group ended more often "
                                                     "than --replica-restarts 0 allows"), proc.stderr


def test_a_replica_group_out_of_restarts_is_left_dead_while_the_other_finishes_the_run(tmp_path):
    """The local launcher, --replica-restarts 1, replica group 1 killed at its first step in every incarnation:
    started again once (it heals, and dies again), then left dead; replica group 0 finishes the run alone (exit 0),
    the job's last line names group 1, and the audit holds."""
    from quietsync.faults.inject import HOLD_ENV, KILL_ENV, KILL_GROUP_ENV

    out, go, back = tmp_path / "run", tmp_path / "go", tmp_path / "back"
    replicas = Replicas(tmp_path, 2, [])  # its Lighthouse and heartbeat checks; the launcher starts the groups
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    # one environment for both groups (the launcher's): both start in the first quorum, group 0 waits at step 6
    env.update({**OFFLINE, **AUDIT, KILL_ENV: "step:1", KILL_GROUP_ENV: "1", HOLD_ENV: f"step:0:{go},step:6:{back}"})
    argv = [sys.executable, "-m", "quietsync", "train", *job_flags(tmp_path, out, "--strategy", "ddp", "--max-steps",
            "12"), "--fault-tolerance", "torchft", "--lighthouse", replicas.address, "--nodes", "2", "--nproc", "2",
            "--replica-restarts", "1"]
    with open(tmp_path / "launcher.out", "w") as stdout, open(tmp_path / "launcher.err", "w") as stderr:
        proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr, env=env)
    try:
        replicas.go(go, [0, 1])
        # group 0 must not end the run before group 1's second incarnation died: released at step 6 once that one
        # asks to join (it heals there and dies in its first step), or once it died (it healed before step 6)
        deadline = time.monotonic() + 120
        while not ("restarted 1 time(s) already" in (tmp_path / "launcher.err").read_text()
                   or (Path(f"{back}.waiting").exists() and replicas.asking() >= 1)):
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "launcher.err").read_text()
            time.sleep(0.05)
        back.write_text("")
        proc.wait(150)
    finally:
        if proc.poll() is None:
            proc.kill()  # its replica groups die with it
            proc.wait(10)
        replicas.close()
    text, err = (tmp_path / "launcher.out").read_text(), (tmp_path / "launcher.err").read_text()
    assert proc.returncode == 0, text + err
    assert "replica group 1 ended (killed by SIGKILL); starting it again (restart 1 of 1)" in text, text
    assert ("replica group 1 ended (killed by SIGKILL) and was restarted 1 time(s) already (--replica-restarts 1): "
            "it is not started again, the others go on without it") in err, err
    assert "replica group 0 ended" not in text + err
    assert "(replica group 1 not present at the end)" in text, text  # its heal is not reported as none
    assert err.rstrip().splitlines()[-1] == ("quietsync train: replica group 1 ended more often than "
                                             "--replica-restarts 1 allows and was left dead; the others finished the "
                                             "run without it"), err
    survivor = records(out, 0)
    # each incarnation of group 1 died inside a step of group 0's quorum (retried alone); the second healed first
    assert sum(r["retries"] >= 1 for r in survivor) == 2 and {tuple(r["members"]) for r in survivor} == {(0,)}
    assert any("sent_bytes" in p for r in survivor for p in r.get("rounds", [])), "group 1 never healed"
    _steps(out, 0)
    summary = _audited(out, 2)
    assert summary["final_members"] == [0] and summary["schedule_position"] >= 12
    whole = json.loads((out / "summary.json").read_text())
    assert whole["micro_batches"] * 2 == summary["windows_committed"], whole


def test_a_kill_confined_to_one_replica_group_leaves_the_others_environment_without_it():
    from quietsync.faults.inject import KILL_ENV, KILL_GROUP_ENV, group_environment

    env = {KILL_ENV: "step:2", KILL_GROUP_ENV: "1", "OTHER": "x"}
    assert group_environment(env, 1) == env
    assert group_environment(env, 0) == {KILL_GROUP_ENV: "1", "OTHER": "x"}
    assert group_environment({KILL_ENV: "step:2"}, 0) == {KILL_ENV: "step:2"}  # without it: every group
    with pytest.raises(ValueError, match=KILL_GROUP_ENV):
        group_environment({KILL_ENV: "step:2", KILL_GROUP_ENV: "one"}, 0)


def test_a_hold_confined_to_one_replica_group_leaves_the_others_environment_without_it():
    from quietsync.faults.inject import HOLD_ENV, HOLD_GROUP_ENV, KILL_ENV, KILL_GROUP_ENV, group_environment

    env = {HOLD_ENV: "step:4:/x", HOLD_GROUP_ENV: "2", KILL_ENV: "step:2", KILL_GROUP_ENV: "1"}
    assert group_environment(env, 2) == {HOLD_ENV: "step:4:/x", HOLD_GROUP_ENV: "2", KILL_GROUP_ENV: "1"}
    assert group_environment(env, 1) == {HOLD_GROUP_ENV: "2", KILL_ENV: "step:2", KILL_GROUP_ENV: "1"}
    with pytest.raises(ValueError, match=HOLD_GROUP_ENV):
        group_environment({HOLD_ENV: "step:2:/x", HOLD_GROUP_ENV: "-1"}, 0)
