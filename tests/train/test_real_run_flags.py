"""`quietsync train --precision --max-grad-norm --activation-checkpointing --compile`: bad values are one line,
exit 2, nothing started; a small run with all of them trains, and logs the pre-clip gradient norm."""

from __future__ import annotations

import json

import pytest

from quietsync.train.args import parse_train_args
from quietsync.train.metrics import read_jsonl

from ._run import refused, small_job, train


def test_an_unknown_precision_is_one_line_naming_the_choices(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as e:
        parse_train_args(["--precision", "fp8"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "--precision: invalid choice: 'fp8' (choose from 'fp32', 'bf16', 'fp16')" in err


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-grad-norm", "-1"], "--max-grad-norm must be a finite number > 0, or 0 for no clipping, got -1.0"),
    (["--max-grad-norm", "nan"], "--max-grad-norm must be a finite number > 0, or 0 for no clipping, got nan"),
    (["--strategy", "cdp", "--precision", "fp16"],
     "--precision fp16 is not supported by strategy cdp: each stage is updated at its own time step"),
])
def test_bad_values_are_one_line_and_start_nothing(flags, message, monkeypatch, capsys):
    assert message in refused(monkeypatch, capsys, *flags)


def test_the_flags_reach_the_job_config(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg, _, _ = parse_train_args(["--precision", "bf16", "--max-grad-norm", "1.5", "--activation-checkpointing",
                                  "--compile"])
    assert (cfg.precision, cfg.clip_norm, cfg.activation_checkpointing, cfg.compile) == ("bf16", 1.5, True, True)
    cfg, _, _ = parse_train_args(["--max-grad-norm", "0"])
    assert cfg.clip_norm is None and cfg.precision == "fp32"  # 0: no clipping (the Trainer's convention)


def test_a_config_file_takes_them_too(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tmp_path / "job.toml"
    path.write_text('precision = "fp16"\nmax_grad_norm = 0.5\nactivation_checkpointing = true\n')
    cfg, _, _ = parse_train_args(["--config", str(path)])
    assert (cfg.precision, cfg.clip_norm, cfg.activation_checkpointing) == ("fp16", 0.5, True)


@pytest.mark.timeout(240)
def test_a_bf16_clipped_checkpointed_run_trains_and_logs_the_norm(tmp_path):
    out = tmp_path / "run"
    proc = train(*small_job(tmp_path), "--strategy", "zero1", "--max-steps", "3", "--out", str(out),
                 "--precision", "bf16", "--max-grad-norm", "0.5", "--activation-checkpointing", "--no-export")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        steps = [r for r in read_jsonl(out / f"metrics-rank{rank}.jsonl") if "event" not in r]
        assert [r["step"] for r in steps] == [1, 2, 3]
        assert all(r["extra"]["grad_norm"] > 0 and "clipped" in r["extra"] for r in steps)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["precision"] == "bf16" and summary["config"]["max_grad_norm"] == 0.5
    assert summary["last_eval_loss"] < summary["first_eval_loss"]


@pytest.mark.parametrize(("cxx", "said"), [("/nonexistent/g++", "the compiler '/nonexistent/g++' was not found"),
                                           ("false", "failed on a one-line program (exit 1)")])
def test_compile_without_a_working_compiler_is_refused_before_workers_start(cxx, said, monkeypatch, capsys):
    """No C++ compiler (or a broken one): one line naming --compile and the compiler, exit 2, nothing started."""
    monkeypatch.setenv("CXX", cxx)
    line = refused(monkeypatch, capsys, "--compile")
    assert line.startswith("quietsync train: error: --compile needs a working C++ compiler on CPU"), line
    assert said in line, line
