"""The batch policy and the token-driven learning-rate schedule of a run resumed on another number of workers,
the defaults and refusals of ``--elastic``, and the store each torchrun worker generation gets (unit level;
the end-to-end elastic runs are ``test_elastic.py``)."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from quietsync.strategies import get
from quietsync.train.elastic import Nominal, TokenSchedule, accumulation_field, default_save_every, rescaled
from quietsync.train.schedule import warmup_cosine


@pytest.mark.parametrize("policy,world,accumulation,ratio", [
    ("global", 4, 1, 1.0),      # the run's own world: nothing changes
    ("global", 2, 2, 1.0),      # 4 x 1 micro-batches kept as 2 x 2
    ("global", 3, 2, 6 / 4),    # ceil(4/3) = 2: a step holds 6 of the first 4 micro-batches
    ("global", 8, 1, 8 / 4),    # ceil(1/2) = 1: at least one micro-batch per worker
    ("worker", 2, 1, 2 / 4),    # each worker keeps 1: a step holds half
    ("worker", 6, 1, 6 / 4),
])
def test_the_batch_policy_rescales_each_workers_micro_batches(policy, world, accumulation, ratio):
    config = get("zero1")[1](accumulation=1)
    run, got = rescaled(config, policy, Nominal(4, 1), world)
    assert run.accumulation == accumulation and got == pytest.approx(ratio)
    assert config.accumulation == 1  # the flags' config is not touched


def test_the_batch_policy_finds_each_strategys_micro_batch_knob():
    assert accumulation_field(get("diloco")[1]()) == "accumulation"
    assert accumulation_field(get("acco")[1](deterministic_accumulation=2)) == "deterministic_accumulation"
    assert accumulation_field(get("acco")[1]()) is None  # adaptive: acco decides per stage
    run, ratio = rescaled(get("acco")[1](deterministic_accumulation=2), "global", Nominal(2, 2), 4)
    assert run.deterministic_accumulation == 1 and ratio == 1.0
    run, ratio = rescaled(get("acco")[1](), "global", Nominal(2, 1), 4)
    assert run.deterministic_accumulation is None and ratio == 2.0


def test_the_schedule_follows_tokens_and_is_the_usual_one_when_nothing_changed():
    base = warmup_cosine(5, 100, 0.1)
    same = TokenSchedule(base, 0, 0.0, 1.0)
    assert all(same(s) == base(s) for s in range(120))  # bit for bit
    # resumed at step 40 (position 40) on half the workers with --batch-policy worker: half a step per step
    half = TokenSchedule(base, 40, 40.0, 0.5)
    assert half.position(60) == 50.0 and half(60) == base(50)
    assert half.position(160) == 100.0  # the run ends (--max-steps 100) after the tokens of 100 first steps
    # and a later resume continues from the saved position
    again = TokenSchedule(base, 160, half.position(160), 1.0)
    assert again(170) == base(110)


def test_elastic_checkpoint_cadence():
    assert default_save_every("diloco", get("diloco")[1](sync_every=64)) == 64
    assert default_save_every("diloco", get("diloco")[1](sync_every=64, fragments=4)) == 16
    assert default_save_every("localsgd", get("localsgd")[1](sync_every=8)) == 8
    assert default_save_every("zero1", get("zero1")[1]()) == 10


def _train_line(monkeypatch, capsys, argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    from quietsync.cli import launch as launch_module
    from quietsync.commands.main import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(launch_module, "launch", lambda *a, **k: pytest.fail("a worker was started"))
    capsys.readouterr()
    try:
        rc = main(["train", *argv])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return rc, err[0]


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}


@pytest.mark.parametrize("argv,env,expect", [
    (["--elastic"], {}, "--elastic needs torchrun"),
    (["--elastic", "--overwrite"], TORCHRUN, "--overwrite cannot be combined with --elastic"),
    (["--elastic", "--save-every", "0"], TORCHRUN, "--save-every must be >= 1 with --elastic"),
    (["--elastic", "--strategy", "cdp"], TORCHRUN, "--elastic is not supported with --strategy cdp"),
    (["--elastic"], {**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True"},
     "--elastic needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment"),
    (["--batch-policy", "tokens"], {}, "--batch-policy"),
])
def test_elastic_refusals_are_one_line(monkeypatch, capsys, tmp_path, argv, env, expect):
    rc, line = _train_line(monkeypatch, capsys, [*argv, "--model", "tiny", "--out", str(tmp_path / "o")], env)
    assert rc == 2 and line.startswith("quietsync train: error: ") and expect in line, line


@pytest.mark.parametrize("argv,save_every", [
    (["--strategy", "diloco", "--sync-every", "2"], 2),  # after every outer sync
    (["--strategy", "diloco", "--sync-every", "8", "--fragments", "4"], 2),  # after every fragment's sync
    (["--strategy", "zero1"], 10),
    (["--strategy", "diloco", "--sync-every", "2", "--save-every", "4"], 4),  # a given --save-every is kept
])
def test_an_elastic_run_checkpoints_at_its_strategys_cadence_unless_told(monkeypatch, tmp_path, argv, save_every):
    from quietsync.train.args import parse_train_args

    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    cfg, _, _ = parse_train_args(["--elastic", *argv, "--model", "tiny", "--out", str(tmp_path / "o")])
    assert cfg.save_every == save_every


def test_each_torchrun_generation_gets_a_store_of_its_own():
    """A previous generation's entry in the shared store names a store that is gone (or one that holds another
    nonce): the new workers wait for their own rank 0's."""
    from quietsync.topology import Topology
    from quietsync.transport import worker_group_store

    timeout = datetime.timedelta(seconds=20)
    shared = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timeout, wait_for_workers=False)
    old = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timeout, wait_for_workers=False)
    old.set("quietsync/nonce", "old")  # a live store of another generation on the entry's port ...
    shared.set("quietsync/worker_group_store", f"127.0.0.1|{old.port}|stale")  # ... with another nonce
    got = {}

    def rank1() -> None:
        got["store"] = worker_group_store(shared, Topology(1, 2), 20.0)

    t = threading.Thread(target=rank1)
    t.start()
    import time

    time.sleep(1.5)  # rank 1 reads the stale entry first
    mine = worker_group_store(shared, Topology(0, 2), 20.0)
    t.join(30)
    mine.set("key", "from rank 0")
    assert got["store"].get("key") == b"from rank 0"
    assert got["store"].get("quietsync/nonce") != b"old"
