"""A replica group whose main thread stalls while the others wait for it leaves, to be restarted and healed
(faults/stall.py).

The watch fires only past its limit without progress, only while another replica group waits, and never during
a wait of the protocol's own. When it fires it says where the main thread was stuck. Who waits: the members
that reached this replica's next collective (their meeting keys), or the Lighthouse's pending quorum requests, but
nobody when this replica group is alone in its quorum, because it then holds the run's only state. With real
replica groups (two, one hung with its heartbeats going, at a collective and at a round start), the hung one
leaves and the other goes on alone. The hung one is started again, heals and finishes the run with it. Without the
watch, the other one stops (neither is a majority of two) and the hung one never ends.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from quietsync.faults.stall import StallWatch, stall_limit_s
from tests.distributed import free_port

pytestmark = pytest.mark.timeout(240)


def _watch(waiting, limit_s: float = 5.0):
    """A watch whose thread never looks by itself (the test calls ``check``), and what its leaving recorded."""
    left: list[bool] = []
    watch = StallWatch(limit_s, waiting, lambda s, who: f"LEAVING after {s:.0f}s for {who}",
                       leave=lambda: left.append(True), poll_s=3600)
    return watch, left


def test_each_line_of_the_stack_names_its_worker_so_that_stacks_written_together_can_be_told_apart(capsys):
    left: list[bool] = []
    watch = StallWatch(5.0, lambda: "replica group(s) [0]", lambda s, who: "LEAVING", leave=lambda: left.append(True),
                       poll_s=3600, label="replica group 1, worker 1")
    try:
        watch._last = time.monotonic() - 6.0
        assert watch.check() and left == [True]
        said = capsys.readouterr().err.splitlines()
        stack = said[1:-1]  # between the heading and the line that says why it leaves
        assert stack and all(line.startswith("[replica group 1, worker 1] ") for line in stack), said
        assert said[-1] == "LEAVING"
    finally:
        watch.close()


def test_the_watch_leaves_only_past_its_limit_and_only_while_another_replica_group_waits(capsys):
    asked: list[bool] = []

    def someone() -> str:
        asked.append(True)
        return "replica group(s) [1]"

    watch, left = _watch(someone)
    try:
        assert not watch.check() and not asked  # progress just now: nobody is even asked
        watch._last = time.monotonic() - 6.0  # six seconds without progress, past the 5-s limit
        assert watch.check() and left == [True]
        said = capsys.readouterr().err
        assert "LEAVING after 6s for replica group(s) [1]" in said
        assert "main thread's stack" in said
        if threading.current_thread() is threading.main_thread():  # the check ran on it: the stack shows this test
            assert "test_the_watch_leaves_only_past_its_limit" in said
    finally:
        watch.close()

    nobody, left = _watch(lambda: None)
    try:
        nobody._last = time.monotonic() - 60.0
        assert not nobody.check() and left == []  # stalled, but nobody waits for it
    finally:
        nobody.close()


def test_a_wait_of_the_protocols_own_is_no_stall_and_coming_back_from_it_is_progress():
    watch, left = _watch(lambda: pytest.fail("not asked inside a wait"))
    try:
        watch._last = time.monotonic() - 60.0
        with watch.inside():
            with watch.inside():  # nested: a unit inside a round
                assert watch.stalled_s() is None and not watch.check()
            assert watch.stalled_s() is None
        assert watch.stalled_s() < 1.0 and not watch.check() and left == []
    finally:
        watch.close()


def test_a_wait_on_another_thread_counts_too_and_the_thread_fires_by_itself(capsys):
    """A communication thread's wait (streaming DiLoCo's exchange) holds the watch as the main thread's does; once
    it ends and the main thread stays stalled, the watch's own thread leaves within its limit and a poll."""
    fired = threading.Event()
    watch = StallWatch(0.4, lambda: "replica group(s) [2]", lambda s, who: f"gone for {who}", leave=fired.set,
                       poll_s=0.05)
    try:
        entered, done = threading.Event(), threading.Event()

        def comm_thread() -> None:
            with watch.inside():
                entered.set()
                done.wait(10)

        t = threading.Thread(target=comm_thread)
        t.start()
        entered.wait(10)
        assert not fired.wait(1.0)  # a second without progress, but the other thread waits in the protocol
        done.set()
        t.join(10)
        t0 = time.monotonic()
        assert fired.wait(10) and time.monotonic() - t0 < 5
        assert "gone for replica group(s) [2]" in capsys.readouterr().err
    finally:
        watch.close()


