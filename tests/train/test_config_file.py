"""--config FILE (TOML, JSON, a run's summary.json replayed) and `quietsync --version`."""

from __future__ import annotations

import dataclasses
import json

import pytest

import quietsync
from quietsync.commands.main import main
from quietsync.train.args import parse_train_args
from quietsync.train.metrics import read_jsonl
from quietsync.train.outputs import out_problem

from .conftest import synthetic_text

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _local(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


def _error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse_train_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


def test_toml_sets_every_kind_of_flag_and_the_command_line_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'strategy = "demo"\nmodel = "tiny"\nmax-steps = 5\nlr = 1\nlink = "inter=1gbit,1ms"\n'
        'progress = false\nlog_with = ["csv"]\ndemo_seed = 7\ncompression = 0.25\n'
        '[strategy_config]\nchunk = 32\n'
    )
    cfg, strategy_config, _ = parse_train_args(["--config", str(path), "--nproc", "1", "--max-steps", "9"])
    assert (cfg.strategy, cfg.model, cfg.max_steps, cfg.lr, cfg.link, cfg.progress, cfg.log_with) == (
        "demo", "tiny", 9, 1.0, ["inter=1gbit,1ms"], False, "csv")
    assert (strategy_config.seed, strategy_config.compression, strategy_config.chunk) == (7, 0.25, 32)
    assert cfg.seed == 0  # demo_seed is the strategy's, seed the job's
    cfg, strategy_config, _ = parse_train_args(
        ["--config", str(path), "--nproc", "1", "--link", "intra=10gbit", "--lr",
         "0.5", "--compression", "0.5"])
    assert cfg.link == ["intra=10gbit"] and cfg.lr == 0.5 and strategy_config.compression == 0.5


def test_config_file_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('max-steps = 3\nfoo = 1\nbar-baz = "x"\n')
    assert _error(["--config", str(bad)], capsys) == (
        f"quietsync train: error: --config {bad}: unknown keys foo, bar-baz (not flags of quietsync train "
        "--strategy zero1)")
    bad.write_text("accumulation = 2\n")  # zero1's, not acco's
    assert "unknown key accumulation" in _error(["--config", str(bad), "--strategy", "acco"], capsys)
    bad.write_text('max_steps = "3"\n')
    assert _error(["--config", str(bad)], capsys).endswith("max_steps must be an integer, got '3'")
    bad.write_text("max_steps = 0\n")
    assert _error(["--config", str(bad)], capsys).endswith("--max-steps must be an integer >= 1, got 0")
    bad.write_text("max_steps = [\n")
    assert "not valid TOML" in _error(["--config", str(bad)], capsys)
    bad.write_text("max-steps = 2\nmax_steps = 3\n")  # one would silently win
    assert _error(["--config", str(bad)], capsys).endswith("max-steps and max_steps name the same flag: keep one")
    assert "cannot read" in _error(["--config", str(tmp_path / "missing.toml")], capsys)


def test_a_bare_resume_is_written_true_in_a_config_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("resume = true\n")
    assert parse_train_args(["--config", str(path)])[0].resume == "latest"
    path.write_text("resume = false\n")
    assert parse_train_args(["--config", str(path)])[0].resume is None


def test_a_plain_json_file_works_like_toml(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model": "tiny", "max_steps": 4, "nproc": 1}))
    cfg, _, _ = parse_train_args(["--config", str(path)])
    assert (cfg.model, cfg.max_steps, cfg.nproc) == ("tiny", 4, 1)


def test_replay_from_summary_json_gives_the_same_config_and_loss_curve(tmp_path):
    from quietsync.train.loop import run

    data = tmp_path / "text.txt"
    data.write_text(synthetic_text(3000))
    argv = ["--strategy", "ddp", "--accumulation", "2", "--nproc", "1", "--model", "tiny", "--max-steps", "3",
            "--micro-batch-size", "2", "--seq-len", "32", "--vocab-size", "300", "--dataset", str(data),
            "--cache-dir", str(tmp_path / "cache"), "--eval-every", "0", "--eval-windows", "4",
            "--no-progress", "--no-plot", "--no-export", "--lr", "0.003", "--link", "inter=1gbit,1ms"]
    first_cfg, first_strategy, nodes = parse_train_args([*argv, "--out", str(tmp_path / "a")])
    first = run(first_cfg, first_strategy, nodes)

    summary = tmp_path / "a" / "summary.json"
    cfg, strategy_config, nodes = parse_train_args(
        ["--config", str(summary), "--out", str(tmp_path / "b"), "--overwrite"])
    assert dataclasses.replace(cfg, out=first_cfg.out, overwrite=False) == first_cfg
    assert strategy_config == first_strategy
    again = run(cfg, strategy_config, nodes)

    def curve(out):
        return [(r["step"], r["loss"]) for r in read_jsonl(tmp_path / out / "metrics-rank0.jsonl")]

    assert curve("b") == curve("a") and len(curve("a")) == 3 + 2
    assert again["last_eval_loss"] == first["last_eval_loss"]

    # without --out the replay names the original folder, which it does not overwrite
    cfg, _, _ = parse_train_args(["--config", str(summary)])
    assert cfg.out == first_cfg.out and not cfg.overwrite and out_problem(cfg) is not None


def test_a_run_on_a_prepared_folder_replays_from_its_summary(tmp_path):
    """The summary records every job field, defaults too (vocab_size 4096, eval_fraction 0.02); a prepared folder
    decides those, so a replay must not give them as flags the folder would refuse."""
    from quietsync.data.prepare import PrepareConfig, prepare
    from quietsync.train.config import TrainConfig

    data = tmp_path / "text.txt"
    data.write_text(synthetic_text(3000))
    folder = tmp_path / "prep"
    prepare(PrepareConfig(dataset=str(data), out=str(folder), vocab_size=300, eval_fraction=0.1, progress=False),
            say=lambda _: None)
    ran = TrainConfig(dataset=str(folder), model="tiny", max_steps=2, out=str(tmp_path / "a"))
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"config": dataclasses.asdict(ran), "strategy_config": {}}))
    cfg, _, _ = parse_train_args(["--config", str(summary), "--out", str(tmp_path / "b")])
    assert (cfg.dataset, cfg.max_steps, cfg.model) == (str(folder), 2, "tiny")


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"quietsync {quietsync.__version__}"
