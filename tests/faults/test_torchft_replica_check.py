"""``--check-replicas-every`` under ``--fault-tolerance torchft`` with ``--on-replicas-differ heal``: a replica group
whose committed parameters differ from the others' (one bit flipped, as a memory error would) leaves after the
check's verdict reaches it, and, started again, heals from a live peer while the others go on; the run ends with every
worker's parameters the same."""

from __future__ import annotations

import json
import time

import pytest

import quietsync.faults  # noqa: F401  (before torchft: its Rust log level is read at import)

from .torchft_replicas import Replicas, job_flags, records, wait_exit

torchft = pytest.importorskip("torchft")

pytestmark = pytest.mark.timeout(240)


@pytest.mark.long
@pytest.mark.parametrize(("groups", "workers", "odd"), [(2, 1, 1), (2, 2, 1), (3, 1, 0)])
def test_a_replica_group_whose_parameters_differ_leaves_and_heals_while_the_others_go_on(tmp_path, groups, workers,
                                                                                        odd):
    """Two groups: no majority, the one without rank 0 leaves (with two workers a group, its last worker alone sees
    its counterpart differ: the whole group leaves). Three: the majority stays, even when the odd one holds rank 0."""
    out = tmp_path / "run"
    release = tmp_path / "odd-one-is-up"
    replicas = Replicas(tmp_path, groups, job_flags(tmp_path, out, "--strategy", "ddp", "--max-steps", "12",
                                                    "--check-replicas-every", "2", "--on-replicas-differ", "heal",
                                                    "--no-export"))
    flipped = odd * workers + workers - 1  # the odd group's last worker
    others = [k for k in range(groups) if k != odd]
    try:
        go = f"step:0:{tmp_path / 'go'}"  # all in the first quorum
        procs = {k: replicas.start(k, {"QUIETSYNC_FT_HOLD": f"{go},step:9:{release}"}, workers=workers)
                 for k in others}
        procs[odd] = replicas.start(odd, {"QUIETSYNC_FLIP_BIT": f"{flipped}:3", "QUIETSYNC_FT_HOLD": go},
                                    workers=workers)
        replicas.go(tmp_path / "go", list(range(groups)))
        # step 4's check rides in step 5's vote; the odd group leaves after logging step 5, all its workers
        assert wait_exit(replicas, procs[odd]) == 1, replicas.logs()
        assert (f"after step 4 the committed parameters of replica group {odd} differ from the other groups' "
                "(--on-replicas-differ heal): it leaves, and heals from a live peer when started again"
                ) in replicas.logs()
        assert "error: replica group" not in replicas.logs()  # leaving to heal is what was asked for
        deadline = time.monotonic() + 90
        while not any(r["members"] == others for r in records(out, others[0] * workers)):  # the others go on
            assert time.monotonic() < deadline, replicas.logs()
            time.sleep(0.05)
        procs[odd] = replicas.rejoin(odd, release, workers=workers)  # the memory error gone: it heals from a peer
        for k in range(groups):
            assert wait_exit(replicas, procs[k]) == 0, replicas.logs()
    finally:
        replicas.close()
    survivor, returned = records(out, others[0] * workers), records(out, odd * workers)  # worker 0 of each
    # the records of the worker at the flipped one's place in a group that stayed
    checks = {r["step"]: r["replicas"]["differ"] for r in records(out, others[0] * workers + workers - 1)
              if "replicas" in r}
    assert checks[3] == [] and checks[5] == [flipped], checks  # the check of step 2, then of step 4
    after = [d for s, d in checks.items() if s > 5]
    assert after and all(d == [] for d in after), checks  # healed: the same parameters again
    assert survivor[-1]["healed"] == 0 and returned[-1]["healed"] == 1 and returned[-1]["step"] == survivor[-1]["step"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["replicas"]["differ"] == [] and summary["replicas"]["checked"]
