"""A strategy of your own is a new file that declares what the rest must know: the signSGD example
(``examples/custom_strategy.py``), loaded with ``--strategy-module`` and edited nowhere else, is ranked by
``quietsync plan --strategies signsgd`` on its declared prior and then on its pilot, runs under
``--fault-tolerance torchft`` (two replica groups, one killed and healed, every data window committed once), and
is listed by the GPU check with the flag that makes its runs import it."""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest

import quietsync.plan
from quietsync.strategies import registry

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "custom_strategy.py")
PLAN = dict(what_if=True, model="tiny", nodes=2, workers_per_node=1, seq_len=128, micro_batch_size=8,
            link=["inter=10mbit,5ms"], only=True, target_loss=3.5, strategies=["zero1", "ddp", "signsgd"],
            strategy_module=EXAMPLE)


@pytest.fixture
def own_strategy():
    """The registry (and the example's module, its folder on the import path) as they were before the test."""
    saved = dict(registry._REGISTRY), dict(registry._SCHEDULES)
    module, path = sys.modules.get("custom_strategy"), list(sys.path)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved[0])
    registry._SCHEDULES.clear()
    registry._SCHEDULES.update(saved[1])
    if module is None:
        sys.modules.pop("custom_strategy", None)
    else:
        sys.modules["custom_strategy"] = module
    sys.path[:] = path


# ---------------------------------------------------------------------------------------------- the planner
def test_the_plan_ranks_it_on_its_declared_prior_and_cost(own_strategy):
    # a 1B model on two nodes, the baseline's tokens to the target from the Chinchilla law
    result = quietsync.plan.plan(**{**PLAN, "model": "1b", "seq_len": 2048, "link": ["inter=1gbit,20ms"],
                                    "target_loss": 3.0})
    by = {s.row.strategy: s for s in result.scored}
    signsgd, ddp = by["signsgd"], by["ddp"]
    # its cost: one int8 vote per parameter where DDP all-reduces fp32 gradients
    assert signsgd.row.bytes_per_link["inter"] == pytest.approx(ddp.row.bytes_per_link["inter"] / 4, rel=1e-6)
    # its loss per token: the declared penalty, cited, on the baseline's curve
    assert signsgd.estimate.source == "prior"
    assert any("[bernstein2019]" in n for n in signsgd.estimate.notes)
    assert signsgd.estimate.tokens.value > ddp.estimate.tokens.value  # +5% loss at equal tokens: more tokens
    assert "signsgd" in {r.strategy for r in result.advice.recommendations}
    assert "sends" in result.markdown() and "one int8 vote per parameter" in result.markdown()  # its advice


def test_the_plan_ranks_it_on_its_pilot(own_strategy, tmp_path):
    from quietsync.plan.pilot_plan import run_pilots
    from quietsync.plan.pilots import PilotCurve
    from quietsync.plan.planner import predict

    pytest.importorskip("optuna")
    # the what-if refuses 3.5, below the assumed (Chinchilla) curve's floor for this model; the pilots fit their own
    result = quietsync.plan.plan(**{**PLAN, "target_loss": 5.0})
    cfg = copy.copy(result.config)
    cfg.target_loss = 3.5
    cfg.pilot_tokens, cfg.pilot_out, cfg.pilot_args = 160_000, str(tmp_path), []
    result.config = cfg
    floors = {"zero1": 4.0, "ddp": 4.0, "signsgd": 3.4}  # signsgd's pilot learns faster than its prior says

    def run(cand, budget, on_eval):
        curve = PilotCurve(cand.spec)
        for i in range(1, 17):
            t = budget * i / 16
            curve.steps.append(int(t / 2048))
            curve.tokens.append(t)
            curve.losses.append(3.0 + floors[cand.spec] * (t / 1000) ** -0.3)
            curve.eval_s.append(0.01)
            curve.time_s.append(t / 2048 * 0.1 + 0.01 * i)
            if on_eval(curve):
                curve.stopped = "pruned"
                break
        curve.wall_s = curve.time_s[-1]
        return curve

    new = run_pilots(result, predict, run)
    assert "signsgd" in new.pilots
    by = {s.row.strategy: s for s in new.scored}
    assert by["signsgd"].estimate.source == "pilot"
    # below the baseline's curve at every token count: fewer tokens to the target than the baseline's
    assert by["signsgd"].estimate.tokens.value < by["zero1"].estimate.tokens.value


