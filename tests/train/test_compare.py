"""`quietsync compare`: two strategies on the same small job, table and plots."""

from __future__ import annotations

import json

import pytest

from quietsync.cli.spec import parse_strategy_spec
from quietsync.commands.compare import compare_main

from .conftest import synthetic_text


def test_parse_strategy_spec():
    assert parse_strategy_spec("zero1") == ("zero1", "zero1", [])
    assert parse_strategy_spec("ddp:accumulation=2,bucket_cap_mb=1") == (
        "ddp", "ddp-accumulation2-bucket-cap-mb1", ["--accumulation", "2", "--bucket-cap-mb", "1"])
    # a word stands apart from its field in the label (a run's folder), an on/off field reads as its flag
    assert parse_strategy_spec("localsgd:inner_steps=adaptive,sync_every=4")[1] == (
        "localsgd-inner-steps-adaptive-sync-every4")
    assert parse_strategy_spec("demo:sign=false,compression=0.125")[1] == "demo-no-sign-compression0.125"
    assert parse_strategy_spec("localsgd:average_optimizer_state=True")[1] == "localsgd-average-optimizer-state"
    with pytest.raises(ValueError, match="NAME"):
        parse_strategy_spec("ddp:accumulation")
    with pytest.raises(ValueError, match="NAME"):
        parse_strategy_spec("ddp:=2")


def test_a_spec_value_may_hold_commas():
    """A list-valued field (``adapt_tokens``, ``adapt_sync_every``) keeps its commas: an item without ``=`` goes on
    with the value before it."""
    from quietsync.plan.strategies_spec import parse_spec

    spec = ("diloco:sync_every=16,adapt=true,adapt_objective=time_to_target,adapt_tokens=16:2e6,32:3e6,"
            "adapt_sync_every=16,32")
    assert parse_strategy_spec(spec)[2] == [
        "--sync-every", "16", "--adapt", "--adapt-objective", "time_to_target", "--adapt-tokens", "16:2e6,32:3e6",
        "--adapt-sync-every", "16,32"]
    name, values = parse_spec(spec)
    assert name == "diloco" and values["adapt_tokens"] == "16:2e6,32:3e6" and values["adapt_sync_every"] == "16,32"


def test_a_spec_spells_on_off_fields_true_or_false():
    """The planner writes an on/off knob as true/false (demo:sign=false); compare and plan must take it back."""
    from quietsync.plan.candidates import candidate, parse_candidate
    from quietsync.plan.strategies_spec import parse_spec

    assert parse_strategy_spec("demo:sign=false,compression=0.125")[2] == ["--no-sign", "--compression", "0.125"]
    assert parse_strategy_spec("localsgd:average_optimizer_state=True")[2] == ["--average-optimizer-state"]
    assert parse_spec("demo:sign=false") == ("demo", {"sign": False})
    spec = candidate("diloco", {"outer_nesterov": False, "sync_every": 8}).spec
    assert parse_candidate(spec) == candidate("diloco", {"outer_nesterov": False, "sync_every": 8})
    with pytest.raises(ValueError, match="compression"):  # a value field given true/false is still refused
        parse_spec("demo:compression=true")


@pytest.mark.timeout(240)
def test_compare_two_strategies(tmp_path, monkeypatch, capsys):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    data = tmp_path / "text.txt"
    data.write_text(synthetic_text(2000))
    out = tmp_path / "cmp"
    rc = compare_main([
        "--strategies", "zero1", "ddp:accumulation=2", "--out", str(out), "--nproc", "1", "--model", "tiny",
        "--max-steps", "3", "--micro-batch-size", "2", "--seq-len", "32", "--vocab-size", "300",
        "--dataset", str(data), "--cache-dir", str(tmp_path / "cache"), "--eval-windows", "4",
        "--no-progress", "--no-plot", "--no-export", "--target-loss", "100",
    ])
    assert rc == 0
    rows = json.loads((out / "compare.json").read_text())
    # equal steps, unequal tokens: the table gives tokens and micro-batches per step, and says so
    assert [r["tokens"] for r in rows] == [3 * 2 * 32, 3 * 2 * 2 * 32]
    assert [r["micro_batches_per_step"] for r in rows] == [1, 2]
    table = (out / "compare.md").read_text()
    assert "different token budgets (192, 384)" in table
    # a target every run reaches at its first evaluation: time 0 and tokens 0
    assert all(r["time_to_target_s"] == r["eval_curve"][0]["time_s"] and r["tokens_to_target"] == 0 for r in rows)
    assert [e["tokens"] for e in rows[1]["eval_curve"]] == [0, 384]
    assert [r["label"] for r in rows] == ["zero1", "ddp-accumulation2"]
    assert all(r["steps"] == 3 for r in rows)
    # a world of one sends nothing
    assert all(v["sent"] == 0 for r in rows for v in r["step_bytes_by_group"].values())
    ddp_steps = [r for r in (out / "ddp-accumulation2" / "metrics-rank0.jsonl").read_text().splitlines()
                 if '"event"' not in r]
    assert all(json.loads(r)["micro_batches"] == 2 for r in ddp_steps)
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert "| zero1 |" in (out / "compare.md").read_text()


