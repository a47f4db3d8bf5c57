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
@pytest.mark.parametrize("workers", [1, 2])
def test_a_replica_group_whose_parameters_differ_leaves_and_heals_while_the_other_goes_on(tmp_path, workers):
    out = tmp_path / "run"
    release = tmp_path / "replica1-is-up"
    replicas = Replicas(tmp_path, 2, job_flags(tmp_path, out, "--strategy", "ddp", "--max-steps", "12",
                                               "--check-replicas-every", "2", "--on-replicas-differ", "heal",
                                               "--no-export"))
    flipped = 2 * workers - 1  # group 1's last worker: with two, its other worker sees its own counterpart agree
    try:
        go = f"step:0:{tmp_path / 'go'}"  # both in the first quorum
        r0 = replicas.start(0, {"QUIETSYNC_FT_HOLD": f"{go},step:9:{release}"}, workers=workers)
        r1 = replicas.start(1, {"QUIETSYNC_FLIP_BIT": f"{flipped}:3", "QUIETSYNC_FT_HOLD": go}, workers=workers)
        replicas.go(tmp_path / "go", [0, 1])
        # step 4's check rides in step 5's vote; replica group 1 leaves after logging step 5, all its workers
        assert wait_exit(replicas, r1) == 1, replicas.logs()
        assert ("after step 4 the committed parameters of replica group 1 differ from the other groups' "
                "(--on-replicas-differ heal): it leaves, and heals from a live peer when started again"
                ) in replicas.logs()
        deadline = time.monotonic() + 90
        while not any(r["members"] == [0] for r in records(out, 0)):  # the other goes on alone
            assert time.monotonic() < deadline, replicas.logs()
            time.sleep(0.05)
        r1 = replicas.rejoin(1, release, workers=workers)  # the memory error gone: it heals from replica group 0
        assert wait_exit(replicas, r0) == 0, replicas.logs()
        assert wait_exit(replicas, r1) == 0, replicas.logs()
    finally:
        replicas.close()
    survivor, returned = records(out, 0), records(out, workers)  # worker 0 of each group
    checks = {r["step"]: r["replicas"]["differ"] for r in records(out, workers - 1) if "replicas" in r}
    assert checks[3] == [] and checks[5] == [flipped], checks  # group 0's worker of the flipped one's place
    after = [d for s, d in checks.items() if s > 5]
    assert after and all(d == [] for d in after), checks  # healed: the same parameters again
    assert survivor[-1]["healed"] == 0 and returned[-1]["healed"] == 1 and returned[-1]["step"] == survivor[-1]["step"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["replicas"]["differ"] == [] and summary["replicas"]["checked"]
