"""The priors quote the papers: DiLoCo's replica penalty is Charles et al.'s Table 8 fits (recomputed here from the
published A, α), the critical-batch cost is McCandlish's rule with Kaplan's B_crit, the synchronous baselines are
exact, DPU without warm-up costs more than twice the tokens, and every note cites a listed source."""

from __future__ import annotations

import re

import pytest

from quietsync.plan.priors import PriorContext, critical_batch, prior_for, sources
from quietsync.plan.schedules import strategy_config
from quietsync.strategies.local.facts import diloco_replica_penalty

# Charles et al. 2025 (arXiv:2503.09799), Table 8, copied from the paper: L(N) ≈ A·N^α
TABLE_8 = {"dp": (18.129, -0.0953), 1: (18.363, -0.0961), 2: (18.768, -0.0969), 4: (19.762, -0.0992),
           8: (21.051, -0.1018)}
CTX = PriorContext(params=1_000_000_000, workers=2, nodes=2, baseline_tokens_per_step=2048, target_loss=3.0)


@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [35e6, 1e9, 2.4e9])
def test_diloco_replica_penalty_is_table_8(m, n):
    a, alpha = TABLE_8[m]
    a0, alpha0 = TABLE_8["dp"]
    assert diloco_replica_penalty(n, m) == pytest.approx(a * n ** alpha / (a0 * n ** alpha0) - 1, rel=1e-9)


def test_more_replicas_cost_more_and_larger_models_less():
    assert diloco_replica_penalty(1e8, 2) < diloco_replica_penalty(1e8, 3) < diloco_replica_penalty(1e8, 8)
    assert diloco_replica_penalty(1e8, 16) > diloco_replica_penalty(1e8, 8)
    assert diloco_replica_penalty(2.4e9, 8) < diloco_replica_penalty(35e6, 8)


def test_critical_batch_rule():
    # B_crit(L) = 2e8 / L^(1/0.21) tokens; E = E_min (1 + B/B_crit)
    assert critical_batch(3.0) == pytest.approx(2e8 / 3.0 ** (1 / 0.21))
    bc = critical_batch(3.0)
    big = 16 * 2048
    p = prior_for("acco", strategy_config("acco"), CTX, tokens_per_step=big)
    assert p.multiplier[1] == pytest.approx((1 + big / bc) / (1 + 2048 / bc))
    assert p.multiplier[0] < p.multiplier[1] < p.multiplier[2]


def test_synchronous_baselines_are_exact_and_dpu_costs_more_than_twice():
    for name in ("ddp", "zero1", "fsdp"):
        assert prior_for(name, strategy_config(name), CTX, 2048).exact
    dpu = prior_for("dpu", strategy_config("dpu"), CTX, 2048)
    assert dpu.multiplier[0] >= 2.0 and not dpu.exact


def test_every_prior_cites_listed_sources():
    settings = [("diloco", {"sync_every": 16, "fragments": 4, "overlap_delay": 4}), ("diloco", {"outer": "sparseloco"}),
                ("demo", {}), ("demo", {"compression": 1 / 1024}), ("demo", {"replicator": "random"}), ("wp", {}),
                ("localsgd", {"sync_every": 16}), ("cdp", {}), ("flexdemo", {}), ("acco", {})]
    for name, knobs in settings:
        p = prior_for(name, strategy_config(name, knobs), CTX, 2048)
        assert p.notes, name
        for key in re.findall(r"\[([a-z0-9, ]+)\]", " ".join(p.notes)):
            for k in key.split(", "):
                assert k in sources(), (name, k)
        assert p.penalty[0] <= p.penalty[1] <= p.penalty[2], name


def test_heavier_demo_compression_and_longer_delay_cost_more():
    def d(name, knobs):
        return prior_for(name, strategy_config(name, knobs), CTX, 2048).penalty[1]

    assert d("demo", {"compression": 1 / 1024}) > d("demo", {"compression": 1 / 256}) > d("demo", {}) == 0.0
    assert d("diloco", {"sync_every": 16, "fragments": 1, "overlap_delay": 16}) > d(
        "diloco", {"sync_every": 16, "fragments": 4, "overlap_delay": 4}) > d("diloco", {"sync_every": 16})


def test_sparseloco_sends_two_bit_values_by_default():
    assert strategy_config("diloco", {"outer": "sparseloco"}).pseudo_grad_dtype == "int2"
    assert strategy_config("diloco").pseudo_grad_dtype == "fp32"
    assert strategy_config("diloco", {"outer": "sparseloco", "pseudo_grad_dtype": "fp32"}).pseudo_grad_dtype == "fp32"


def test_adapt_widens_the_prior_by_the_largest_h_it_may_take():
    """diloco --adapt: the prior is at the H chosen, its upper end widened by the assumed 0.5% per doubling up to the
    largest candidate H (16·H by default: 4 doublings; adapt_sync_every=16,32: one)."""
    def upper(knobs):
        return prior_for("diloco", strategy_config("diloco", knobs), CTX, 2048).penalty

    static = upper({"sync_every": 16})
    default = upper({"sync_every": 16, "adapt": True})
    short = upper({"sync_every": 16, "adapt": True, "adapt_sync_every": "16,32"})
    assert default[:2] == short[:2] == static[:2]
    assert default[2] == pytest.approx(static[2] + 4 * 0.005) and short[2] == pytest.approx(static[2] + 0.005)
    assert upper({"sync_every": 16, "adapt": True, "adapt_knobs": "bits"}) == static  # H stays: nothing widens