@pytest.mark.timeout(240)
def test_mb_per_1k_tokens_counts_the_bytes_mb_per_step_counts(tmp_path, monkeypatch, capsys):
    """Both columns are the training steps' bytes: the initial parameter broadcast (rank 0's parameters, once) is
    left out of both and named below the table."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    data = tmp_path / "text.txt"
    data.write_text(synthetic_text(2000))
    out = tmp_path / "cmp"
    assert compare_main([
        "--strategies", "zero1", "--out", str(out), "--nproc", "2", "--model", "tiny", "--max-steps", "3",
        "--micro-batch-size", "2", "--seq-len", "32", "--vocab-size", "300", "--dataset", str(data),
        "--cache-dir", str(tmp_path / "cache"), "--eval-windows", "4", "--no-progress", "--no-plot", "--no-export",
    ]) == 0
    [row] = json.loads((out / "compare.json").read_text())
    summary = json.loads((out / "zero1" / "summary.json").read_text())
    per_step = row["bytes_sent_per_step"]
    assert per_step > 0 and row["steps"] == 3
    assert row["mb_sent_per_1k_tokens"] == pytest.approx(per_step * 3 / row["tokens"] * 1000 / 1e6)
    assert row["bytes_sent_outside_steps"] == summary["bytes_sent"] - 3 * per_step == 4 * summary["parameters"]
    broadcast = f"{4 * summary['parameters'] / 1e6:.3g} MB"
    assert f"the initial parameter broadcast — is left out (zero1 {broadcast})" in (out / "compare.md").read_text()


def test_compare_refuses_a_bad_target_loss(tmp_path, capsys):
    with pytest.raises(SystemExit):
        compare_main(["--strategies", "zero1", "--out", str(tmp_path), "--target-loss", "nan"])
    assert "--target-loss must be a finite number > 0, got nan" in capsys.readouterr().err


def test_compare_checks_flags_first(tmp_path, capsys):
    with pytest.raises(SystemExit):
        compare_main(["--strategies", "zero1", "nope", "--out", str(tmp_path)])
    assert "--strategies: 'nope' is not a strategy (choose from" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a knob's typo names the spec it is in, and the command
        compare_main(["--strategies", "zero1", "diloco:sync_evry=2", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert err.startswith("quietsync compare: error: --strategies: 'diloco:sync_evry=2': unrecognized arguments: "
                          "--sync-evry 2"), err
    with pytest.raises(SystemExit):  # a knob of another strategy names its owners, as train does
        compare_main(["--strategies", "ddp:reduce_dtype=bf16", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "'ddp:reduce_dtype=bf16': reduce_dtype is not a knob of strategy ddp (it belongs to " in err, err
    assert "zero1" in err and "unrecognized" not in err, err
    assert not (tmp_path / "zero1").exists()  # nothing ran


def test_cli_and_compare_do_not_import_each_other(monkeypatch):
    """Parsing lives in train/args.py and running a job in train/run_job.py; compare (beside the command's entry,
    above the trainer) needs the entry module not, parses with train's parser, and is what ``quietsync compare``
    runs."""
    import ast
    from pathlib import Path

    import quietsync.commands as commands

    tree = ast.parse((Path(commands.__file__).parent / "compare.py").read_text())
    assert "main" not in {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1}
    from quietsync.commands import compare, main
    from quietsync.train import args

    assert compare.parse_train_args is args.parse_train_args
    monkeypatch.setattr(compare, "compare_main", lambda argv: 40 + len(argv))
    assert main.main(["compare", "--a", "--b"]) == 42


def test_runs_stopped_at_the_target_are_not_said_to_have_had_other_budgets():
    from quietsync.commands.compare import _markdown

    def row(label: str, tokens: int, stopped_by: str) -> dict:
        return {"label": label, "first_eval_loss": 8.3, "last_eval_loss": 7.8, "stopped_by": stopped_by, "steps": 4,
                "wall_s": 1.0, "tokens": tokens, "micro_batches_per_step": 1.0, "tokens_per_s": 100.0,
                "bytes_sent_per_step": 1e6, "mb_sent_per_1k_tokens": 1.0, "compute_s_per_worker": 1.0,
                "idle_s_per_worker": 0.0, "comm_s_per_worker": 0.0, "compute_fraction": 1.0, "target_loss": 7.8,
                "time_to_target_s": 1.0, "tokens_to_target": tokens}

    at_target = _markdown([row("zero1", 4096, "target_loss"), row("demo", 8192, "target_loss")])
    assert "different token budgets" not in at_target
    budgets = _markdown([row("zero1", 4096, "max_tokens"), row("demo", 8192, "max_steps")])
    assert "different token budgets (4,096, 8,192)" in budgets


def test_the_columns_to_the_target_name_it_a_loss_not_a_number_of_seconds():
    from quietsync.commands.compare import _markdown

    row = {"label": "zero1", "first_eval_loss": 8.3, "last_eval_loss": 7.0, "stopped_by": "target_loss", "steps": 4,
           "wall_s": 1.0, "tokens": 4096, "micro_batches_per_step": 1.0, "tokens_per_s": 100.0,
           "bytes_sent_per_step": 1e6, "mb_sent_per_1k_tokens": 1.0, "compute_s_per_worker": 1.0,
           "idle_s_per_worker": 0.0, "comm_s_per_worker": 0.0, "compute_fraction": 1.0, "target_loss": 7.0,
           "time_to_target_s": 1.0, "tokens_to_target": 4096}
    head = _markdown([row]).splitlines()[0]
    assert head.endswith("| s to loss 7 | tokens to loss 7 |"), head


def test_a_config_dict_with_a_misspelt_field_is_a_value_error_naming_it_and_the_fields():
    import torch

    import quietsync

    with pytest.raises(ValueError, match=r"'accumulaton' is not a field of Zero1Config \(did you mean "
                                         r"'accumulation'\?\); its fields: accumulation"):
        quietsync.make_strategy("zero1", torch.nn.Linear(2, 2), config={"accumulaton": 4})
