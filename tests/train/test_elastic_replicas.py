"""``--elastic`` with ``--on-replicas-differ stop``: a worker whose parameters go wrong silently (one bit flipped,
once) stops every worker at the next replica check; torchrun restarts the world from the newest checkpoint, which
was checked before it was written, and the run ends with every worker's parameters the same -- a rollback with no
one's hand on it. Two torchrun agents on this machine, ddp, tiny model."""

from __future__ import annotations

import json
import os
import sys

import pytest

from quietsync.train.metrics import read_jsonl
from tests.elastic_agents import Agents

from .conftest import synthetic_text

pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
                       reason="torchrun not installed"),
]


@pytest.mark.long
def test_a_flipped_bit_stops_the_world_and_torchrun_restarts_it_from_the_last_checked_checkpoint(tmp_path):
    (tmp_path / "text.txt").write_text(synthetic_text(1500))
    out, marker = tmp_path / "run", tmp_path / "flipped"
    flags = ["--strategy", "ddp", "--model", "tiny", "--max-steps", "12", "--micro-batch-size", "2", "--seq-len", "32",
             "--vocab-size", "300", "--dataset", str(tmp_path / "text.txt"), "--cache-dir", str(tmp_path / "cache"),
             "--eval-every", "0", "--eval-windows", "4", "--no-progress", "--no-plot", "--no-export", "--timeout-s",
             "30", "--threads", "1", "--save-every", "4", "--check-replicas-every", "2", "--on-replicas-differ",
             "stop", "--out", str(out)]
    # rank 1, after its step 5, once: the restarted world passes step 5 again without it
    agents = Agents(tmp_path, 2, flags, nnodes="2:2", max_restarts=2, env={"QUIETSYNC_FLIP_BIT": f"1:5:{marker}"})
    try:
        agents.start_host()
        agents.start(1)
        codes = agents.wait(360)
        assert codes == {0: 0, 1: 0}, agents.logs()
        assert agents.survivors() == []
    finally:
        agents.close()
    logs = agents.logs()
    assert marker.exists()
    assert ("after step 6 the committed parameters of rank 1 differ from the other workers' (--on-replicas-differ "
            "stop); the last check where every worker agreed was after step 4") in logs, logs[-3000:]
    assert "--elastic: resuming step-0000004" in logs, logs[-3000:]
    steps = [r["step"] for r in read_jsonl(out / "metrics-rank0.jsonl") if "event" not in r]
    assert steps == list(range(1, 13))  # each step once: the records were cut back to the checkpoint resumed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["replicas"]["differ"] == []
