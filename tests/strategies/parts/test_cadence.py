"""The decision cadence every ``--adapt`` controller keeps (parts/link_probe.Cadence): a decision every N events,
only on a ratio that moved beyond the threshold since the last pick, both carried through a checkpoint."""

from __future__ import annotations

import math

from quietsync.strategies.parts.link_probe import Cadence


def test_a_decision_is_due_every_n_events_and_only_on_a_ratio_that_moved():
    c = Cadence(every=3, threshold=0.5)
    assert [c.due() for _ in range(7)] == [False, False, True, False, False, True, False]
    assert c.moved(1.0)  # no pick yet: the first decision picks
    c.ratio = 1.0
    assert not c.moved(1.4) and not c.moved(1 / 1.4) and c.moved(1.6) and c.moved(0.6)
    assert Cadence(every=1, threshold=0.0).due() and Cadence(every=1, threshold=0.0).moved(5.0)


def test_the_cadence_survives_a_checkpoint_and_an_older_one_starts_afresh():
    c = Cadence(every=4, threshold=0.5)
    c.due(), c.due()
    c.ratio = 2.5e-3
    plain, logical = Cadence(4, 0.5), Cadence(4, 0.5)
    plain.load(c.state())
    saved = c.logical_state()
    logical.load_logical({k: saved[k].clone() for k in Cadence.logical_targets(saved)})
    assert all((x.count, x.ratio) == (2, 2.5e-3) for x in (plain, logical))
    fresh = Cadence(4, 0.5)
    unpicked = fresh.logical_state()
    assert math.isnan(float(unpicked["adapt.ratio"]))  # no pick yet: NaN on the wire, None back
    logical.load_logical({k: v.clone() for k, v in unpicked.items()})
    assert (logical.count, logical.ratio) == (0, None)
    older = Cadence(4, 0.5)
    older.load({"topk": 8, "changed_at": 3})  # a checkpoint written before the cadence was kept
    older.load_logical({"adapt.topk": 8})
    assert (older.count, older.ratio) == (0, None)