class _SlowEvalModel(torch.nn.Module):
    """A model whose every forward stands for ``seconds`` of evaluation without progress: it moves the watch's
    last progress back by that much (no sleep: the watch reads only how long ago progress was)."""

    def __init__(self, watch: StallWatch, seconds: float) -> None:
        super().__init__()
        self.watch, self.seconds = watch, seconds

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        self.watch._last -= self.seconds
        return SimpleNamespace(loss=torch.tensor(1.0))


@pytest.mark.parametrize("marked", [True, False])
def test_an_evaluation_longer_than_the_limit_is_progress_batch_by_batch(marked):
    """The training loop's evaluation (``train/loop.py``'s ``evaluate``) marks progress after every batch, by the
    membership's ``busy`` (a torchft replica's marks the stall watch): five batches of 4 s each, 20 s in all past
    a 5-s limit while another replica group waits, do not make the replica group leave. Unmarked, they would."""
    from quietsync.train.loop import evaluate

    watch, left = _watch(lambda: "replica group(s) [1]")
    try:
        batches = [torch.zeros(1, 4, dtype=torch.long)] * 5
        evaluate(_SlowEvalModel(watch, 4.0), batches, torch.device("cpu"), each=watch.progress if marked else None)
        assert watch.check() is (not marked) and left == ([] if marked else [True])
    finally:
        watch.close()


def test_a_torchft_replicas_busy_marks_its_quorums_progress():
    from quietsync.train.replica_loop import TorchftQuorum

    marked: list[bool] = []
    membership = object.__new__(TorchftQuorum)
    membership.quorum = SimpleNamespace(progress=lambda: marked.append(True))
    membership.busy()
    assert marked == [True]


@pytest.mark.parametrize("limit", [0, -1.0, float("nan")])
def test_a_limit_that_is_not_a_positive_number_is_refused(limit):
    with pytest.raises(ValueError, match="limit_s must be a positive number of seconds"):
        StallWatch(limit, lambda: None, lambda s, who: "")


def test_the_limit_is_half_the_quorum_timeout_leaving_the_others_the_rest_to_find_it_silent():
    assert stall_limit_s(120.0) == 60.0 and stall_limit_s(12.0) == 6.0


class _Store:
    """A quorum store holding the meeting keys ``ARRIVED/<unit>/<replica group>`` of ``came``."""

    def __init__(self, came: set[tuple[int, int]]) -> None:
        self.came = came  # (unit, replica group) keys set

    def check(self, keys: list[str]) -> bool:
        return all((int(k.split("/")[-2]), int(k.split("/")[-1])) in self.came for k in keys)


def _quorum(monkeypatch, members: list[int], came: set[tuple[int, int]], pending: int | None):
    """Replica group 0's quorum, at unit 5, whose store holds the meeting keys ``came`` and whose Lighthouse holds
    ``pending`` quorum requests."""
    import quietsync.faults.lighthouse as lighthouse
    from quietsync.faults.quorum import ReplicaQuorum

    monkeypatch.setattr(lighthouse, "pending_requests", lambda address, timeout: pending)
    q = object.__new__(ReplicaQuorum)
    group = type("Group", (), {"members": members, "store": _Store(came)})()
    q.transport = type("Transport", (), {"replica": 0, "replica_group": group})()
    q.manager = type("Manager", (), {"current_step": lambda self: 5})()
    q.lighthouse = "lh:1"
    return q


def test_who_waits_for_a_replica_group_the_members_at_its_next_collective_or_the_lighthouses_requests(monkeypatch):
    at_unit = _quorum(monkeypatch, [0, 1, 2], came={(5, 2), (4, 1)}, pending=0)
    assert at_unit._waiting_for_this() == "replica group(s) [2], at the next collective,"  # (4, 1): an old unit
    # this replica is at that meeting itself (its key is set): the others wait for someone else
    assert _quorum(monkeypatch, [0, 1], came={(5, 1), (5, 0)}, pending=0)._waiting_for_this() is None
    assert _quorum(monkeypatch, [0, 1], came=set(), pending=1)._waiting_for_this() == \
        "1 replica group(s) asking the Lighthouse for the next quorum"
    assert _quorum(monkeypatch, [0, 1], came=set(), pending=None)._waiting_for_this() is None  # no answer
    # alone in its quorum, it holds the run's only state: a returning replica's request does not make it leave
    assert _quorum(monkeypatch, [0], came=set(), pending=1)._waiting_for_this() is None


