"""Flags generated from config dataclasses, and one-line errors naming the flag."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Literal

import pytest

from quietsync.cli.flags import (
    FlagError,
    add_dataclass_flags,
    build_config,
    field_docs,
    flag_message,
    given_values,
)
from quietsync.strategies import available, get
from quietsync.train.args import parse_train_args
from quietsync.train.config import DEFAULT_STRATEGY, TrainConfig

pytestmark = pytest.mark.timeout(60)


@dataclass
class Base:
    alpha_beta: int = 3
    """How many alphas per beta.

    A second paragraph that the help leaves out."""


@dataclass
class Knobs(Base):
    use_thing: bool = True
    """Use the thing."""
    mode: Literal["fast", "slow"] = "fast"
    """Which mode."""
    rate: float | None = None
    """A rate; default: derived."""
    names: list[str] = field(default_factory=list)
    """Repeatable name."""
    undocumented: str = "x"

    def __post_init__(self) -> None:
        if self.alpha_beta < 1:
            raise ValueError(f"alpha_beta must be >= 1, got {self.alpha_beta}")


def _parse(argv):
    p = argparse.ArgumentParser()
    names = add_dataclass_flags(p, Knobs)
    return p, names, p.parse_args(argv)


def test_field_docs_reads_attribute_docstrings_through_bases():
    docs = field_docs(Knobs)
    assert docs["alpha_beta"] == "How many alphas per beta."
    assert docs["use_thing"] == "Use the thing." and "undocumented" not in docs


def test_generated_flags():
    p, names, args = _parse(["--alpha-beta", "5", "--no-use-thing", "--mode", "slow", "--names", "a",
                             "--names", "b"])
    assert list(names) == ["alpha_beta", "use_thing", "mode", "rate", "names", "undocumented"]
    assert names["use_thing"] == "--use-thing"
    assert given_values(args, names) == {"alpha_beta": 5, "use_thing": False, "mode": "slow",
                                         "names": ["a", "b"]}
    assert build_config(Knobs, given_values(args, names)).names == ["a", "b"]
    help_text = p.format_help()
    assert "How many alphas per beta (default: 3)" in " ".join(help_text.split())
    assert "second paragraph" not in help_text
    assert "--use-thing, --no-use-thing" in help_text
    assert "derived" in help_text and "(default: none)" not in " ".join(help_text.split()).split("derived")[1][:20]
    _, _, defaults = _parse([])
    assert given_values(defaults, names) == {}  # nothing given: the dataclass keeps its defaults


def test_bad_choice_is_an_argparse_error():
    with pytest.raises(SystemExit):
        _parse(["--mode", "medium"])


def test_build_config_names_the_flag():
    with pytest.raises(FlagError) as e:
        build_config(Knobs, {"alpha_beta": 0})
    assert str(e.value) == "--alpha-beta must be >= 1, got 0" and e.value.flag == "--alpha-beta"
    assert flag_message("--link must look like x", ["link"]) == ("--link", "--link must look like x")
    assert flag_message("something else failed", ["link"]) == (None, "something else failed")


def test_a_message_names_the_flags_a_user_types():
    fields = ["target_loss", "pilot_tokens", "what_if", "budget_s"]
    assert flag_message("target_loss needs pilot_tokens N in a measured plan, or what_if", fields) == (
        "--target-loss", "--target-loss needs --pilot-tokens N in a measured plan, or --what-if")
    assert flag_message("budget_s must be > 0 or None, got -1", fields)[1] == \
        "--budget-s must be > 0 (or leave the flag out), got -1"
    # a spec's key, a path and a word that is no field stay as they are; outside the CLI "or None" stays
    assert flag_message("--strategies diloco:pilot_tokens=0 in /runs/what_if/x: no_such thing", fields)[1] == \
        "--strategies diloco:pilot_tokens=0 in /runs/what_if/x: no_such thing"
    assert flag_message("n must be >= 0 or None, got -1", fields) == (None, "n must be >= 0 or None, got -1")
    # a field set as the API sets it becomes the flag as typed: a bool's flag pair, a value after its flag
    assert flag_message("use one of them (what_if=False or target_loss=True or budget_s='2.5')", fields)[1] == \
        "use one of them (--no-what-if or --target-loss or --budget-s 2.5)"


def test_train_config_defaults_are_the_embedded_job():
    cfg = TrainConfig()
    assert cfg.strategy == DEFAULT_STRATEGY == "zero1" and cfg.dataset == "kjv" and cfg.nproc == 2
    assert cfg.warmup == cfg.max_steps // 20


def test_parse_train_args_builds_both_configs():
    cfg, scfg, nodes = parse_train_args([
        "--max-steps", "7", "--accumulation", "3", "--link", "inter=100mbit,5ms", "--link", "intra=10gbit",
        "--slow-worker", "1:2", "--nproc", "2", "--seed", "5", "--no-progress",
    ])
    assert cfg.max_steps == 7 and cfg.seed == 5 and cfg.progress is False
    assert cfg.link == ["inter=100mbit,5ms", "intra=10gbit"] and cfg.slow().factor == 2.0
    assert type(scfg) is get(DEFAULT_STRATEGY)[1] and scfg.accumulation == 3
    assert nodes == 2  # local workers: one node each


def test_nodes_default_and_override(monkeypatch):
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert parse_train_args(["--nproc", "4"])[2] == 4  # local workers: one node each
    assert parse_train_args(["--nproc", "4", "--nodes", "2"])[2] == 2
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert parse_train_args([])[2] is None  # under torchrun: WORLD_SIZE / LOCAL_WORLD_SIZE


def test_every_registered_strategy_gets_its_flags():
    for name in available():
        cfg, scfg, _ = parse_train_args(["--strategy", name, "--max-steps", "1"])
        assert cfg.strategy == name and type(scfg) is get(name)[1]


@pytest.mark.parametrize("argv,expect", [
    (["--max-steps", "0"], "--max-steps must be an integer >= 1, got 0"),
    (["--max-steps", "ten"], "--max-steps: invalid int value: 'ten'"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--accumulation", "0"], "--accumulation must be an integer >= 1"),
    (["--link", "inter=fast"], "--link bandwidth must be a number with a unit"),
    (["--link", "wan=1gbit"], "--link must look like 'inter=100mbit,5ms'"),
    (["--slow-worker", "1"], "--slow-worker must look like RANK:FACTOR"),
    (["--slow-worker", "5:2"], "--slow-worker RANK must be < the 2 workers, got 5"),
    (["--strategy", "nope"], "--strategy must be one of"),
    (["--model", "huge"], "--model must be one of tiny, default, 10m, a Hugging Face model folder or a hub name "
                          "(the hub is offline here), got 'huge'"),
    (["--seq-len", "4096"], "--seq-len must be <= 256 for --model default"),
    (["--nproc", "4", "--nodes", "3"], "--nodes must be a positive divisor of the 4 workers, got 3"),
    (["--nodes", "0"], "--nodes must be an integer >= 1 (or leave the flag out), got 0"),
    (["--vocab-size", "100"], "--vocab-size must be an integer >= 257, got 100"),
    (["--eval-fraction", "0.5"], "--eval-fraction must be in (0, 0.5), got 0.5"),
    (["--timeout-s", "nan"], "--timeout-s must be > 0, got nan"),
    (["--lr", "inf"], "--lr must be > 0, got inf"),
    (["--weight-decay", "nan"], "--weight-decay must be >= 0, got nan"),
    (["--on-nonfinite", "ignore"], "--on-nonfinite: invalid choice: 'ignore'"),
    (["--strategy", "acco", "--on-nonfinite", "skip"], "--on-nonfinite skip is not supported by strategy acco"),
    (["--slow-worker", "1:0.5"], "--slow-worker factor must be >= 1, got 0.5"),
    (["--dataset", "./no/such/file.txt"], "--dataset: no such file or folder"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--strategy", "cdp", "--save-every", "5"], "--save-every is not supported with --strategy cdp"),
    (["--strategy", "diloco", "--pseudo-grad-dtype", "int3"], "--pseudo-grad-dtype: invalid choice: 'int3'"),
    (["--strategy", "diloco", "--outer", "sparseloco", "--topk-density", "0"], "--topk-density must be in (0, 1]"),
    (["--strategy", "diloco", "--outer", "sparseloco", "--pseudo-grad-dtype", "int8"],
     "--pseudo-grad-dtype must be one of fp32, bf16, fp4, fp4_e3m0, int4, int2 with outer sparseloco"),
])
def test_bad_values_are_one_line_errors(argv, expect, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as e:
        parse_train_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("quietsync train: error: ")
    assert expect in err, err


def test_flag_of_another_strategy_is_named(capsys):
    """For every ordered pair of registered strategies (a, b) where b has a field a lacks, ``--strategy a`` with b's
    flag is refused in one line naming the flag, a, and b among the owners. Fields named like a job flag are
    ``--<strategy>-<field>`` (see test_strategy_fields_named_like_job_flags_are_prefixed)."""
    import dataclasses

    names = available()
    job = {f.name for f in dataclasses.fields(TrainConfig)}
    own = {n: {f.name for f in dataclasses.fields(get(n)[1]) if f.init and not f.name.startswith("_")} for n in names}
    checked = 0
    for name in names:
        for other in names:
            extra = sorted(own[other] - own[name])
            if not extra:
                continue
            field = extra[0]
            flag = "--" + (f"{other}_{field}" if field in job else field).replace("_", "-")
            with pytest.raises(SystemExit) as e:
                parse_train_args(["--strategy", name, flag, "1"])
            err = capsys.readouterr().err
            assert e.value.code == 2 and err.count("\n") == 1, (name, other, err)
            assert f"{flag} is not a flag of strategy {name} (it belongs to " in err, (name, other, err)
            owners = err.split("(it belongs to ", 1)[1].rsplit(")", 1)[0].split(", ")
            assert other in owners and name not in owners, (name, other, err)
            checked += 1
    # 11 strategies: all but a few of the 110 ordered pairs differ (fsdp's knobs are a subset of most others')
    assert checked >= len(names) * (len(names) - 1) // 2, checked


def test_colliding_field_gets_a_prefixed_flag():
    p = argparse.ArgumentParser()
    flags = add_dataclass_flags(p, Knobs, prefix_for={"mode"}, prefix="knobs_")
    assert flags["mode"] == "--knobs-mode" and flags["alpha_beta"] == "--alpha-beta"
    args = p.parse_args(["--knobs-mode", "slow"])
    assert given_values(args, flags) == {"mode": "slow"}
    with pytest.raises(FlagError, match="^--knobs-alpha must"):
        build_config(Knobs, {"alpha_beta": 0}, flags={"alpha_beta": "--knobs-alpha"})


def test_strategy_fields_named_like_job_flags_are_prefixed():
    import dataclasses

    job = {f.name for f in dataclasses.fields(TrainConfig)}
    found = False
    for name in available():
        for f in dataclasses.fields(get(name)[1]):
            if f.name in job and f.type in (int, "int"):
                found = True
                flag = f"--{name}-{f.name}".replace("_", "-")
                cfg, scfg, _ = parse_train_args(["--strategy", name, flag, "7", f"--{f.name}".replace("_", "-"), "5"])
                assert getattr(scfg, f.name) == 7 and getattr(cfg, f.name) == 5
    if not found:
        pytest.skip("no registered strategy has an int field named like a job flag")


@pytest.mark.parametrize("field, value, message", [
    ("max_steps", True, "max_steps must be an integer >= 1, got True"),
    ("eval_every", -1, "eval_every must be an integer >= 0, got -1"),
    ("seq_len", 1, "seq_len must be an integer >= 2, got 1"),
    ("warmup_steps", 2.5, "warmup_steps must be an integer >= 0 or None, got 2.5"),
    ("warmup_steps", 301, "warmup_steps must be <= max_steps (300), got 301: the learning rate would never reach "
                          "its peak"),
    ("seed", "0", "seed must be an integer in [0, 4294967295], got '0'"),
    ("seed", 2**64, "seed must be an integer in [0, 4294967295], got 18446744073709551616"),
    ("lr", float("inf"), "lr must be > 0, got inf"),
    ("min_lr_ratio", 1.5, "min_lr_ratio must be in [0, 1], got 1.5"),
    ("weight_decay", None, "weight_decay must be >= 0, got None"),
    ("model", "huge", "model must be one of tiny, default, 10m, a Hugging Face model folder or a hub name (the hub "
                      "is offline here), got 'huge'"),
])
def test_train_config_checks_its_fields(field, value, message, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as e:
        TrainConfig(**{field: value})
    assert str(e.value) == message


def _float_fields(cls: type) -> list[str]:
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls) if "float" in str(hints[f.name])]


FLOAT_FIELDS = {
    None: {"max_time_s", "target_loss", "lr", "weight_decay", "min_lr_ratio", "eval_fraction", "timeout_s",
           "max_grad_norm"},
    "ddp": {"bucket_cap_mb"},
    "demo": {"compression", "beta", "adapt_overhead", "adapt_threshold"},
    "flexdemo": {"compression", "beta"},
    "diloco": {"outer_lr", "outer_momentum", "mixing", "compression", "error_decay", "topk_density", "worker_speeds",
               "adapt_overhead", "adapt_threshold"},
    "localsgd": {"worker_speeds"},
    "acco": {"straggler_factor", "adapt_overhead", "adapt_threshold"},
    "dpu": {"adapt_overhead", "adapt_threshold"},
    "wp": {"adapt_overhead", "adapt_threshold"},
}
"""Every float field of the job's config (None) and of each strategy's config that has one: the float flags the
next test sends NaN and infinities to."""


def test_the_float_fields_are_the_ones_checked():
    """A new float field (or a strategy gaining its first) shows up here, so it cannot escape the NaN test."""
    found = {s: set(_float_fields(TrainConfig if s is None else get(s)[1])) for s in [None, *available()]}
    assert {s: f for s, f in found.items() if f} == FLOAT_FIELDS


@pytest.mark.parametrize("strategy", list(FLOAT_FIELDS), ids=lambda s: s or "job")
def test_every_float_flag_refuses_nan_and_infinities(strategy, capsys, monkeypatch):
    """A NaN or infinite value of any float flag (the job's and every strategy's) is one line naming the flag,
    exit 2, before any worker starts: e.g. ``--lr inf`` or ``--weight-decay nan``."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fields = _float_fields(TrainConfig if strategy is None else get(strategy)[1])
    assert set(fields) == FLOAT_FIELDS[strategy]
    chosen = [] if strategy is None else ["--strategy", strategy]
    for name in fields:
        flag = "--" + name.replace("_", "-")
        for value in ("nan", "inf", "-inf"):
            with pytest.raises(SystemExit) as e:
                parse_train_args([*chosen, f"{flag}={value}"])
            err = capsys.readouterr().err
            assert e.value.code == 2 and err.count("\n") == 1, err
            assert f"{flag} must be " in err and f"got {value}" in err, err


