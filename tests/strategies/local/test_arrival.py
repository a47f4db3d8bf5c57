"""Late is not dead (quietsync.strategies.local.arrival): at an outer sync a worker waits for a slower one for as
long as a round of the slower one can take, beyond ``--timeout-s``, and books the wait as idle; a worker that does
not come at all still fails the run, after that patience, in one line."""

from __future__ import annotations

import json
import time

import pytest

from quietsync.strategies.local.arrival import SYNC_PATIENCE, Arrival
from quietsync.topology import Topology
from quietsync.transport import Transport
from tests.distributed import run_ranks
from tests.train._run import small_job, train

TIMEOUT_S = 2


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,h,steps", [
    (["--strategy", "diloco"], 192, 384),
    (["--strategy", "localsgd"], 192, 384),
    # Streaming DiLoCo: each sync in flight behind a step meets the others on the communication thread (two
    # fragments: a sync every 192 steps)
    (["--strategy", "diloco", "--fragments", "2", "--overlap-delay", "1"], 384, 384),
], ids=["diloco", "localsgd", "diloco-streaming"])
def test_a_slower_worker_later_than_the_timeout_is_waited_for_at_every_sync(tmp_path, strategy, h, steps):
    # worker 1 ~3-4x slower: it reaches each sync ~3 of the fast worker's rounds (about 2 s each) after it, and the
    # fast one waits there (idle) 5-6 s, well past --timeout-s 2, which stopped the run before (an all-reduce on the
    # outer sync timed out). The rounds are long, not the worker slower: the waits grow and the patience (9 of the
    # fast worker's rounds) with them; a 6x slower worker went past that patience under load
    out = tmp_path / "run"
    done = train(*small_job(tmp_path, nproc=2), *strategy, "--sync-every", str(h), "--max-steps", str(steps),
                 "--slow-worker", "1:4", "--timeout-s", str(TIMEOUT_S), "--threads", "1", "--no-export",
                 "--out", str(out), timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    fast = [json.loads(x) for x in (out / "metrics-rank0.jsonl").read_text().splitlines() if '"event"' not in x]
    waits = [r for r in fast if r["idle_s"] > TIMEOUT_S]
    assert waits, max(r["idle_s"] for r in fast)  # it waited longer than --timeout-s, at a sync ...
    assert all(r["extra"]["synced"] or r["extra"]["applied"] != -1 for r in waits), waits
    assert all(r["compute_s"] < r["idle_s"] for r in waits), waits  # ... and the wait is idle, not compute


def _meet(rank: int, world: int, patience: float, late: float) -> float:
    transport = Transport(Topology.from_env(), timeout_s=1.0)
    transport.ready_control()
    try:
        if rank == 1:
            time.sleep(late)
        t0 = time.monotonic()
        transport.meet(patience)
        return time.monotonic() - t0
    finally:
        transport.close()


@pytest.mark.timeout(120)
def test_meet_waits_past_the_transports_timeout_for_as_long_as_it_is_told():
    waited = run_ranks(_meet, 2, 10.0, 2.5, timeout=60)[0]
    assert 2.0 < waited < 10.0, waited  # past the 1 s timeout of the transport's collectives


@pytest.mark.timeout(120)
def test_a_worker_that_does_not_come_fails_the_meeting_after_the_patience_naming_it():
    out = run_ranks(_meet, 2, 1.0, 6.0, timeout=60, expect_failure=True)
    kind, detail = out[0]
    assert kind == "error" and "waited 1s at an outer sync for the other workers, and one did not come" in detail


class _Clockless:
    timeout_s = 2.0

    def ready_control(self, group: str | None = None) -> None:
        pass


def test_the_patience_is_the_timeout_or_a_few_of_this_workers_rounds_whichever_is_longer(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    arrival = Arrival(_Clockless())  # type: ignore[arg-type]
    now[0] += 0.1  # a short round: the timeout
    assert arrival.patience_s() == 2.0
    now[0] += 9.9  # a round of 10 s: a peer may take SYNC_PATIENCE of them more
    assert arrival.patience_s() == SYNC_PATIENCE * 10.0
