"""The data policy under torchft, checked against its statement on long random failure histories: every window
dealt is committed at most once, none is skipped (committed, given back or still dealt: the sequence from 0 with no
gap), a window given back reaches a present replica, and the schedule's position follows the windows of the
replicas present."""

from __future__ import annotations

import random

import pytest
import torch

from quietsync.train.data import ShardedSequences
from quietsync.train.window_dealer import WindowDealer


def _dealer(per: int = 2, replicas: int = 3, tokens: int = 4000) -> WindowDealer:
    return WindowDealer(ShardedSequences(torch.arange(tokens) % 97, 16, per, 0, 1, seed=3), per, replicas)


def test_with_every_replica_present_the_steps_read_the_sequence_in_order():
    dealer = _dealer()
    assert [dealer.deal([0, 1, 2], k, 0) for k in (0,)] == [[0, 1]]  # slot 0 of the first step
    dealer.commit([0, 1, 2])
    assert dealer.last_commit == {"committed": [0, 1, 2, 3, 4, 5], "given_back": []}
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
    held = dealer.given_back + [w for ws in dealer.open.values() for w in ws]
    assert sorted(committed + held) == list(range(dealer.fresh))
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
    with pytest.raises(ValueError, match="the peer deals 2 windows per replica of 2, this replica 2 of 3"):
        _dealer(per=2, replicas=3).load_state_dict(dealer.state_dict())