def test_the_plan_command_loads_it_and_its_pilots_would_too(own_strategy, capsys):
    from quietsync.commands.main import main
    from quietsync.plan.candidates import parse_candidate
    from quietsync.plan.pilots import ProcessRunner

    code = main(["plan", "--strategy-module", EXAMPLE, "--what-if", "--model", "tiny", "--nodes", "2",
                 "--workers-per-node", "1", "--seq-len", "128", "--link", "inter=10mbit,5ms", "--strategies",
                 "signsgd:min_votes=0.25"])
    assert code == 0
    assert "`signsgd:min_votes=0.25`" in capsys.readouterr().out
    runner = ProcessRunner(["--model", "tiny"], [], Path("unused"), None, lambda c: 2048.0, lambda c: False)
    argv = runner.argv(parse_candidate("signsgd"), 10_000, Path("unused"))
    assert argv[argv.index("--strategy-module") + 1] == EXAMPLE  # each pilot imports it


# ---------------------------------------------------------------------------------------------- torchft
@pytest.mark.timeout(240)
def test_it_runs_under_torchft_one_replica_killed_and_healed(tmp_path):
    pytest.importorskip("torchft")
    import quietsync.faults  # noqa: F401  (before torchft: its Rust log level is read at import)

    from .faults.test_torchft_strategies import wait_until
    from .faults.torchft_replicas import KILLED, Replicas, audit, job_flags, records, wait_exit

    out = tmp_path / "run"
    release = tmp_path / "replica1-is-up"
    flags = job_flags(tmp_path, out, "--strategy-module", EXAMPLE, "--strategy", "signsgd", "--max-steps", "16",
                      "--no-export")
    replicas = Replicas(tmp_path, 2, flags)
    try:
        go = f"step:0:{tmp_path / 'go'}"
        r0 = replicas.start(0, {"QUIETSYNC_FT_HOLD": f"{go},step:9:{release}"})
        r1 = replicas.start(1, {"QUIETSYNC_FT_KILL": "step:5", "QUIETSYNC_FT_HOLD": go})
        replicas.go(tmp_path / "go", [0, 1])
        assert wait_exit(replicas, r1) == KILLED, replicas.logs()
        wait_until(lambda: any(r["members"] == [0] for r in records(out, 0)), replicas)
        r1 = replicas.start(1, {"QUIETSYNC_FT_READY": str(tmp_path / "ready")})
        replicas.wait_file(tmp_path / "ready")
        replicas.wait_asking(1, [release])
        release.write_text("")
        assert wait_exit(replicas, r0) == 0, replicas.logs()
        assert wait_exit(replicas, r1) == 0, replicas.logs()
    finally:
        replicas.close()
    survivor, returned = records(out, 0), records(out, 1)
    members = [r["members"] for r in survivor]
    assert members[0] == [0, 1] and [0] in members and members[-1] == [0, 1], members
    assert survivor[-1]["healed"] == 0 and returned[-1]["healed"] == 1
    assert returned[-1]["step"] == survivor[-1]["step"]
    committed, summary = audit(out, 2, 1)
    assert len(set(committed)) == len(committed), "a window trained twice"
    assert sorted(committed + summary["windows_held"]) == list(range(summary["windows_dealt"])), "a window skipped"


def test_its_torchft_policy_is_the_declared_one(own_strategy):
    from quietsync.faults.flags import ft_problem
    from quietsync.faults.support import policies, refusal
    from quietsync.train.args import parse_train_args

    registry.load_module(EXAMPLE)
    assert refusal("signsgd") is None and policies()["signsgd"].workers == "one"
    cfg, strategy_config, _ = parse_train_args(["--strategy-module", EXAMPLE, "--strategy", "signsgd", "--nproc",
                                                "4", "--nodes", "2"])
    problem = ft_problem(dataclasses.replace(cfg, fault_tolerance="torchft"), strategy_config, set(), 4, False)
    assert problem is not None and "--strategy signsgd keeps its state per worker" in problem


# ---------------------------------------------------------------------------------------------- the GPU check
def test_the_gpu_check_lists_it_with_the_flag_that_imports_it(own_strategy):
    from quietsync.gpu_check import checks
    from quietsync.gpu_check.cli import parse

    builtin = checks.strategy_specs()
    args = parse(["--strategy-module", EXAMPLE, "--strategies", "zero1", "signsgd", "--device", "cpu"])
    assert args.strategies == ["zero1", "signsgd"]
    specs = checks.strategy_specs()
    assert specs["signsgd"] == ["--strategy-module", EXAMPLE]
    assert list(specs)[:len(builtin)] == list(builtin)  # the others first, in their order
    assert checks.mixed_precisions("signsgd") == ["bf16"]
