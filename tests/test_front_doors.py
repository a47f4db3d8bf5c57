"""Every strategy through every front door, each run asserting that steps were committed with a non-zero lr and
that the run ended with the workers holding the same committed model (``Strategy.finish``):

* ``quietsync train --model DIR`` (the CLI's job, two workers) on random-weight GPT-2, GPT-Neo, Llama and Qwen2
  folders — the four families under all strategies in one launch of the workers — and the README's "models in"
  path, a previous run's export, through the real command line;
* a plain loop on the API (``forward_backward``, ``step``, ``finish``);
* 🤗 Accelerate (``accelerate launch`` of ``examples/accelerate_train.py``, all strategies in one launch);
* the HF Trainer (``torchrun`` of ``examples/trainer_train.py``, all strategies in one launch).

Each launch has a timeout: a front door that hangs fails here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import runpy
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import quietsync
from tests.distributed import free_port, run_ranks

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STRATEGIES = quietsync.available()
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

# Local methods sync less often than the runs are long: their committed model comes from finish()'s sync alone.
LOCAL_FLAGS = {"localsgd": ["--sync-every", "4"], "diloco": ["--sync-every", "4"]}


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    from tests.hf_models import build_folders

    return build_folders(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    from tests.train.conftest import synthetic_text

    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text(synthetic_text(1500))
    return path


def _job(folder: Path, strategy: str, text: Path, root: Path) -> list[str]:
    return ["--strategy", strategy, "--model", str(folder), "--max-steps", "2", "--micro-batch-size", "2",
            "--seq-len", "32", "--dataset", str(text), "--cache-dir", str(root / "cache"), "--eval-windows", "2",
            "--eval-every", "0", "--no-progress", "--no-plot", "--out", str(root / f"{folder.name}-{strategy}"),
            *LOCAL_FLAGS.get(strategy, [])]


def _cli_worker(rank: int, world: int, folders: dict[str, str], text: str, root: str) -> dict:
    """What ``quietsync train`` runs on each worker (its flags parsed, then the training loop), for every
    family and strategy in turn."""
    from quietsync.train.args import parse_train_args
    from quietsync.train.loop import run

    os.environ.update(OFFLINE)
    out = {}
    for family, folder in folders.items():
        for strategy in STRATEGIES:
            cfg, scfg, nodes = parse_train_args(_job(Path(folder), strategy, Path(text), Path(root)))
            summary = run(cfg, scfg, nodes)
            out[(family, strategy)] = None if summary is None else {
                "steps": summary["steps"], "last_eval": summary["last_eval_loss"],
                "first_eval": summary["first_eval_loss"]}
    return out


@pytest.mark.long
@pytest.mark.timeout(400)
@pytest.mark.parametrize("families", [("gpt2", "gpt_neo"), ("llama", "qwen2")], ids=lambda f: "+".join(f))
def test_quietsync_train_takes_gpt2_gptneo_llama_and_qwen2_folders_under_every_strategy(families, hf_folders,
                                                                                          text_file, tmp_path):
    """Two families per launch of the workers (the two launches can run side by side in the suite)."""
    from transformers import AutoModelForCausalLM

    from quietsync.train.metrics import read_jsonl

    folders = {family: str(hf_folders[family]) for family in families}
    results = run_ranks(_cli_worker, 2, folders, str(text_file), str(tmp_path), timeout=390)
    for family in folders:
        for strategy in STRATEGIES:
            case = f"{family}/{strategy}"
            summary = results[0][(family, strategy)]
            assert summary["steps"] == 2, case
            out = tmp_path / f"{family}-{strategy}"
            steps = [r for r in read_jsonl(out / "metrics-rank0.jsonl") if "event" not in r]
            assert [r["step"] for r in steps] == [1, 2] and max(r["lr"] for r in steps) > 0, case
            # after finish every worker evaluates the same committed model: the same held-out loss
            last = [[r for r in read_jsonl(out / f"metrics-rank{k}.jsonl") if r.get("event") == "eval"][-1]
                    for k in (0, 1)]
            assert last[0]["step"] == last[1]["step"] == 2 and last[0]["loss"] == last[1]["loss"], case
            assert math.isfinite(summary["last_eval"]) and summary["last_eval"] != summary["first_eval"], case
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / f"{family}-cdp" / "model")
        assert type(exported).__name__ == type(AutoModelForCausalLM.from_pretrained(folders[family])).__name__


@pytest.mark.long
def test_the_readme_models_in_path_a_previous_runs_export_trains_from_the_command_line(hf_folders, text_file,
                                                                                        tmp_path, monkeypatch,
                                                                                        capsys):
    """``quietsync train --model OUT/model`` (here a Llama folder) through the real command line, two local
    workers; a --seq-len beyond the folder's positions is refused in one line before any worker starts."""
    from tests.train._run import refused

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    env.update(OFFLINE, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    flags = [*_job(hf_folders["llama"], "zero1", text_file, tmp_path), "--nproc", "2"]
    proc = subprocess.run([sys.executable, "-m", "quietsync", "train", *flags], capture_output=True,
                          text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "llama-zero1" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["world_size"] == 2
    line = refused(monkeypatch, capsys, "--model", str(hf_folders["gpt2"]), "--seq-len", "65", "--nproc", "1",
                   "--dataset", str(text_file))
    assert line == f"quietsync train: error: --seq-len must be <= 64 for --model {hf_folders['gpt2']}, got 65"


# ---------------------------------------------------------------------------------------------- the plain API loop
def _api_worker(rank: int, world: int) -> dict:
    from tests.strategies.helpers.common import flat_params, loss_fn, micro_batch, param_groups, tiny_model

    out = {}
    for name in STRATEGIES:
        model = tiny_model()
        s = quietsync.make_strategy(name, model, torch.optim.AdamW, param_groups=param_groups(model), lr=1e-2,
                                    lr_schedule=lambda step: min(1.0, step / 2))  # warm-up from 0
        start = flat_params(model)
        lrs, index = [], 0
        while s.steps + s.steps_in_flight < 4:  # counting an update finish() will commit
            s.forward_backward(micro_batch(0, rank, index), loss_fn)
            index += 1
            if s.step():
                lrs.append(s.last_step_metrics().lr)
        if s.finish():
            lrs.append(s.last_step_metrics().lr)
        with s.committed_params() as m:
            committed = flat_params(m)
        out[name] = {"steps": s.steps, "lrs": lrs, "model": flat_params(s.module), "committed": committed,
                     "moved": float((committed - start).abs().max())}
        s.close()
    return out


@pytest.mark.timeout(240)
def test_a_plain_loop_on_the_api_commits_and_ends_level_with_every_strategy():
    results = run_ranks(_api_worker, 2, timeout=230)
    for name in STRATEGIES:
        a, b = results[0][name], results[1][name]
        assert a["steps"] == b["steps"] == 4 and len(a["lrs"]) == 4 and max(a["lrs"]) > 0, name
        assert torch.equal(a["model"], b["model"]) and torch.equal(a["model"], a["committed"]), name
        assert a["moved"] > 0, name


# ---------------------------------------------------------------------------------------------- the launchers
def _launch(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a launcher to its end. One that outlives ``timeout`` fails the test with the stacks of every thread of
    its processes (faulthandler prints them on SIGABRT): a hang names where each worker waited."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
           "CUDA_VISIBLE_DEVICES": ""}  # gloo workers on CPU, also on a GPU machine (its launcher would pick NCCL)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, preexec_fn=_no_core_files) as launched:
        try:
            out, err = launched.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            out, err = _abort(launched)
            pytest.fail(f"{Path(cmd[0]).name} did not end within {timeout:g} s; its output, then every "
                        f"process's stacks:\n{out[-3000:]}\n{err[-20000:]}")
    proc = subprocess.CompletedProcess(cmd, launched.returncode, out, err)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _no_core_files() -> None:
    """``preexec_fn``: an aborted process of the launch writes no core file (inherited by its children)."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _abort(launched: subprocess.Popen) -> tuple[str, str]:
    """The launcher stopped (SIGSTOP: it would end the other workers when the first dies), then SIGABRT to each
    worker in turn (each prints its threads' stacks) and SIGKILL to the launch's session; what they printed."""
    from tests.elastic_agents import descendants

    try:
        os.kill(launched.pid, signal.SIGSTOP)
    except OSError:  # it ended meanwhile
        return launched.communicate()
    for pid in descendants(launched.pid):
        try:
            os.kill(pid, signal.SIGABRT)
        except OSError:
            pass
        time.sleep(0.5)  # one process at a time: their stacks go to one pipe and would interleave
    try:
        os.killpg(launched.pid, signal.SIGKILL)
    except OSError:  # the session is gone already
        pass
    return launched.communicate()


def _records(out: Path) -> dict[str, list[dict]]:
    by_strategy: dict[str, list[dict]] = {}
    for line in out.read_text().splitlines():
        r = json.loads(line)
        by_strategy.setdefault(r["strategy"], []).append(r)
    return {k: sorted(v, key=lambda r: r["rank"]) for k, v in by_strategy.items()}


def accelerate_launch(out: Path, *flags: str, timeout: float = 280) -> dict[str, list[dict]]:
    """``examples/accelerate_train.py FLAGS`` under ``accelerate launch --multi_gpu --num_processes 2``."""
    pytest.importorskip("accelerate")
    _launch([str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
             "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
             str(ROOT / "examples" / "accelerate_train.py"), "--out", str(out), *flags], timeout)
    return _records(out)


def torchrun_trainer(out: Path, *flags: str, timeout: float = 280) -> dict[str, list[dict]]:
    """``examples/trainer_train.py FLAGS`` under ``torchrun --nproc_per_node 2``."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    _launch([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
             str(ROOT / "examples" / "trainer_train.py"), "--out", str(out), *flags], timeout)
    return _records(out)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_strategy_under_accelerate_launch(tmp_path):
    """cdp through ``accelerator.forward_backward``, the others through ``accelerator.backward``; the loop stops
    on ``steps + steps_in_flight`` and ``optimizer.finish()`` ends it (acco/dpu/wp commit their update in flight)."""
    records = accelerate_launch(tmp_path / "out.jsonl", "--strategy", "all", "--steps", "3")
    assert sorted(records) == sorted(STRATEGIES)
    for name, (r0, r1) in records.items():
        assert r0["world"] == 2 and r0["checksum"] == r1["checksum"], name  # replicas identical after finish
        assert r0["steps"] == r1["steps"] == 3 and max(r0["lrs"]) > 0 and r0["moved"] > 0, name
        assert r0["final_loss"] is not None and math.isfinite(r0["final_loss"]), name


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_strategy_under_the_trainer_saves_and_evaluates_during_training(tmp_path):
    """``QuietTrainer`` hands ``compute_loss`` to the strategy's ``forward_backward`` (cdp included); the Trainer's
    ``max_steps`` counts its own steps, on some of which acco/dpu/wp/cdp commit; the end finishes the strategy.
    Checkpoints every 3 Trainer steps and evaluations every 2: acco/dpu/wp workers, which may be a stage apart,
    are brought level first (without it each waited on a job the other had not submitted: a hang); cdp saves the
    model alone; an evaluation on two CPU processes leaves the parameters in the strategy's buffers (Accelerate
    would move the model to "cpu:0", a copy). The replicas end identical and every checkpoint is written."""
    # no warm-up: the Trainer's scheduler counts committed steps and its warm-up starts at lr 0, so a strategy that
    # commits only once in 8 Trainer steps (adaptive acco on a loaded machine) would run that step at lr 0
    # stages capped at 2 micro-batches: adaptive acco on a loaded machine once made no commit in 6 Trainer steps
    records = torchrun_trainer(tmp_path / "out.jsonl", "--strategy", "all", "--steps", "8", "--warmup-steps", "0",
                               "--stage-cap", "2", "--save-every", "3", "--eval-every", "2")
    assert sorted(records) == sorted(STRATEGIES)
    for name, (r0, r1) in records.items():
        assert r0["world"] == 2 and r0["checksum"] == r1["checksum"] and r0["finished"], name
        assert r0["global_step"] == 8 and 1 <= r0["steps"] <= 8 and max(r0["lrs"]) > 0 and r0["moved"] > 0, name
        assert r0["finite"] and math.isfinite(r0["train_loss"]), name
        assert r0["evals"] == r1["evals"] == 4 and r0["checkpoints"] == 3, name  # steps 3, 6 and the last
        if _accumulates(name):
            assert r0["steps"] == 8, name  # one commit per Trainer step


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_trainer_run_resumed_from_its_checkpoint_ends_where_the_uninterrupted_run_ends(tmp_path):
    """Every rank saves its own strategy state into the Trainer's checkpoint and loads it back on resume: from the
    checkpoint at step 4 of 8 the run ends bit for bit where the uninterrupted one did -- a shard (zero1), an outer
    optimizer mid-round (diloco), a decoupled momentum (demo). acco resumes and ends with identical replicas (its
    stages follow the clock, so not the same trajectory)."""
    flags = ("--strategy", "zero1,diloco,demo,acco", "--steps", "8", "--save-every", "4", "--save-optimizer",
             "--stage-cap", "2")
    whole = torchrun_trainer(tmp_path / "whole.jsonl", *flags, "--output-dir", str(tmp_path / "run"))
    shutil.copytree(tmp_path / "run", tmp_path / "resumed")
    for late in (tmp_path / "resumed").glob("*/checkpoint-8"):  # as if interrupted after the checkpoint at step 4
        shutil.rmtree(late)
    resumed = torchrun_trainer(tmp_path / "resumed.jsonl", *flags, "--output-dir", str(tmp_path / "resumed"),
                               "--resume")
    for name in ("zero1", "diloco", "demo"):
        (w0, _), (r0, r1) = whole[name], resumed[name]
        assert r0["checksum"] == r1["checksum"] == w0["checksum"] and r0["steps"] == w0["steps"] == 8, name
    r0, r1 = resumed["acco"]
    assert r0["checksum"] == r1["checksum"] and r0["finished"] and r0["global_step"] == 8


@pytest.mark.timeout(120)
def test_the_trainer_example_refuses_a_stage_cap_no_strategy_takes(monkeypatch, capsys):
    """``--stage-cap`` caps acco/dpu/wp stages; named with strategies that have none it is refused, not ignored
    (in this process: the refusal comes from the example's parser, before anything trains)."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(sys, "argv", ["trainer_train.py", "--strategy", "zero1,ddp", "--stage-cap", "2"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "examples" / "trainer_train.py"), run_name="__main__")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--stage-cap applies to acco, dpu and wp" in err, err[-2000:]


def _accumulates(name: str) -> bool:
    """Whether the strategy commits every ``accumulation`` micro-batches (the others decide their commits)."""
    return "accumulation" in {f.name for f in dataclasses.fields(quietsync.strategies.get(name)[1])}