def test_the_lighthouse_says_how_many_quorum_requests_it_holds():
    from datetime import timedelta

    from torchft._torchft import LighthouseClient, LighthouseServer

    from quietsync.faults.lighthouse import pending_requests

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=60000, heartbeat_timeout_ms=5000)
    try:
        address = server.address()
        assert pending_requests(address, 5.0) == 0
        clients = [LighthouseClient(address, connect_timeout=timedelta(seconds=5)) for _ in range(2)]
        ids = ["quietsync_replica_0:a", "quietsync_replica_1:b"]
        for client, rid in zip(clients, ids):
            client.heartbeat(rid)
        ask = threading.Thread(target=lambda: _quietly(clients[0].quorum, replica_id=ids[0],
                                                        timeout=timedelta(seconds=3)))
        ask.start()  # replica group 0 asks; 1 heartbeats without asking: the request waits for it
        deadline = time.monotonic() + 5
        while pending_requests(address, 5.0) != 1:
            assert time.monotonic() < deadline, server.address()
            time.sleep(0.05)
        ask.join(10)
    finally:
        server.shutdown()
    assert pending_requests(f"127.0.0.1:{free_port()}", 2.0) is None  # nothing listens there


def _quietly(fn, **kwargs) -> None:
    try:
        fn(**kwargs)
    except Exception:  # noqa: BLE001 - the request runs out: what is checked is that it was held meanwhile
        pass


@pytest.mark.long
@pytest.mark.parametrize("where", ["collective", "round-start"])
def test_two_replica_groups_one_hung_with_its_heartbeats_going_it_leaves_and_heals_and_the_other_goes_on(
        tmp_path, where):
    """diloco H = 4, two replica groups, 16-s quorum timeout (the watch's limit 8 s: room for a loaded machine).
    Replica group 1 hangs at the top of step 3 (mid-round: replica group 0 waits for it at the step-4 sync's meeting)
    or of step 5 (right after a commit: replica group 0 waits for it at the round start's quorum request). It leaves,
    saying where it was stuck; replica group 0 commits without it and goes on alone to the next round start (step 5
    or 9), where it is held until replica group 1, started again, asks to join. Held alone, it holds the run's only
    state: it does not leave, although a request waits for it. Replica group 1 heals there, and both finish, every
    window committed once."""
    from tests.faults.torchft_replicas import Replicas, audit, job_flags, records, wait_exit

    from .test_torchft_strategies import wait_until

    hang, rejoin = (3, 5) if where == "collective" else (5, 9)
    out, go, release, never = tmp_path / "run", tmp_path / "go", tmp_path / "release", tmp_path / "never"
    env = {"TORCHFT_QUORUM_TIMEOUT_SEC": "16"}
    replicas = Replicas(tmp_path, 2, job_flags(tmp_path, out, "--strategy", "diloco", "--sync-every", "4",
                                               "--max-steps", "12", "--timeout-s", "1", "--no-export"))
    try:
        r0 = replicas.start(0, {**env, "QUIETSYNC_FT_HOLD": f"step:0:{go},step:{rejoin}:{release}"})
        r1 = replicas.start(1, {**env, "QUIETSYNC_FT_HOLD": f"step:0:{go},step:{hang}:{never}"})
        replicas.go(go, [0, 1])
        assert wait_exit(replicas, r1, 120) == 1, replicas.logs()
        said = (tmp_path / "replica1.0.log").read_text()
        assert "replica group 1: its main thread made no progress for" in said, said[-3000:]
        assert "it exits so that it is started again, and it heals from them" in said, said[-3000:]
        assert "in hold" in said  # the stack names where it was stuck: the injected hold
        wait_until(lambda: any(r["members"] == [0] for r in records(out, 0)), replicas)  # it went on alone
        r1 = replicas.rejoin(1, release, env)
        assert wait_exit(replicas, r0) == 0, replicas.logs()
        assert wait_exit(replicas, r1) == 0, replicas.logs()
    finally:
        replicas.close()
    assert replicas.alive() == []
    survivor, returned = records(out, 0), records(out, 1)
    # steps follow the data position: alone, a step holds half the tokens, so the run takes more than 12 of them
    assert [r["step"] for r in survivor] == list(range(1, len(survivor) + 1)) and survivor[-1]["position"] == 12
    members = [r["members"] for r in survivor]
    phases = [m for i, m in enumerate(members) if i == 0 or members[i - 1] != m]
    assert phases == [[0, 1], [0], [0, 1]], members  # both, alone from the hang on, both again from the rejoin
    assert members[:hang - 1] == [[0, 1]] * (hang - 1) and members[rejoin - 2:rejoin] == [[0], [0, 1]], members
    assert "no quorum" not in (tmp_path / "replica0.0.log").read_text().lower()  # it never gave up on the other
    assert returned[-1]["healed"] == 1 and returned[-1]["step"] == survivor[-1]["step"]
    committed, summary = audit(out, 2)
    assert len(set(committed)) == len(committed), "a window trained twice"
    assert sorted(committed + summary["windows_held"]) == list(range(summary["windows_dealt"])), "a window skipped"
