"""The data policy under torchft, checked against its statement on long random failure histories: every window
dealt is committed at most once, none is skipped (committed, given back or still dealt: the sequence from 0 with no
gap), a window given back reaches a present replica, and the schedule's position follows the windows of the
replicas present."""

from __future__ import annotations

import random

import pytest
import torch

from quietsync.comm_worker import CommWorker
from quietsync.data.sequences import ShardedSequences
from quietsync.train.window_dealer import WindowDealer


def _dealer(per: int = 2, replicas: int = 3, tokens: int = 4000, lag: int = 0) -> WindowDealer:
    return WindowDealer(ShardedSequences(torch.arange(tokens) % 97, 16, per, 0, 1, seed=3), per, replicas, lag)


def test_with_every_replica_present_the_steps_read_the_sequence_in_order():
    dealer = _dealer()
    assert [dealer.deal([0, 1, 2], k, 0) for k in (0,)] == [[0, 1]]  # slot 0 of the first step
    dealer.commit([0, 1, 2])
    assert dealer.last_commit["committed"] == [0, 1, 2, 3, 4, 5] and dealer.last_commit["given_back"] == []
    assert dealer.position() == 1.0 and dealer.position_at(0) == 0.0 and dealer.position_at(1) == 1.0


@pytest.mark.parametrize("seed", range(4))
def test_no_window_is_trained_twice_or_skipped_whatever_the_failures(seed):
    rng = random.Random(seed)
    replicas, per = 4, 3
    dealer = _dealer(per, replicas)
    committed: list[int] = []
    members = [0, 1, 2, 3]
    for step in range(300):
        if rng.random() < 0.1:  # membership changes: one leaves, one returns
            members = sorted(rng.sample(range(replicas), rng.randint(1, replicas)))
        before = dealer.position()
        dealer.deal(members, members[0], step)
        assert dealer.position() == pytest.approx(before + len(members) / replicas)
        present = members if rng.random() > 0.1 else members[:max(1, len(members) - 1)]  # one died mid-step
        dealer.commit(present)
        committed += dealer.last_commit["committed"]
        assert len(dealer.last_commit["committed"]) == per * len(present)
    assert len(set(committed)) == len(committed)
    assert sorted(committed + dealer.held()) == list(range(dealer.fresh))
    assert dealer.committed == len(committed)
    assert dealer.position() == pytest.approx(len(committed) / (replicas * per))


def test_a_window_given_back_from_an_absent_replica_reaches_a_present_one():
    dealer = _dealer(per=2, replicas=3)
    dealer.deal([0, 1, 2], 0, 0)
    dealer.commit([1, 2])  # replica 0 died in the step: its windows 0, 1 come back
    assert dealer.last_commit["given_back"] == [0, 1]
    for step in range(1, 4):  # replica 0 stays away
        dealer.deal([1, 2], 1, step)
        dealer.commit([1, 2])
        if {0, 1} <= set(dealer.last_commit["committed"]):
            break
    assert {0, 1} <= set(dealer.last_commit["committed"]), "windows given back never reached a present replica"


@pytest.mark.parametrize("lands", ["before the next deal", "after the next deal"])
def test_a_commit_launched_in_the_background_holds_the_steps_up_to_its_launch_wherever_it_lands(lands):
    """Streaming DiLoCo's fragment commits on the communication worker while the next step is dealt and trained (τ
    = 1): its commit holds the windows dealt up to the step that launched it, and gives back a missing replica's
    windows to be dealt from step launch + τ + 1 -- the same deals on every replica, wherever its commit landed."""
    dealer = _dealer(per=2, replicas=3, lag=1)
    worker = CommWorker(name="test-dealer")
    try:
        dealer.deal([0, 1, 2], 0, 0)  # step 1: windows 0..5
        dealer.commit([0, 1, 2])
        dealer.deal([0, 1, 2], 0, 1)  # step 2: windows 6..11; its sync launches, replica 2 dies in it
        job = worker.submit(lambda: dealer.commit([0, 1]))  # the job runs in the context of its submit
        if lands == "before the next deal":
            job.wait()
        step3 = dealer.deal([0, 1], 0, 2)  # step 3: fresh windows 12..17, whenever the commit landed
        job.wait()
    finally:
        worker.close()
    assert dealer.last_commit["mark"] == 2 and dealer.last_commit["committed"] == [6, 7, 8, 9]
    assert dealer.last_commit["given_back"] == [10, 11] and step3 == [12, 13]
    assert dealer.held() == [10, 11, 12, 13, 14, 15, 16, 17]
    dealer.commit([0, 1])  # step 3's own commit (main thread: up to the step last dealt)
    assert dealer.last_commit["committed"] == [12, 13, 14, 15] and dealer.last_commit["given_back"] == [16, 17]
    # step 4 = launch + τ + 1 deals the background commit's windows given back (round-robin from slot 0); those
    # step 3's commit gave back wait for step 5
    assert [dealer.deal([0, 1], 0, 3), dealer.open[-1].slots[1]] == [[10, 18], [11, 19]]
    assert dealer.deal([0, 1], 0, 4) == [22, 23] and dealer.open[-1].slots[1:] == [[16, 24], [17, 25]]


def test_windows_are_the_one_reader_order_of_the_epochs_and_the_state_travels():
    dealer = _dealer(per=2, replicas=2)
    reader = ShardedSequences(torch.arange(4000) % 97, 16, 2, 0, 1, seed=3)
    first = reader.window_starts().clone()  # epoch 0's windows in the order one reader reads them
    n = dealer.windows_per_epoch
    epochs, starts = dealer.starts([0, 5, n - 1, n])
    assert epochs.tolist() == [0, 0, 0, 1] and starts[:3].tolist() == [int(first[0]), int(first[5]), int(first[-1])]
    assert torch.equal(dealer.batch([5]), reader.tokens[int(first[5]):int(first[5]) + 16][None])
    dealer.deal([0, 1], 0, 0)
    dealer.commit([0])
    other = _dealer(per=2, replicas=2)
    other.load_state_dict(dealer.state_dict())
    assert other.deal([0, 1], 1, 1) == dealer.deal([0, 1], 1, 1)
    with pytest.raises(ValueError, match=r"the peer deals 2 windows per replica of 2 \(lag 0\), this replica 2 of 3"):
        _dealer(per=2, replicas=3).load_state_dict(dealer.state_dict())