@pytest.mark.parametrize("argv,expect", [
    (["--link", "inter=100mbit@0s,10mbit@60s,100mbit@30s"],
     "--link inter: schedule goes back in time: '100mbit@30s' is not after 60s; schedule: BW[,LAT]@TIME entries"),
    (["--link", "inter=100mbit@0s,0mbit@60s"], "--link inter: bandwidth must be > 0, got '0mbit'"),
    (["--link", "inter=100mbit@0s,10mbit"], "--link inter: schedule must be BW[,LAT]@TIME entries, the first @0s"),
    (["--link", "inter=100mbit@0s,10mbit@60s", "--fault-tolerance", "torchft"],
     "--link with a schedule (BW@TIME,...) cannot be combined with --fault-tolerance torchft"),
])
def test_bad_link_schedules_are_one_line_errors(argv, expect, capsys):
    with pytest.raises(SystemExit) as e:
        parse_train_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("quietsync train: error: ")
    assert expect in err, err


def test_a_link_schedule_is_a_link():
    cfg, _, _ = parse_train_args(["--link", "inter=100mbit,5ms@0s,10mbit@60s"])
    assert cfg.link == ["inter=100mbit,5ms@0s,10mbit@60s"]


@pytest.mark.parametrize("argv,expect", [
    (["--strategy", "zero1", "--adapt"],
     "--adapt is not a flag of strategy zero1 (it belongs to acco, demo, diloco, dpu, wp)"),
    (["--strategy", "flexdemo", "--adapt"],
     "--adapt is not a flag of strategy flexdemo (it belongs to acco, demo, diloco, dpu, wp)"),
    (["--strategy", "demo", "--adapt"], "--topk must be given when adapt is on (--adapt"),
    (["--strategy", "demo", "--adapt", "--topk", "8", "--replicator", "random"],
     "--replicator must be dct when adapt is on (--adapt"),
    (["--strategy", "demo", "--adapt", "--topk", "8", "--adapt-topk", "4,8"],
     "--adapt-topk must be whole numbers from 1 to chunk**2 (4096), each once, largest first"),
    (["--strategy", "demo", "--adapt", "--topk", "8", "--adapt-knobs", "H"], "--adapt-knobs must be topk"),
    (["--strategy", "demo", "--adapt", "--topk", "8", "--fault-tolerance", "torchft"],
     "--adapt cannot be combined with --fault-tolerance torchft"),
    (["--strategy", "demo", "--adapt-topk", "8,4"], "--adapt-topk needs --adapt"),
    (["--strategy", "diloco", "--adapt", "--sync-every", "8", "--fragments", "2"],
     "adapt changes its knobs only with fragments 1"),
    (["--strategy", "diloco", "--adapt", "--adapt-sync-every", "8,12"], "--adapt-sync-every must be whole numbers"),
    (["--strategy", "diloco", "--adapt", "--fault-tolerance", "torchft"],
     "--adapt cannot be combined with --fault-tolerance torchft"),
    (["--strategy", "diloco", "--adapt", "--adapt-knobs", "H,k"],
     "--adapt-knobs must be a comma-separated list of H, bits"),
    (["--strategy", "diloco", "--adapt", "--adapt-knobs", "tau"],
     "--adapt-knobs must be H and/or bits: tau and fragments"),
    (["--strategy", "diloco", "--adapt", "--adapt-knobs", "bits", "--outer", "sparseloco"],
     "--adapt-knobs bits needs outer sgd"),
    (["--strategy", "diloco", "--adapt-knobs", "bits"], "--adapt-knobs needs --adapt"),
    (["--strategy", "diloco", "--adapt-every", "3"], "--adapt-every needs --adapt"),
    (["--strategy", "diloco", "--adapt", "--adapt-objective", "time_to_target"],
     "--adapt-tokens must give the tokens to the target of every candidate"),
    (["--strategy", "diloco", "--adapt", "--adapt-objective", "time_to_target", "--adapt-tokens", "16:x"],
     "--adapt-tokens must be KNOB:TOKENS"),
    (["--strategy", "diloco", "--adapt", "--adapt-objective", "fast"], "--adapt-objective must be one of overhead"),
    (["--strategy", "diloco", "--adapt-objective", "time_to_target"], "--adapt-objective needs --adapt"),
])
def test_adapt_is_refused_where_it_cannot_work(argv, expect, capsys):
    with pytest.raises(SystemExit) as e:
        parse_train_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("quietsync train: error: ")
    assert expect in err, err


def test_a_warm_up_longer_than_the_run_is_refused_naming_both_flags(monkeypatch, capsys):
    from tests.train._run import refused

    line = refused(monkeypatch, capsys, "--max-steps", "4", "--warmup-steps", "10")
    assert line == ("quietsync train: error: --warmup-steps must be <= --max-steps (4), got 10: the learning rate "
                    "would never reach its peak")
    # as long as the run is fine: the peak is reached at its last step
    cfg, _, _ = parse_train_args(["--max-steps", "4", "--warmup-steps", "4"])
    assert cfg.warmup == 4
