"""Every strategy that runs under ``--fault-tolerance torchft`` (:func:`quietsync.faults.support.policies`) does,
for real: two replica groups against a Lighthouse, replica group 1 killed (``SIGKILL``) after a step's
micro-batches, before its exchange; replica group 0 commits that step and the next ones alone (its quorum holds
only itself; it is held at step 9 meanwhile) until replica group 1, started again once it did, heals from it and
joins; both finish (exit 0) at the same step.

What is checked is what the policy states for every strategy: the survivor goes on without a restart (one
incarnation of it, no heal), the returning one healed once from it, the quorums seen are ``[0, 1]``, ``[0]`` and
``[0, 1]`` again, and every data window dealt is committed exactly once (the lost replica's windows of the
unfinished step or round go back and are dealt again). What each strategy does with the missing replica's
residual or momentum, and what a returning one takes, is checked in ``test_heal_rules.py`` (the ddp and diloco
cases with a one-process replay and a kill mid-outer-sync in ``test_torchft.py``).

Parametrised over the state each strategy keeps: flexdemo shards inside a replica group of 2 workers (worker i
heals from worker i; its export gathers the shards; zero1 does the same and is run here with one worker to keep
the suite short -- a replica group of 2 starts 2 more processes at each start), localsgd and diloco keep local
parameters between syncs (streaming: a fragment in flight; SparseLoCo: an error-feedback residual), demo a
decoupled momentum.
"""

from __future__ import annotations

import json
import time

import pytest

import quietsync.faults  # noqa: F401  (before torchft: its Rust log level is read at import)
from quietsync.faults.support import policies

from .torchft_replicas import KILLED, Replicas, audit, job_flags, records, wait_exit

torchft = pytest.importorskip("torchft")

pytestmark = pytest.mark.timeout(240)

CASES = {
    "zero1": (["--strategy", "zero1"], 1),
    "localsgd": (["--strategy", "localsgd", "--sync-every", "3"], 1),
    "diloco-streaming": (["--strategy", "diloco", "--sync-every", "4", "--fragments", "2", "--overlap-delay", "1"],
                         1),
    "diloco-sparseloco": (["--strategy", "diloco", "--sync-every", "3", "--outer", "sparseloco",
                           "--pseudo-grad-dtype", "int2"], 1),
    "demo": (["--strategy", "demo"], 1),
    "flexdemo": (["--strategy", "flexdemo"], 2),
}


def wait_until(condition, replicas: Replicas, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not reached within {timeout:g}s:\n{replicas.logs()}"
        time.sleep(0.05)


def test_every_supported_strategy_is_exercised_here_or_in_test_torchft():
    exercised = {name.split("-")[0] for name in CASES} | {"ddp", "diloco"}  # test_torchft.py: ddp, diloco
    assert exercised == set(policies()) - {"signsgd"}  # signsgd: the example's, if imported


@pytest.mark.long
@pytest.mark.parametrize("case", CASES)
def test_the_survivor_goes_on_alone_and_the_returning_replica_heals(tmp_path, case):
    flags, workers = CASES[case]
    out = tmp_path / "run"
    release = tmp_path / "replica1-is-up"
    replicas = Replicas(tmp_path, 2, job_flags(tmp_path, out, *flags, "--max-steps", "16", "--no-export"))
    try:
        go = f"step:0:{tmp_path / 'go'}"  # both in the first quorum
        r0 = replicas.start(0, {"QUIETSYNC_FT_HOLD": f"{go},step:9:{release}"}, workers=workers)
        r1 = replicas.start(1, {"QUIETSYNC_FT_KILL": "step:5", "QUIETSYNC_FT_HOLD": go}, workers=workers)
        replicas.go(tmp_path / "go", [0, 1])
        # one worker: SIGKILL; two: both die at the same point and the group's launcher reports the failure (1)
        assert wait_exit(replicas, r1) == (KILLED if workers == 1 else 1), replicas.logs()
        wait_until(lambda: any(r["members"] == [0] for r in records(out, 0)), replicas)  # it goes on alone
        r1 = replicas.rejoin(1, release, workers=workers)  # the survivor, let go, takes it in
        assert wait_exit(replicas, r0) == 0, replicas.logs()
        assert wait_exit(replicas, r1) == 0, replicas.logs()
    finally:
        replicas.close()
    assert replicas.alive() == []

    survivor, returned = records(out, 0), records(out, workers)  # worker 0 of each replica group
    members = [r["members"] for r in survivor]
    assert members[0] == [0, 1] and [0] in members and members[-1] == [0, 1], members  # no restart
    assert survivor[-1]["healed"] == 0 and [r["step"] for r in survivor] == list(range(1, len(survivor) + 1))
    assert returned[-1]["healed"] == 1 and returned[-1]["step"] == survivor[-1]["step"]
    # the join's phases are on record, on both sides, in the order they happen
    healed = next(r for r in returned if "start" in r and r["healed"] == 1)
    joined = [x for x in healed["rounds"] if "applied" in x][-1]
    assert 0 <= joined["quorum"] <= joined["connected"] <= joined["recv_start"] <= joined["received"] \
        <= joined["deserialized"] <= joined["applied"] <= joined["returned"], joined
    assert healed["start"]["model"] <= healed["start"]["warm"] <= healed["start"]["ready"] <= healed["start"]["joined"]
    served = [x for r in survivor for x in r.get("rounds", []) if x.get("sent_bytes")]
    assert len(served) == 1 and served[0]["members"] == [0, 1], served
    assert served[0]["connected"] <= served[0]["snapshot"] <= served[0]["serialized"] <= served[0]["sent"]
    committed, summary = audit(out, 2, workers)  # keyed by commit, not by the step a commit was logged at
    assert len(set(committed)) == len(committed), "a window trained twice"
    held = summary["windows_held"]
    assert sorted(committed + held) == list(range(summary["windows_dealt"])), "a window skipped"
    # the job's committed micro-batches (2 windows each), whatever the returning replica's own counter says
    whole = json.loads((out / "summary.json").read_text())
    assert whole["micro_batches"] * 2 == len(committed)
    # the healed replica took the survivor's state: every worker of both groups ends with the same parameters
    assert whole["replicas"] == {"checked": True, "differ": []}
