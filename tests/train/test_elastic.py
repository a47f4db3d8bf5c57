"""Elastic runs for real: three `torchrun --nnodes 2:3 --max-restarts 3 --rdzv-backend c10d` agents on this
machine run `quietsync train --elastic` (diloco, tiny model), as docs/train.md's recipe does across machines.

* **A node lost and regained**: ``kill -9`` of one agent (its worker dies with it) mid-run; the two others
  restart from the newest complete checkpoint on 2 workers (a reshard) within a bound, train on; the agent is
  started again and rejoins at the next restart (3 workers, another reshard); the job finishes with exit 0 on
  every agent and no process left. Checked on what the run wrote: every step committed once (the metrics cut
  back to the checkpoint each restart resumed), the data stream read in the one-reader order of the epoch's
  permutation with no window read twice or skipped across both changes (``QUIETSYNC_AUDIT_DATA``), the
  learning-rate schedule followed tokens, and the final held-out loss close to an uninterrupted 3-worker run's.
* **A worker killed during a checkpoint write** (it dies, ``SIGKILL``, with its rank file half-written):
  its agent restarts the group on the same 3 workers from the previous complete checkpoint, which continues
  the uninterrupted run bit for bit; the half-written file is gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from quietsync.faults.inject import MID_WRITE_ENV
from quietsync.train.metrics import read_jsonl
from tests.elastic_agents import Agents
from tests.shared import shared_folder

from .conftest import synthetic_text

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
                       reason="torchrun not installed"),
]

STEPS = 48
SAVE_EVERY = ["--save-every", "4"]
"""Every second outer sync (``--sync-every 2``) rather than the default every one: half the checkpoint writes,
which are most of these tiny runs' compute; what is checked does not depend on how often they come."""
CUT_STEP = 8
"""The checkpoint whose write is cut short (a later one than the first: a complete one is there to resume from)."""
AUDIT = {"QUIETSYNC_AUDIT_DATA": "1"}
FINAL_LOSS_TOLERANCE = 0.3
"""|final held-out loss - the uninterrupted run's| allowed after losing and regaining a node (nats): a gross check
(the uninterrupted run goes from 5.70 at step 0 to 3.92 at step 48: a run that lost most of its progress ends far
above it). Measured 0.027, 0.029, 0.078 with late kills and 0.16, 0.19 with the kill at step 6, where
most of the run is on 2 workers with --batch-policy global (fewer, larger steps: a different trajectory). The
exact checks of the resume are the data-order audit below, every step logged once, and the joiner's state
against the oracle in test_reshard_replicas.py."""
CONTINUE_WITHIN_S = 240
"""Seconds from the kill to the first step the two survivors commit, on this loaded 2-core machine (measured
30-60 s: detection, the restart, re-rendezvous, process start-up, reload and one step)."""


SLOWER = ["--slow-worker", "0:10"]
"""Rank 0 sleeps 9 x its compute after each micro-batch (timing only; the trajectory is the same): the two
survivors must still be training when the third agent, started right after their first step, has rejoined."""


def _flags(root: Path, out: Path) -> list[str]:
    return ["--strategy", "diloco", "--sync-every", "2", "--model", "tiny", "--max-steps", str(STEPS),
            "--micro-batch-size", "2", "--seq-len", "32", "--vocab-size", "300", "--dataset", str(root / "text.txt"),
            "--cache-dir", str(root / "cache"), "--eval-every", "0", "--eval-windows", "16", "--no-progress",
            "--no-plot", "--no-export", "--timeout-s", "30", "--threads", "1", "--out", str(out)]


@pytest.fixture(scope="session")
def job(tmp_path_factory) -> dict:
    """The corpus, and the uninterrupted 3-worker run (local workers, one thread each, audited): built once per
    session, whichever test process asks first (the tests read it and write only the corpus's cache, which its
    locks guard)."""
    def build(root: Path) -> None:
        (root / "text.txt").write_text(synthetic_text(3000))
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")}
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **AUDIT})
        proc = subprocess.run([sys.executable, "-m", "quietsync", "train", "--nproc", "3",
                               *_flags(root, root / "reference")], capture_output=True, text=True, env=env,
                              timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]

    root = shared_folder(tmp_path_factory, "elastic-job", build)
    return {"root": root, "reference": root / "reference"}


def _steps(out: Path, rank: int) -> list[dict]:
    return [r for r in read_jsonl(out / f"metrics-rank{rank}.jsonl") if "event" not in r]


def _one_reader_order(root: Path, count: int) -> list[list[int]]:
    """The oracle of the data order: one reader of each epoch's permutation, one window at a time."""
    from quietsync.data.corpus import load_corpus
    from quietsync.data.sequences import ShardedSequences, encode_split
    from quietsync.data.tokenizer import job_tokenizer

    corpus = load_corpus(str(root / "text.txt"), 0.02)
    tokenizer, eos = job_tokenizer(None, corpus, 300, root / "cache")
    n = encode_split(tokenizer, corpus.documents, eos, root / "cache").numel()
    one = ShardedSequences(torch.arange(n), 32, 1, 0, 1, seed=0)
    order = []
    for _ in range(count):
        start = int(next(one)[0, 0])
        order.append([one.last_starts[0], start])
    return order


