"""The canonical grid: every spec parses, one row per setting (specs are normalized, so the defaults written out are
the same candidate), and every strategy is in it or left out with a reason."""

from __future__ import annotations

import pytest

import quietsync
from quietsync.commands.main import main
from quietsync.plan import planner
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


def test_a_strategy_asked_for_where_its_declaration_says_it_does_not_apply_is_left_out_with_its_reason(
        capsys, monkeypatch):
    """FlexDeMo shards inside a node: with one worker per node it is DeMo, so ``--strategies flexdemo`` (even under
    ``--only``) is left out as the grid's FlexDeMo is, and alone it leaves nothing to rank: one line, exit 1."""
    link = ["inter=100mbit,10ms"]
    result = quietsync.plan.plan(what_if=True, model="tiny", nproc=2, nodes=2, link=link, only=True,
                                 strategies=["flexdemo", "demo"])
    assert [r.strategy for r in result.rows] == ["demo"]
    assert [x.strategy for x in result.left_out] == ["flexdemo"]
    assert any(t.startswith("flexdemo: needs more than one worker per node") for t in result.advice.left_out)
    # with two workers per node it is ranked; on one worker a setting asked for by name is ranked as before
    two = quietsync.plan.plan(what_if=True, model="tiny", nproc=4, nodes=2, link=[*link, "intra=10gbit,10us"],
                              only=True, strategies=["flexdemo"])
    assert [r.strategy for r in two.rows] == ["flexdemo"]
    one = quietsync.plan.plan(what_if=True, model="tiny", nproc=1, only=True, strategies=["demo"])
    assert [r.strategy for r in one.rows] == ["demo"]
    # the only one asked for: a measured plan says so before any worker starts
    monkeypatch.setattr(planner, "measure", lambda *args: pytest.fail("workers started"))
    for argv in (["--what-if", "--link", link[0]], []):
        assert main(["plan", "--model", "tiny", "--nproc", "2", "--nodes", "2", *argv, "--only", "--strategies",
                     "flexdemo"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert "no setting is left to rank: flexdemo: needs more than one worker per node" in err, err
