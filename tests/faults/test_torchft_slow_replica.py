"""A slower replica group is waited for, not taken for a dead one (docs/faults.md, "Uneven replica groups").

Three replica groups run synchronous DiLoCo under ``--fault-tolerance torchft``; replica group 2 is ~6x slower
(``--slow-worker 2:6``), so it reaches the outer sync many seconds after the other two (17-21 s here): longer than
``--timeout-s`` and than the Lighthouse's join timeout (10 s), after which a quorum asked for by the two fast ones
would form without it. Their
collective times out, and they wait for it in the failed quorum's store before asking for the next quorum, as long
as the unit's patience: 9 of their rounds. So the sync is asked again and commits with all three, nobody heals or
restarts, and the fast replicas' wait is idle time in their step records, not compute. One hung (its heartbeats
going) leaves by its stall watch, and the majority goes on; one still missing after the patience is left behind by
a majority; a replica that finds itself left out stops to heal before it asks for a quorum. A quorum timeout that is
not a positive number is refused before any worker starts.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.distributed import free_port
from tests.train._run import refused, small_job, train_subprocess

pytest.importorskip("torchft")

H = 288
TIMEOUT_S = 1
QUORUM_S = 12
"""The left-behind test's quorum timeout (``TORCHFT_QUORUM_TIMEOUT_SEC``), the fast replicas' patience there."""


@pytest.mark.long
@pytest.mark.timeout(300)
def test_a_slower_minority_is_waited_for_at_every_sync_past_the_timeouts_and_the_wait_is_idle(tmp_path,
                                                                                              monkeypatch):
    # the default quorum timeout: its 20-s quorum attempts outlast the join timeout, as a user's do
    monkeypatch.delenv("TORCHFT_QUORUM_TIMEOUT_SEC", raising=False)
    out = tmp_path / "run"
    proc = train_subprocess(*small_job(tmp_path, nproc=3), "--nodes", "3", "--fault-tolerance", "torchft",
                            "--strategy", "diloco", "--sync-every", str(H), "--max-steps", str(H),
                            "--slow-worker", "2:6", "--timeout-s", str(TIMEOUT_S), "--threads", "1",
                            "--no-export", "--out", str(out), timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "no replica group healed" in proc.stdout, proc.stdout[-2000:]
    assert "did not answer" not in proc.stderr, proc.stderr[-2000:]  # a wait for a slower replica is no outage
    records = [[json.loads(x) for x in (out / f"metrics-rank{r}.jsonl").read_text().splitlines()
                if '"event"' not in x] for r in range(3)]
    assert all([r["step"] for r in rows] == list(range(1, H + 1)) for rows in records)
    assert all(r["members"] == [0, 1, 2] and r["healed"] == 0 for rows in records for r in rows)  # none left out
    for rows in records[:2]:  # the fast ones' collective timed out and they waited in the store: idle, asked again
        sync = rows[H - 1]
        assert sync["retries"] >= 1 and sync["idle_s"] > TIMEOUT_S and sync["compute_s"] < sync["idle_s"], sync


@pytest.mark.long
@pytest.mark.timeout(300)
def test_a_hung_replica_group_leaves_the_majority_commits_without_it_and_it_is_started_again(tmp_path, monkeypatch):
    """Replica group 2 hangs at the top of its last step before the sync (its main thread waits, its heartbeats go
    on, as with a stuck data loader) until the others have finished. They wait for it at the sync's meeting; once its
    main thread has made no progress for half the quorum timeout (12 s here: above the join timeout, as
    docs/faults.md asks, and room for a loaded machine to start all three) while they wait, its stall watch
    (faults/stall.py) makes it leave, saying where it was stuck. They find it silent and commit the sync without it,
    and the local launcher starts it again, to heal. Left behind at the patience instead, it would have stayed hung.
    The left-behind rule itself, for a replica group still making progress more than 10x slower, is checked against a
    faked Lighthouse below."""
    import threading

    from quietsync.faults.inject import HOLD_ENV, HOLD_GROUP_ENV

    out, h, go = tmp_path / "run", 4, tmp_path / "go"
    monkeypatch.setenv("TORCHFT_QUORUM_TIMEOUT_SEC", str(QUORUM_S))
    monkeypatch.setenv(HOLD_ENV, f"step:{h}:{go}")
    monkeypatch.setenv(HOLD_GROUP_ENV, "2")
    done = threading.Event()

    def release_once_the_others_finished() -> None:
        while not done.is_set() and not (out / "summary.json").exists():
            time.sleep(0.1)
        go.touch()

    releaser = threading.Thread(target=release_once_the_others_finished, daemon=True)
    releaser.start()
    try:
        proc = train_subprocess(*small_job(tmp_path, nproc=3), "--nodes", "3", "--fault-tolerance", "torchft",
                                "--strategy", "diloco", "--sync-every", str(h), "--max-steps", str(h),
                                "--timeout-s", str(TIMEOUT_S), "--threads", "1", "--no-export", "--out", str(out),
                                timeout=240)
    finally:
        done.set()
        releaser.join(5)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-3000:]
    assert re.search(r"replica group 2: its main thread made no progress for [0-9]+s while replica group\(s\) "
                     r"\[0, 1\], at the next collective, waited for it", said), said[-3000:]
    assert "in hold" in said  # its stack says where it was stuck
    assert "replica group 2 ended (exit status 1); starting it again" in said, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    for r in (0, 1):
        rows = [json.loads(x) for x in (out / f"metrics-rank{r}.jsonl").read_text().splitlines() if '"event"' not in x]
        assert all(x["members"] == [0, 1, 2] for x in rows[:h - 1])
        sync = rows[h - 1]  # waited for it in the meeting, then committed without replica group 2
        assert sync["members"] == [0, 1] and sync["retries"] >= 1 and sync["idle_s"] > TIMEOUT_S, sync
    # started again, it heals into the run where the others' next round start took it in (not when they finished)
    later = [json.loads(x) for x in (out / "metrics-rank2.jsonl").read_text().splitlines() if '"event"' not in x]
    assert all(x["healed"] == 1 for x in later if x["step"] > h - 1), later


def test_the_quorum_timeout_is_torchfts_variable_where_set_else_the_longer_of_120_s_and_the_timeout(monkeypatch):
    from quietsync.faults.flags import quorum_timeout_s

    monkeypatch.delenv("TORCHFT_QUORUM_TIMEOUT_SEC", raising=False)
    assert quorum_timeout_s(30) == 120 and quorum_timeout_s(300) == 300
    monkeypatch.setenv("TORCHFT_QUORUM_TIMEOUT_SEC", "7.5")
    assert quorum_timeout_s(300) == 7.5  # torchft's Manager obeys it too: the two agree


@pytest.mark.parametrize("value", ["0", "-5", "soon", "inf"])
def test_a_quorum_timeout_that_is_not_a_positive_number_is_refused_in_one_line(tmp_path, monkeypatch, capsys,
                                                                              value):
    pytest.importorskip("torchft")
    monkeypatch.setenv("TORCHFT_QUORUM_TIMEOUT_SEC", value)
    line = refused(monkeypatch, capsys, *small_job(tmp_path, nproc=2), "--nodes", "2", "--fault-tolerance",
                   "torchft", "--strategy", "diloco")
    assert "TORCHFT_QUORUM_TIMEOUT_SEC must be a positive number of seconds" in line and repr(value) in line, line


def test_the_lighthouse_status_names_its_last_quorums_members_so_a_replica_left_out_knows_it():
    """A replica group that reaches a collective after the others went on without it (more than half asked and the
    Lighthouse's join timeout passed) learns it from the Lighthouse's status page: no incarnation of it is in the
    last quorum (``ReplicaQuorum._left_out``), so it stops at once and heals, rather than waiting out its patience."""
    from datetime import timedelta

    from torchft._torchft import LighthouseClient, LighthouseServer

    from quietsync.faults.lighthouse import latest_members
    from quietsync.faults.replica_group import replica_id

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    try:
        address = server.address()
        assert latest_members(address, 5.0) is None  # no quorum formed yet
        me = f"{replica_id(1)}:incarnation-a"
        LighthouseClient(address, connect_timeout=timedelta(seconds=5)).quorum(replica_id=me,
                                                                                 timeout=timedelta(seconds=5))
        members = latest_members(address, 5.0)
        assert members == [me], members
        # replica group 1's prefix is in it; replica group 0's and 10's are not (the ':' ends the group's id)
        assert any(m.startswith(replica_id(1) + ":") for m in members)
        assert not any(m.startswith(replica_id(0) + ":") or m.startswith(replica_id(10) + ":") for m in members)
    finally:
        server.shutdown()
    assert latest_members(f"127.0.0.1:{free_port()}", 2.0) is None  # nothing answers: nothing to read


def _store():
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)


def test_the_replicas_meet_in_the_store_and_a_silent_or_late_one_ends_the_meeting():
    """After a collective timed out every member sets its key in the quorum's store and waits for the others'
    (faults/meeting.py): a slower one is waited for as long as it arrives before the deadline; one whose heartbeats
    stopped (frozen, its connections open) ends the wait at the first check after it is found silent; past the
    deadline it is late, and the store says who is missing. A member that does not wait (its collective failed on a
    closed connection) only arrives."""
    import threading

    from quietsync.faults.meeting import ARRIVED, meet, missing

    store = _store()
    later = threading.Timer(0.6, lambda: store.set(f"{ARRIVED}/7/1", b"1"))  # replica group 1 arrives 0.6 s later
    later.start()
    asked = []
    t0 = time.monotonic()
    assert meet(store, 7, 0, [1], time.monotonic() + 30, lambda: asked.append(1) or True, alive_every_s=0.2) is None
    assert 0.5 < time.monotonic() - t0 < 5 and asked  # it waited for the late one, asking after the others meanwhile
    assert store.check([f"{ARRIVED}/7/0"])  # and said it was there

    answers = iter([True, False])
    t0 = time.monotonic()
    assert meet(store, 8, 0, [1, 2], time.monotonic() + 30, lambda: next(answers), alive_every_s=0.2) == "silent"
    assert time.monotonic() - t0 < 5  # at the second slice, not at the deadline

    store.set(f"{ARRIVED}/9/2", b"1")
    assert meet(store, 9, 0, [1, 2], time.monotonic() + 0.3, lambda: True, alive_every_s=0.1) == "late"
    assert missing(store, 9, [1, 2]) == [1]  # the one to leave behind; 2 came
    store.set(f"{ARRIVED}/10/1", b"1")
    assert meet(store, 10, 0, [1], time.monotonic() + 0.3, lambda: pytest.fail("no wait")) is None
    assert meet(store, 11, 2, [], time.monotonic() + 0.3, lambda: pytest.fail("no wait")) is None
    assert store.check([f"{ARRIVED}/11/2"])  # arrived without waiting


def test_the_lighthouse_status_names_the_replicas_whose_heartbeats_stopped():
    from datetime import timedelta

    from torchft._torchft import LighthouseClient, LighthouseServer

    from quietsync.faults.lighthouse import stale_heartbeats

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1000)
    try:
        address = server.address()
        client = LighthouseClient(address, connect_timeout=timedelta(seconds=5))
        client.heartbeat("quietsync_replica_0:a")  # and nothing more: a frozen replica's last word
        time.sleep(1.3)  # past the heartbeat timeout
        client.heartbeat("quietsync_replica_1:b")  # just seen
        assert stale_heartbeats(address, 5.0) == ["quietsync_replica_0:a"]
    finally:
        server.shutdown()
    assert stale_heartbeats(f"127.0.0.1:{free_port()}", 2.0) is None  # nothing answers: nothing to read


class _Manager:
    """torchft's Manager as ``_ask`` sees it: ``start_quorum`` times out ``fails`` times, then answers."""

    def __init__(self, fails: int) -> None:
        self.fails, self.asked, self._quorum_future = fails, 0, None

    def start_quorum(self, allow_heal: bool, shrink_only: bool, timeout) -> None:
        self.asked += 1
        if self.asked <= self.fails:
            raise TimeoutError("quorum timed out")


def _quorum(monkeypatch, fails: int, last_members: list[str] | None):
    """A ReplicaQuorum of replica group 0 whose last quorum held groups 0 and 1, against an up Lighthouse whose
    last quorum holds ``last_members``."""
    import quietsync.faults.lighthouse as lighthouse
    from quietsync.faults.quorum import ReplicaQuorum

    monkeypatch.setattr(lighthouse, "reachable", lambda address, timeout: None)  # up
    monkeypatch.setattr(lighthouse, "latest_members", lambda address, timeout: last_members)
    q = object.__new__(ReplicaQuorum)
    group = type("Group", (), {"members": [0, 1]})()
    q.transport = type("Transport", (), {"replica": 0, "replica_group": group})()
    q.manager, q.lighthouse, q.attempt_s, q.quorum_timeout_s, q.lighthouse_lost = _Manager(fails), "lh:1", 0.01, 5.0, 0
    q.watch = None  # no stall watch: its thread is tested in test_stall.py
    return q


def test_a_quorum_that_waits_for_a_slower_member_is_asked_again_and_is_no_lighthouse_outage(monkeypatch, capsys):
    from quietsync.faults.replica_group import replica_id

    q = _quorum(monkeypatch, fails=3, last_members=[f"{replica_id(0)}:a", f"{replica_id(1)}:b"])
    q._ask(allow_heal=False, shrink_only=True, patience_s=5.0)
    assert q.manager.asked == 4 and q.lighthouse_lost == 0
    assert "did not answer" not in capsys.readouterr().err


def test_a_replica_the_others_went_on_without_stops_at_once_to_heal(monkeypatch):
    from quietsync.faults.quorum import FellBehind
    from quietsync.faults.replica_group import replica_id

    # the others' last quorum holds no incarnation of replica group 0
    q = _quorum(monkeypatch, fails=100, last_members=[f"{replica_id(1)}:b"])
    with pytest.raises(FellBehind, match="gone on without it"):
        q._ask(allow_heal=False, shrink_only=True, patience_s=5.0)
    assert q.manager.asked == 1  # not after its patience: at the first attempt that found it left out


def test_a_replica_whose_collective_failed_after_the_others_went_on_without_it_stops_before_asking(monkeypatch):
    """The others committed without replica group 0 and may be gone already (their heartbeats stopped): a quorum
    request now could form a quorum of 0 alone, which would commit a unit the others never see. So 0 reads the
    Lighthouse's last quorum first and stops to heal, without asking for one."""
    from quietsync.faults.quorum import FellBehind
    from quietsync.faults.replica_group import replica_id
    from quietsync.faults.transport import ReplicaLost

    q = _quorum(monkeypatch, fails=0, last_members=[f"{replica_id(1)}:b", f"{replica_id(2)}:c"])
    q.manager.report_error = lambda e: None
    q.manager.should_commit = lambda timeout: False
    q.transport.group_size = lambda group: 1
    q.transport.meter = type("Meter", (), {"add_seconds": lambda self, group, s: None})()
    q.transport.replica_group.report, q.transport.replica_group.store = (lambda e: None), None
    q.manager.participating_rank = lambda: 0
    q._running, q.round_due, q.verdict, q.abstains, q.retries = False, False, (0, 0), False, 0
    q.since, q.quorum_timeout_s, q.timeout_s = time.monotonic(), 5.0, 1.0

    def collective() -> None:
        raise ReplicaLost("Connection closed by peer")

    with pytest.raises(FellBehind, match="gone on without it"):
        q.run(collective, [])
    assert q.manager.asked == 0  # no quorum asked for


class _Store:
    """A quorum store in which only the replica groups in ``came`` set their meeting keys."""

    def __init__(self, came: set[int]) -> None:
        self.came = came

    def check(self, keys: list[str]) -> bool:
        return all(int(key.rsplit("/", 1)[1]) in self.came for key in keys)


@pytest.mark.parametrize("majority", [True, False])
def test_members_missing_after_the_patience_are_left_behind_by_a_majority_or_the_waiting_replica_stops(
        monkeypatch, capsys, majority):
    """Past the patience, replica group 0 asks for a quorum without the missing group 1: where the Lighthouse forms
    one (0 is among more than half of the live groups) it goes on, saying so; where it forms none, 0 stops, naming
    the group it waited for and why no quorum formed without it."""
    from quietsync.faults import quorum as quorum_module
    from quietsync.faults.quorum import NoQuorum
    from quietsync.faults.replica_group import replica_id

    monkeypatch.setattr(quorum_module, "LEAVE_S", 1.0)
    q = _quorum(monkeypatch, fails=0 if majority else 10**9, last_members=[f"{replica_id(0)}:a", f"{replica_id(1)}:b"])
    group = q.transport.replica_group
    group.store = _Store(came={0})
    q.manager.current_step = lambda: 3

    def answered(**kwargs) -> None:  # the Lighthouse's quorum without group 1
        group.members = [0]
    if majority:
        q.manager.start_quorum = answered
        q.manager.participating_rank = lambda: 0
        q._leave_behind(30.0)
        assert group.members == [0]
        assert "replica group(s) [1] did not reach this collective within 30s" in capsys.readouterr().err
    else:
        with pytest.raises(NoQuorum, match=r"replica group\(s\) \[1\], alive, did not reach .* more than half"):
            q._leave_behind(30.0)