def _committed_windows(out: Path) -> list[tuple[int, int, list[list[int]]]]:
    """(step, world size, windows of all its workers) of every step of the run's final history: rank 0's
    records say which world committed each step; workers of that world hold its windows."""
    rank0 = _steps(out, 0)
    files = {r: {x["step"]: x for x in _steps(out, r)} for r in range(max(x["world_size"] for x in rank0))}
    return [(x["step"], x["world_size"], [w for r in range(x["world_size"]) for w in files[r][x["step"]]["windows"]])
            for x in rank0]


def _check_data_order(root: Path, out: Path) -> None:
    history = _committed_windows(out)
    total = sum(len(w) for _, _, w in history)
    order = _one_reader_order(root, total)
    i = 0
    for step, _, windows in history:  # each step's windows are the next ones of the permutation
        assert sorted(map(tuple, windows)) == sorted(map(tuple, order[i:i + len(windows)])), f"step {step}"
        i += len(windows)


def _newest(out: Path) -> tuple[int, int | None]:
    from quietsync.train.checkpoint import complete_checkpoints
    from quietsync.train.logical_checkpoint import logical_world

    found = complete_checkpoints(out, [0])
    return (int(found[0].name[5:]), logical_world(found[0])) if found else (0, None)


def _wait(cond, agents: Agents, limit: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if all(p.poll() is not None for p in agents.procs.values()):
            pytest.fail(f"every agent ended while waiting for {what}\n{agents.logs()}")
        if time.monotonic() - t0 > limit:
            pytest.fail(f"no {what} within {limit} s\n{agents.logs()}")
        time.sleep(0.05)
    return time.monotonic()


def _final_loss(out: Path) -> float:
    return json.loads((out / "summary.json").read_text())["last_eval_loss"]


@pytest.mark.long
def test_a_node_lost_and_regained(job, tmp_path):
    root, out = job["root"], tmp_path / "run"
    agents = Agents(tmp_path, 3, [*_flags(root, out), *SAVE_EVERY, *SLOWER], nnodes="2:3", max_restarts=3, env=AUDIT)
    try:
        agents.start_host()  # agent 0 hosts the rendezvous store: the others may come and go
        agents.start(1)
        agents.start(2)
        _wait(lambda: _newest(out)[0] >= 4, agents, 300, "checkpoint at step 4 on 3 workers")
        killed = agents.kill_agent(2)
        lost_at = max((x["step"] for x in _steps(out, 0)), default=0)
        continued = _wait(lambda: any(x.get("world_size") == 2 for x in _steps(out, 0)), agents,
                          CONTINUE_WITHIN_S, "step committed by the two survivors")
        _wait(lambda: _newest(out)[1] == 2, agents, 300, "checkpoint written by the two survivors")
        agents.start(2)  # the node comes back (rank 0 is slowed: the survivors are still training when it joins)
        codes = agents.wait(400)
        assert codes == {0: 0, 1: 0, 2: 0}, agents.logs()
        assert agents.survivors() == [], "processes outlived the job"
    finally:
        agents.close()
    print(f"continued on 2 workers {continued - killed:.1f} s after the kill (step {lost_at} when killed)")

    rows = _steps(out, 0)
    worlds = [x["world_size"] for x in rows]
    assert [x["step"] for x in rows] == list(range(1, len(rows) + 1))  # every step once
    phases = [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w]
    assert phases == [3, 2, 3], (worlds, agents.logs())  # lost a node, then regained it
    # --batch-policy global: 2 micro-batches per worker on 2 workers (4 windows of the first 3 x 1), so the
    # schedule (and --max-steps) advance 4/3 per step there: the run ends in fewer than STEPS steps
    assert {x["micro_batches"] for x, w in zip(rows, worlds) if w == 2} == {2}
    assert len(rows) < STEPS
    _check_data_order(root, out)
    ref = _final_loss(job["reference"])
    assert abs(_final_loss(out) - ref) < FINAL_LOSS_TOLERANCE, (_final_loss(out), ref)
    print(f"final held-out loss {_final_loss(out):.4f} vs {ref:.4f} uninterrupted")


@pytest.mark.long
def test_a_worker_killed_during_a_checkpoint_write(job, tmp_path):
    root, out, marker = job["root"], tmp_path / "run", tmp_path / "cut-short"
    # worker 1 dies with its rank file of step CUT_STEP half-written (the fault is injected: deterministic)
    agents = Agents(tmp_path, 3, [*_flags(root, out), *SAVE_EVERY], nnodes="3:3", max_restarts=2,
                    env={**AUDIT, MID_WRITE_ENV: f"1:{CUT_STEP}:{marker}"})
    try:
        agents.start_host()
        agents.start(1)
        agents.start(2)
        codes = agents.wait(400)
        assert codes == {0: 0, 1: 0, 2: 0}, agents.logs()
        assert agents.survivors() == []
    finally:
        agents.close()
    assert marker.exists(), "no rank file write was cut short"
    cut_short = CUT_STEP
    assert not list((out / "checkpoints").rglob("*.tmp")), "a partial write was left behind"
    resumed = [int(line.split("resuming step-")[1][:7]) for line in agents.logs().splitlines()
               if "--elastic: resuming step-" in line]
    assert resumed and resumed[0] < cut_short, (resumed, cut_short)  # the previous complete checkpoint
    ref_rows, rows = _steps(job["reference"], 0), _steps(out, 0)
    assert [x["step"] for x in rows] == list(range(1, STEPS + 1))
    assert [(x["step"], x["loss"]) for x in rows] == [(x["step"], x["loss"]) for x in ref_rows]
    assert _final_loss(out) == _final_loss(job["reference"])
    _check_data_order(root, out)
