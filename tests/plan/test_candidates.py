"""The canonical grid: every spec parses, one row per setting (specs are normalized, so the defaults written out are
the same candidate), and every strategy is in it or left out with a reason."""

from __future__ import annotations

from quietsync.plan.candidates import canonical_grid, grid, parse_candidate, unique
from quietsync.strategies.registry import available
from quietsync.topology import Topology


def test_every_spec_parses_and_the_grid_has_no_duplicates():
    cands = [parse_candidate(s) for s in grid(wide=True)]
    assert len(unique(cands)) == len(cands)
    assert parse_candidate("demo:compression=0.03125") == parse_candidate("demo")
    assert parse_candidate("diloco:sync_every=16,fragments=4,overlap_delay=4").spec == \
        "diloco:sync_every=16,fragments=4,overlap_delay=4"


def test_every_strategy_is_ranked_or_left_out_with_a_reason():
    two_nodes, _ = canonical_grid(Topology(0, 2, 2), (2,))
    _, left = canonical_grid(Topology(0, 2, 2), (2,))
    names = {c.strategy for c in two_nodes} | {x.strategy for x in left}
    assert names - {"signsgd"} == set(available()) - {"signsgd"}  # the example's, where it is imported
    assert [x.strategy for x in left] == ["flexdemo"] and "worker per node" in left[0].reason
    four, left4 = canonical_grid(Topology(0, 4, 2), (2,))
    assert "flexdemo" in {c.strategy for c in four}
    assert [x.strategy for x in left4] == ["cdp"] and "4 stages" in left4[0].reason
