"""``quietsync plan`` and ``quietsync.plan.plan(...)``: bad input is one line and exit 2 before anything starts, a
described cluster is predicted without running anything, a measured plan calibrates and probes real workers,
and the equal-token findings quoted to users are in the files they cite."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

import quietsync  # noqa: E402
from quietsync.commands.main import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WHAT_IF = ["--what-if", "--model", "1b", "--nodes", "2", "--workers-per-node", "8", "--seq-len", "2048",
           "--micro-batch-size", "4", "--link", "intra=900gbit,2us"]


@pytest.mark.parametrize("argv,says", [
    (["--model", "nope"], "--model must be a preset"),
    (["--model", "1b"], "--model '1b' is a described size, only for --what-if"),
    (["--nproc", "4", "--nodes", "3"], "--nodes must divide nproc"),
    (["--link", "inter=100xx"], "--link bandwidth must be a number with a unit"),
    (["--link", "between=1gbit"], "--link must look like 'inter=100mbit,5ms'"),
    (["--slow-worker", "5:2"], "--slow-worker must look like RANK:FACTOR"),
    (["--strategies", "nosuch"], "--strategies: 'nosuch' is not a strategy (choose from acco, "),
    (["--strategies", "nosuch:x=1"], "--strategies: 'nosuch' (in 'nosuch:x=1') is not a strategy"),
    (["--strategies", "diloco:sync_every=0"], "sync_every must be an integer >= 1"),
    (["--strategies", "diloco:adapt=yes"], "'diloco:adapt=yes': adapt takes true or false, got 'yes'"),
    (["--strategies", "diloco:adapt_knobs=bits"], "adapt_knobs needs adapt=true"),
    (["--strategies", "diloco:sync_every=16,,fragments=4"], "with no empty field, got 'diloco:sync_every=16,,"),
    (["--target-loss", "-1"], "--target-loss must be > 0 (or leave the flag out), got -1.0"),
    (["--target-loss", "4", "--pilot-tokens", "0"], "--pilot-tokens must be an integer >= 1"),
    (["--target-loss", "4"], "--target-loss needs --pilot-tokens N in a measured plan"),
    (["--target-loss", "4"], "or --what-if"),
    (["--pilot-tokens", "1000"], "--pilot-tokens needs --target-loss"),
    (["--reuse-pilots"], "--reuse-pilots is about pilot runs: it needs --pilot-tokens N"),
    (["--pilot-out", "p"], "--pilot-out is about pilot runs: it needs --pilot-tokens N"),
    (["--target-loss", "4", "--pilot-tokens", "9000", "--train-args", "--lr 0"], "--train-args: --lr must be"),
    (["--target-loss", "4", "--pilot-tokens", "9000", "--train-args", "--out x"], "must not set --out"),
    # below 4 steps of the baseline's tokens (2 workers x 8 x 128): refused before any probe or pilot
    (["--target-loss", "5", "--pilot-tokens", "10"], "--pilot-tokens must be >= 8192 (4 steps of 2 workers x "
     "--micro-batch-size 8 x --seq-len 128 tokens"),
    (WHAT_IF[:-2] + ["--link", "inter=1gbit"], "--link must be given for intra with --what-if"),
    (["--what-if", "--model", "transformer:hidden=8"], "needs hidden, layers and vocab"),
    (WHAT_IF + ["--link", "inter=1gbit,20ms", "--only"], "--only needs strategies"),
    (["--target-loss", "4", "--pilot-tokens", "9000", "--train-args", "--max-steps 2"],
     "--train-args: --max-steps 2 stops every pilot before the 4 evaluations"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_worker(argv, says, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("quietsync plan: error: "), err
    assert says in err, err


def test_one_link_and_one_strategy_given_as_strings_from_python_are_lists_of_one():
    result = quietsync.plan.plan(what_if=True, model="1b", nodes=2, workers_per_node=1, seq_len=2048,
                                 micro_batch_size=4, link="inter=1gbit,20ms", strategies="diloco:sync_every=64",
                                 only=True)
    assert [r.strategy for r in result.rows] == ["diloco"] and result.cluster.links.model["inter"].bandwidth == 1.25e8


def test_an_out_that_is_a_file_is_refused_before_anything_runs(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    assert main(["plan", *WHAT_IF, "--link", "inter=1gbit,20ms", "--out", str(tmp_path / "afile")]) == 2
    assert "--out" in capsys.readouterr().err and (tmp_path / "afile").read_text() == ""


def test_a_plan_with_every_setting_left_out_says_why_in_one_line(capsys):
    assert main(["plan", *WHAT_IF, "--link", "inter=1gbit,20ms", "--device-memory", "1MB"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("quietsync plan: error: no setting is left to rank: "), err
    assert "do not fit in the device's 0.001 GB (the smallest needs" in err, err


def test_a_pilot_budget_below_four_steps_leaves_nothing_in_out(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["plan", "--target-loss", "5", "--pilot-tokens", "10", "--out", str(out)]) == 2
    assert "--pilot-tokens must be >= 8192" in capsys.readouterr().err and not out.exists()


def test_what_if_predicts_every_strategy_with_exact_bytes_and_recommends_the_fastest():
    result = quietsync.plan.plan(what_if=True, model="1b", nodes=2, workers_per_node=8, seq_len=2048,
                                 micro_batch_size=4, link=["inter=100gbit,10us", "intra=900gbit,2us"])
    strategies = {r.strategy for r in result.rows}
    assert strategies >= {"ddp", "zero1", "fsdp", "acco", "dpu", "wp", "demo", "flexdemo", "localsgd", "diloco",
                          "cdp"}
    p, n = result.workload.params, 16
    ddp = next(r for r in result.rows if r.label == "ddp")
    assert ddp.bytes_per_link["inter"] == pytest.approx(2 * (n - 1) * p * 4 // n, rel=1e-6)  # one ring all-reduce
    zero1 = next(r for r in result.rows if r.label == "zero1")
    padded = -(-p // n) * n
    assert zero1.bytes_per_link["inter"] == 2 * ((n - 1) * padded * 4 // n)  # reduce-scatter + all-gather
    for r in result.rows:
        assert r.step_s > 0 and r.tokens_per_s > 0 and 0 < r.compute_busy <= 1 + 1e-9, r.label
    # one row per setting; the first recommendation is the least predicted time to target among them
    assert len({r.spec for r in result.rows}) == len(result.rows)
    best = min((s for s in result.scored if s.reaches), key=lambda s: s.objective)
    assert result.advice.recommendations[0].spec == best.row.spec
    ranked = [r.strategy for r in result.advice.ranking]
    assert len(ranked) == len(set(ranked))  # every strategy once
    assert set(ranked) | {x.split(":")[0] for x in result.advice.left_out} >= strategies
    text = result.markdown()
    assert "Diagnosis" in text and "Assumptions" in text and "6 × parameters" in text


def test_with_no_target_a_small_model_aims_below_its_untrained_loss_and_says_why():
    """The Chinchilla law after 20 tokens per parameter is above ln(vocabulary) for a 1 M-parameter model (9.2 nats
    at 4,096 tokens): its curve, carried to the smaller vocabulary and started at ln V, gives a target below."""
    import math

    for vocab in (4096, 300):
        result = quietsync.plan.plan(what_if=True, model="tiny", nproc=2, nodes=2, vocab_size=vocab,
                                     link=["inter=100mbit,10ms"])
        objective = result.objective
        assert objective.target < math.log(vocab) and objective.priors.target_loss == objective.target
        assert result.workload.vocab == vocab
        assert objective.baseline.law.a < objective.target  # and above the curve's floor
        said = " ".join(objective.notes)
        assert "the law alone gives" in said and f"not below ln {vocab:,}" in said and "--target-loss X" in said
    # a target given at or above the untrained loss is kept, and said to be there already
    result = quietsync.plan.plan(what_if=True, model="tiny", nproc=2, nodes=2, link=["inter=100mbit,10ms"],
                                 target_loss=9.0)
    assert result.objective.target == 9.0
    assert any("not below ln 4,096" in n and "already" in n for n in result.objective.notes)


def test_the_advice_says_faster_or_slower_than_the_baseline_the_right_way_round():
    from quietsync.plan.recommend import versus_baseline

    assert versus_baseline(6.2) == "6.20× faster than the baseline"  # the baseline takes 6.2 times as long
    assert versus_baseline(0.8) == "1.25× slower than the baseline"
    assert versus_baseline(1.0) == versus_baseline(1.001) == "as fast as the baseline"
    result = quietsync.plan.plan(what_if=True, model="1b", nodes=2, workers_per_node=8, seq_len=2048,
                                 micro_batch_size=4, link=["inter=1gbit,1ms", "intra=900gbit,2us"])
    text = result.markdown()
    assert "the baseline's time" not in text
    first = result.advice.recommendations[0]
    assert first.speedup > 1 and f"{first.speedup:.2f}× faster than the baseline" in text, text


def test_what_if_prediction_never_gets_slower_with_a_faster_link():
    slow = quietsync.plan.plan(what_if=True, model="1b", nodes=2, workers_per_node=8, seq_len=2048,
                               micro_batch_size=4, link=["inter=1gbit,1ms", "intra=900gbit,2us"], only=True,
                               strategies=["ddp", "zero1", "fsdp", "demo", "diloco", "acco"])
    fast = quietsync.plan.plan(what_if=True, model="1b", nodes=2, workers_per_node=8, seq_len=2048,
                               micro_batch_size=4, link=["inter=100gbit,1ms", "intra=900gbit,2us"], only=True,
                               strategies=["ddp", "zero1", "fsdp", "demo", "diloco", "acco"])
    for a, b in zip(slow.rows, fast.rows):
        assert a.label == b.label
        assert b.step_s <= a.step_s * (1 + 1e-9), a.label
        if a.strategy != "acco":  # ACCO's stages grow with a slow link: fewer hand-overs per token, not slower
            assert b.tokens_per_s >= a.tokens_per_s * (1 - 1e-9), a.label
        assert b.bytes_per_step == a.bytes_per_step


def test_the_planner_is_a_plain_package_over_the_cost_vocabulary():
    import quietsync.cost.costmodel as costmodel

    assert not callable(quietsync.plan) and quietsync.plan.plan is quietsync.plan.planner.plan
    assert quietsync.cost.Workload is quietsync.cost.workload.Workload
    assert costmodel.Comm is quietsync.cost.Comm


@pytest.mark.timeout(300)
def test_a_measured_plan_calibrates_and_probes_two_workers(tmp_path, capsys, forked_launch):
    rc = main(["plan", "--model", "tiny", "--nproc", "2", "--micro-batch-size", "2", "--seq-len", "16",
               "--repeats", "2", "--link", "inter=100mbit,5ms", "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Diagnosis" in out and "| setting |" in out
    import json

    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["compute"]["source"].startswith("calibrated on")
    assert saved["compute"]["forward_s"] > 0 and saved["compute"]["activation_bytes"] > 0
    assert set(saved["probe"]["fits"]) == {"inter"}  # 2 workers as 2 nodes: one link kind
    assert saved["cluster"]["links"]["inter"].startswith("100mbit,5ms, floor ")
    assert {r["strategy"] for r in saved["rows"]} >= {"ddp", "zero1", "acco", "demo", "diloco", "cdp"}


@pytest.mark.timeout(400)
def test_compare_predict_prints_predictions_beside_measurements(tmp_path, monkeypatch, forked_launch):
    import json

    from quietsync.commands.compare import compare_main
    from tests.train.conftest import synthetic_text

    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    data = tmp_path / "text.txt"
    data.write_text(synthetic_text(2000))
    out = tmp_path / "cmp"
    rc = compare_main([
        "--strategies", "zero1", "demo", "--predict", "--target-loss", "0.5", "--pilot-tokens", "1024",
        "--out", str(out), "--nproc", "2", "--model", "tiny",
        "--max-steps", "4", "--micro-batch-size", "2", "--seq-len", "32", "--vocab-size", "300",
        "--link", "inter=1gbit,1ms", "--dataset", str(data), "--cache-dir", str(tmp_path / "cache"),
        "--eval-windows", "4", "--eval-every", "1", "--no-progress", "--no-plot", "--no-export"])
    assert rc == 0
    rows = json.loads((out / "compare.json").read_text())
    assert [r["predicted"]["label"] for r in rows] == ["zero1", "demo dct 1/32"]
    for r in rows:  # bytes per step are the same every step for both: predicted exactly
        assert r["predicted"]["bytes_sent_per_step"] == r["bytes_sent_per_step"], r["label"]
        assert r["predicted"]["step_s"] > 0
        # the pilots ran (the baseline's gives the loss curve): a predicted time to target and a predicted curve
        assert r["predicted"]["source"] in ("exact", "pilot", "prior") and r["predicted"]["curve"]
        assert "value" in r["predicted"]["tokens_to_target"]
    assert (out / "pilots" / "zero1" / "summary.json").exists()
    text = (out / "compare.md").read_text()
    assert "Predicted (quietsync plan) beside measured" in text and "time to target s pred" in text


def test_crossovers_are_where_the_fastest_strategy_changes():
    result = quietsync.plan.plan(what_if=True, model="1b", nodes=2, workers_per_node=8, seq_len=2048,
                                 micro_batch_size=4, link=["inter=1gbit,100us", "intra=900gbit,2us"], only=True,
                                 memory_bandwidth="20gb/s",
                                 strategies=["ddp", "demo:replicator=random,compression=0.001"])
    kind, bws, curves, crossovers = result.sweep()  # slow memory: the codec costs what a fast link saves
    assert kind == "inter" and len(crossovers) == 1
    bw, slow_link_winner, fast_link_winner = crossovers[0]
    # compressed momentum wins on a slow link, plain DDP once the link is fast enough
    assert (slow_link_winner, fast_link_winner) == ("demo:replicator=random,compression=0.001", "ddp")
    from quietsync.cost.costmodel import Links
    from quietsync.link import LinkModel

    at = Links(model={"inter": LinkModel(bw, 1e-4), "intra": result.cluster.links.model["intra"]})
    a, b = (result.score(result.predict(n, k, at)).objective
            for n, k in (("ddp", {}), ("demo", {"replicator": "random", "compression": 0.001})))
    assert a == pytest.approx(b, rel=0.02)  # equal predicted time to target where the best setting changes


def test_worker_speeds_of_another_count_than_the_workers_are_left_out_as_train_refuses_them():
    from quietsync.plan.config import PlanError

    with pytest.raises(PlanError, match=r"localsgd: worker_speeds must have one value per worker \(2\), got 1"):
        quietsync.plan.plan(what_if=True, model="1b", nodes=2, workers_per_node=1, seq_len=2048, micro_batch_size=4,
                            link=["inter=1gbit,20ms"], strategies=["localsgd:inner_steps=adaptive,worker_speeds=1"],
                            only=True)


def test_a_target_below_the_baseline_curves_floor_is_refused_in_one_line_naming_the_floor(capsys):
    """No setting can be predicted to reach a loss below the curve every prior shifts: the plan says so first,
    instead of a ranking of settings that all miss."""
    argv = ["plan", *WHAT_IF, "--link", "inter=1gbit,20ms", "--target-loss", "1.0"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("quietsync plan: error: --target-loss 1 is below 2.04, the floor of the loss curve "
                          "assumed for this model (the Chinchilla law at N = "), err
    # the floor is an assumption about the data: the line says what measures the user's own curve
    assert "no setting is predicted to reach it; give a higher --target-loss, --target-tokens N or --budget-s S, " \
        "or plan with pilots on your data" in err, err


def test_where_the_baseline_misses_the_target_each_setting_says_so_and_no_strategy_claims_a_least_time():
    """A fitted curve (a pilot's) may flatten above the target: every row then misses it because the baseline does,
    not for its own multiplier or penalty, and no 'then' list repeats the setting it follows."""
    import dataclasses

    from quietsync.plan.recommend import advise

    result = quietsync.plan.plan(what_if=True, model="1b", nodes=2, workers_per_node=1, seq_len=2048,
                                 micro_batch_size=4, link=["inter=1gbit,20ms"], target_loss=2.6)
    missed = dataclasses.replace(result.objective, target=1.0, priors=dataclasses.replace(
        result.objective.priors, baseline_tokens=None, target_loss=1.0))
    scored = [missed.score(r) for r in result.rows]
    advice = advise(scored, result.compute, 2, missed.description, [])
    assert not advice.recommendations and not advice.tuned
    assert advice.unreachable and all(u.endswith("the baseline's loss curve, which every setting's follows, "
                                                 "flattens above the target") for u in advice.unreachable)
    # with the target reached, the chosen setting is never among those after it
    for line in result.advice.tuned:
        chosen = line.split("`")[1]
        assert f"`{chosen}`" not in line.split("(then ", 1)[1], line


def test_a_plan_by_budget_heads_its_column_with_the_loss_after_the_budget_not_a_time_to_target():
    result = quietsync.plan.plan(what_if=True, model="1b", nodes=2, workers_per_node=1, seq_len=2048,
                                 micro_batch_size=4, link=["inter=1gbit,20ms"], budget_s=3600)
    head = next(line for line in result.markdown().splitlines() if line.startswith("| setting"))
    assert head.endswith("| memory/worker | loss after 3600 s |"), head
    assert "to target" not in head


def test_long_predicted_times_read_in_days_and_years_not_tens_of_thousands_of_hours():
    from quietsync.plan.recommend import fmt_duration

    assert fmt_duration(95) == "95 s" and fmt_duration(3 * 3600) == "3 h"
    assert fmt_duration(3.13e4 * 3600) == "3.57 years"
    assert fmt_duration(10 * 86400) == "10 days"
    assert fmt_duration(float("inf")) == "∞"
