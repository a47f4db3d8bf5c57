"""Multi-node launch for real: two `torchrun --nnodes 2 --node-rank K` agents on this machine (c10d
rendezvous) run `quietsync train`; the topology comes from torchrun's environment (2 nodes × 2 workers), so
a hierarchical strategy's traffic splits into the in-node `shard` group and the cross-node `replicate` one.
This is the recipe for a real cluster (README, "quietsync train")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.distributed import free_port

from .conftest import synthetic_text

pytestmark = pytest.mark.timeout(300)


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(
    sys.executable), "torchrun")), reason="torchrun not installed")
@pytest.mark.parametrize("strategy,groups", [("flexdemo", {"shard", "replicate"}),
                                             ("diloco", {"shard", "replicate"})])
@pytest.mark.long
def test_two_torchrun_agents_make_two_nodes(strategy, groups, tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(synthetic_text(2000))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    env["HF_HUB_OFFLINE"] = "1"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    extra = ["--inner", "ddp", "--sync-every", "2"] if strategy == "diloco" else []  # hierarchical DiLoCo
    procs = []
    for node in (0, 1):
        cmd = [torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node), "--rdzv-backend",
               "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"qs-{port}", "-m",
               "quietsync", "train", "--strategy", strategy, *extra, "--model", "tiny", "--max-steps", "4",
               "--micro-batch-size", "2", "--seq-len", "32", "--vocab-size", "300", "--dataset", str(data),
               "--cache-dir", str(tmp_path / "cache"), "--eval-every", "0", "--eval-windows", "4", "--no-progress",
               "--no-plot", "--no-export", "--timeout-s", "60", "--out", str(tmp_path / f"node{node}")]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = [p.communicate(timeout=280) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    summary = json.loads((tmp_path / "node0" / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["nodes"] == 2 and summary["steps"] == 4
    assert summary["replicas"] == {"checked": True, "differ": []}  # the four workers' committed parameters
    sent = {g for g, v in summary["bytes_by_group"].items() if v["sent"] > 0}
    assert groups <= sent, summary["bytes_by_group"]
    # each node wrote its own workers' metrics
    assert sorted(p.name for p in (tmp_path / "node1").glob("metrics-rank*.jsonl")) == [
        "metrics-rank2.jsonl", "metrics-rank3.jsonl"]
