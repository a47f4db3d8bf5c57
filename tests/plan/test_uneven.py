"""The planner under unevenness: with one slow worker a synchronous step goes at the slowest worker's pace, while
adaptive inner steps (Async Local-SGD / DyLU) give each worker its share of a round by its speed — the round's
tokens are the sum over workers of speed × round time; on a link that changes (a ``--link`` schedule) each setting's
time to the target integrates its speed over the stretches of the link, and ``--adapt`` is costed at the H its
controller picks on each. Rows for these are ranked only where the cluster is uneven or the link varies: every
other plan is the plan it was. The references below are written from those rules, not from the planner's code."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("transformers")

import quietsync  # noqa: E402

TINY = dict(what_if=True, model="tiny", nproc=2, micro_batch_size=8, seq_len=128, plot=False,
            device_flops="0.05tflops")  # a slow device: the tiny model's compute is what a slow worker slows
ADAPTIVE = "diloco:inner_steps=adaptive,sync_every=16"
FIXED = "diloco:sync_every=16"


def rows(result):
    return {r.spec: r for r in result.rows}


def test_adaptive_inner_steps_cost_the_fastest_workers_round_and_every_workers_tokens():
    result = quietsync.plan.plan(**TINY, link=["inter=100mbit,5ms"], only=True, slow_worker=["1:3"],
                                 strategies=[ADAPTIVE, FIXED])
    by = rows(result)
    fixed, adaptive = by[FIXED], by[ADAPTIVE]
    c = result.compute
    t = c.micro_batch_s + c.optimizer_s(result.workload.params)  # an inner step of the fast worker (scale 1)
    L = 16
    slow_steps = max(1, round(L / 3))  # H_i = round(L · v_i / max v): the 3× slower worker's share
    sync = fixed.step_s - 3 * t  # the sync amortised per step (the fixed row waits 3t for the slow worker)
    round_s = max(L * t, slow_steps * 3 * t)
    assert fixed.micro_batches == 2
    assert adaptive.micro_batches == pytest.approx((L + slow_steps) / L)
    assert adaptive.step_s == pytest.approx(round_s / L + sync, rel=1e-9)
    tokens = adaptive.micro_batches * result.workload.tokens_per_micro_batch
    assert adaptive.tokens_per_s == pytest.approx(tokens / adaptive.step_s)
    assert adaptive.tokens_per_s > 1.5 * fixed.tokens_per_s  # (16 + 5)/16 micro-batches per t, not 2 per 3t


def test_with_equal_workers_adaptive_inner_steps_predict_the_fixed_row_exactly():
    result = quietsync.plan.plan(**TINY, link=["inter=100mbit,5ms"], only=True, strategies=[ADAPTIVE, FIXED])
    by = rows(result)
    assert by[ADAPTIVE].step_s == by[FIXED].step_s and by[ADAPTIVE].tokens_per_s == by[FIXED].tokens_per_s


def test_adaptive_rows_are_ranked_on_an_uneven_cluster_only_and_recommended_there():
    even = quietsync.plan.plan(**TINY, link=["inter=100mbit,5ms"], target_tokens=3_000_000)
    assert not any("inner_steps" in r.spec or "adapt=" in r.spec for r in even.rows)
    assert not even.advice.notes
    uneven = quietsync.plan.plan(**TINY, link=["inter=100mbit,5ms"], target_tokens=3_000_000, slow_worker=["1:3"])
    added = {r.spec for r in uneven.rows} - {r.spec for r in even.rows}
    assert added == {ADAPTIVE, "localsgd:inner_steps=adaptive,sync_every=16",
                     "diloco:inner_steps=adaptive,sync_every=16,fragments=4,overlap_delay=4,pseudo_grad_dtype=fp4"}
    best = min((s for s in uneven.scored if s.reaches), key=lambda s: s.objective)
    assert "inner_steps=adaptive" in best.row.spec  # compute-bound with a 3× slower worker: nothing else comes close
    note = " ".join(uneven.advice.notes)
    assert "--inner-steps adaptive" in note and f"recommended, `{best.row.spec}`" in note
    # the rows say what their tokens to the target rest on: the priors here (no pilot)
    assert all(s.estimate.source == "prior" for s in uneven.scored if "inner_steps" in s.row.spec)


def test_on_a_link_schedule_time_to_target_integrates_each_stretch():
    from quietsync.plan.objective import phased_seconds

    # by hand: 100 tokens/s for 10 s (1000 tokens), then 10 tokens/s
    assert phased_seconds(500, ((0.0, 100.0), (10.0, 10.0))) == pytest.approx(5.0)
    assert phased_seconds(1500, ((0.0, 100.0), (10.0, 10.0))) == pytest.approx(10.0 + 500 / 10)
    assert phased_seconds(1500, ((0.0, 100.0), (10.0, 10.0)), factor=2.0) == pytest.approx(7.5)  # a pilot's 2×
    steady = quietsync.plan.plan(**TINY, link=["inter=100mbit,5ms"], only=True, strategies=["zero1", FIXED],
                                 target_tokens=3_000_000)
    slow = quietsync.plan.plan(**TINY, link=["inter=2mbit,5ms"], only=True, strategies=["zero1", FIXED],
                               target_tokens=3_000_000)
    change = 600.0
    varying = quietsync.plan.plan(**TINY, link=[f"inter=100mbit,5ms@0s,2mbit@{change:g}s"], only=True,
                                  strategies=["zero1", FIXED], target_tokens=3_000_000)
    for spec in ("zero1", FIXED):
        fast_tps, slow_tps = rows(steady)[spec].tokens_per_s, rows(slow)[spec].tokens_per_s
        scored = next(s for s in varying.scored if s.row.spec == spec)
        tokens = scored.estimate.tokens.value
        before = fast_tps * change
        want = tokens / fast_tps if tokens <= before else change + (tokens - before) / slow_tps
        assert scored.time.seconds.value == pytest.approx(want, rel=1e-9), spec
        assert rows(varying)[spec].tokens_per_s == fast_tps  # the table shows the first stretch


def test_adapt_is_costed_at_the_h_its_controller_picks_on_each_stretch():
    link = "inter=1mbit,5ms"
    from quietsync.plan.candidates import candidate

    candidates = [candidate("diloco", {"sync_every": 16 * 2 ** k}).spec for k in range(5)]  # H = 64 is "diloco"
    fixed = rows(quietsync.plan.plan(**TINY, link=[link], only=True, strategies=candidates))
    # the controller's rule: the smallest H whose exposed communication is at most 10% of the compute
    fits = [s for s in candidates if fixed[s].exposed_comm_s <= 0.1 * fixed[s].compute_s]
    want = fixed[fits[0] if fits else candidates[-1]]
    adapt = rows(quietsync.plan.plan(**TINY, link=[link], only=True,
                                     strategies=["diloco:adapt=true,sync_every=16"]))
    got = adapt["diloco:adapt=true,sync_every=16"]
    assert want.spec != FIXED  # 1 Mbit/s: H = 16 cannot be carried
    assert got.step_s == pytest.approx(want.step_s, rel=1e-9) and got.tokens_per_s == pytest.approx(want.tokens_per_s)


def test_a_varying_link_ranks_adapt_and_the_advice_names_it():
    varying = quietsync.plan.plan(**TINY, link=["inter=100mbit,5ms@0s,1mbit@100s"], target_tokens=3_000_000)
    specs = {r.spec for r in varying.rows}
    assert {"diloco:adapt=true,sync_every=16", "diloco:adapt=true,sync_every=16,pseudo_grad_dtype=fp4"} <= specs
    assert {"acco:max_accumulation=4,adapt=true", "demo:topk=128,adapt=true"} <= specs  # each adapt, ranked
    assert any("`--adapt` re-picks a setting's knob from the measured link as it changes (acco, demo, diloco)" in n
               for n in varying.advice.notes)
    steady = quietsync.plan.plan(**TINY, link=["inter=100mbit,5ms"], target_tokens=3_000_000)
    assert not any(r.knobs.get("adapt") for r in steady.rows)  # only where the link varies
    adapt = next(s for s in varying.scored if s.row.spec == "diloco:adapt=true,sync_every=16")
    fixed = next(s for s in varying.scored if s.row.spec == FIXED)
    assert math.isfinite(adapt.objective) and adapt.objective < fixed.objective  # H grows when the link drops


def test_a_pilot_of_adaptive_inner_steps_evaluates_only_at_round_ends():
    from quietsync.plan.candidates import parse_candidate
    from quietsync.plan.pilots import eval_every

    # the trainer refuses --eval-every off a round's end under adaptive inner steps (the workers meet only there)
    assert eval_every(parse_candidate(ADAPTIVE), 32) == 16 and eval_every(parse_candidate(FIXED), 32) == 2
    assert eval_every(parse_candidate(ADAPTIVE), 16 * 40) == 32
    streaming = parse_candidate("diloco:inner_steps=adaptive,sync_every=16,fragments=4,overlap_delay=4")
    assert eval_every(streaming, 32) == 4  # a round is H / F = 4 steps


def test_a_delay_free_pilot_of_adaptive_inner_steps_gives_its_row_the_tokens_per_step_it_measured(tmp_path):
    """How many inner steps the slow worker takes per round follows the speeds the workers really had in the pilot,
    not the calibration's: the pilot's tokens per step replace the row's, its step time corrects the row's as for
    every delay-free pilot."""
    import copy

    pytest.importorskip("optuna")
    from quietsync.plan.pilot_plan import _delay_free, run_pilots
    from quietsync.plan.planner import predict
    from tests.plan.test_pilots import power_law_runner

    result = quietsync.plan.plan(**TINY, link=["inter=100mbit,5ms"], only=True, slow_worker=["1:3"],
                                 strategies=["zero1", ADAPTIVE], target_loss=4.5)
    cfg = copy.copy(result.config)
    cfg.pilot_tokens, cfg.pilot_out, cfg.pilot_args = 160_000, str(tmp_path), ["--warmup-steps", "1"]
    result.config = cfg
    model = next(r for r in result.rows if r.spec == ADAPTIVE)
    free = result.predict("diloco", {"sync_every": 16, "inner_steps": "adaptive"}, _delay_free(result)).step_s
    batch = 1.5 * model.tokens_per_step  # the slow worker kept up better than the calibration said
    runner = power_law_runner({"zero1": 4.0, ADAPTIVE: 4.0}, step_s={"zero1": 1.0, ADAPTIVE: 2 * free},
                              batch={"zero1": 2048.0, ADAPTIVE: batch})
    new = run_pilots(result, predict, runner)
    scored = next(s for s in new.scored if s.row.spec == ADAPTIVE)
    assert not new.pilots[ADAPTIVE].through_link
    assert scored.row.tokens_per_step == pytest.approx(batch)
    # its step: the model's, corrected by what the pilot spent beyond the delay-free prediction
    assert batch / scored.time.tokens_per_s == pytest.approx(model.step_s + free, rel=0.02)
