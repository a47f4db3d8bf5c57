"""One training loop: every mode of ``quietsync train`` -- a fixed world, torchrun's elastic world, a torchft
quorum -- runs the same step loop (:func:`quietsync.train.loop.train_steps`) and differs only in its membership
(:mod:`quietsync.train.membership`). So a feature of the loop reaches every mode once: here the evaluation
cadence and the step profiler (``--profile-steps``, which a replica group's loop of its own never had) fire at
the same steps in a plain run and in a torchft run, and their step records share the loop's fields."""

from __future__ import annotations

import ast
import csv
import inspect
import json
from pathlib import Path

import pytest

import quietsync
from quietsync.train.membership import Membership

from ._run import small_job, train_subprocess

TRAIN = Path(quietsync.__file__).parent / "train"


def _functions_feeding_micro_batches(folder: Path = TRAIN) -> set[tuple[str, str]]:
    """``(module file, function)`` of every function in ``train/`` that calls ``<x>.forward_backward(...)``:
    where micro-batches go forward and backward, i.e. where a step loop lives."""
    found = set()
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "forward_backward"):
                    found.add((path.name, fn.name))
    return found


def test_exactly_one_function_in_train_runs_a_step_loop():
    assert _functions_feeding_micro_batches() == {("loop.py", "train_steps")}


def test_the_check_finds_a_second_loop(tmp_path):
    """The structural check is not vacuous: a second module feeding micro-batches is found."""
    fake = tmp_path / "train"
    fake.mkdir()
    for name in ("loop.py", "replica_loop.py"):
        (fake / name).write_text((TRAIN / name).read_text())
    (fake / "replica_loop.py").write_text((fake / "replica_loop.py").read_text() + (
        "\n\ndef _train(strategy, batches):\n    for batch in batches:\n"
        "        strategy.forward_backward(batch, None)\n        strategy.step()\n"))
    assert _functions_feeding_micro_batches(fake) == {("loop.py", "train_steps"), ("replica_loop.py", "_train")}


def test_the_torchft_worker_runs_the_loop_of_loop_py():
    tree = ast.parse((TRAIN / "replica_loop.py").read_text())
    imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "loop"
                for a in node.names}
    assert "train_steps" in imported
    calls = {node.func.id for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert "train_steps" in calls


def _protocol_members() -> set[str]:
    names = set(Membership.__annotations__)
    names |= {n for n, v in vars(Membership).items() if not n.startswith("_") and (callable(v) or
                                                                                   isinstance(v, property))}
    return names


@pytest.mark.parametrize("where,name", [("world", "FixedWorld"), ("world", "ElasticWorld"),
                                        ("replica_loop", "TorchftQuorum")])
def test_every_mode_answers_every_question_of_the_membership(where, name):
    import importlib

    cls = getattr(importlib.import_module(f"quietsync.train.{where}"), name)
    asked = _protocol_members()
    assert {"position", "micro_batches", "commit", "finish", "close", "guard", "rank"} <= asked
    # attributes set in __init__ (rank, speaks, fresh, guard), by the class or a base, or on the class
    init = "".join(inspect.getsource(c) for c in cls.__mro__ if c is not object)
    missing = [n for n in asked if not hasattr(cls, n) and f"self.{n} =" not in init]
    assert not missing, f"{name} does not answer {missing}"


def _run(tmp_path: Path, name: str, *mode: str) -> tuple[list[dict], list[dict], Path]:
    out = tmp_path / name
    flags = small_job(tmp_path, nproc=2)
    flags[flags.index("--eval-every") + 1] = "2"
    proc = train_subprocess(*flags, "--strategy", "ddp", "--max-steps", "5", "--profile-steps", "2:3",
                            "--log-with", "csv", "--timeout-s", "60", "--threads", "1", "--out", str(out), *mode,
                            timeout=200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    lines = [json.loads(x) for x in (out / "metrics-rank0.jsonl").read_text().splitlines()]
    return [r for r in lines if r.get("event") == "eval"], [r for r in lines if "event" not in r], out


@pytest.mark.long
@pytest.mark.timeout(420)
def test_a_loop_feature_fires_alike_in_a_fixed_world_and_under_a_torchft_quorum(tmp_path):
    pytest.importorskip("torchft")
    plain_evals, plain_steps, plain = _run(tmp_path, "plain")
    ft_evals, ft_steps, ft = _run(tmp_path, "torchft", "--fault-tolerance", "torchft")
    # the evaluation: before the first step, every --eval-every steps, and at the end, in both
    assert [e["step"] for e in plain_evals] == [e["step"] for e in ft_evals] == [0, 2, 4, 5]
    assert [r["step"] for r in plain_steps] == [r["step"] for r in ft_steps] == [1, 2, 3, 4, 5]
    # the profiler of --profile-steps: the same trace file in both modes
    for out in (plain, ft):
        trace = json.loads((out / "profile-rank0.json").read_text())
        assert trace.get("traceEvents"), out
    # the --log-with sink: every record of rank 0 as a CSV row, in both
    for out, steps, evals in ((plain, plain_steps, plain_evals), (ft, ft_steps, ft_evals)):
        with open(out / "metrics-rank0.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        assert [int(r["step"]) for r in rows if r.get("eval/loss")] == [e["step"] for e in evals], out
        assert [int(r["step"]) for r in rows if r.get("loss")] == [r["step"] for r in steps], out
    # the loop's own record fields, in both; the torchft quorum adds its own
    loop_fields = set(plain_steps[0])
    assert loop_fields <= set(ft_steps[0])
    assert {"members", "position", "healed", "retries"} <= set(ft_steps[0]) - loop_fields


@pytest.mark.timeout(180)
def test_the_loops_evaluation_tells_the_membership_it_is_busy_after_every_batch(tmp_path, monkeypatch, capsys):
    """Every evaluation the loop runs (before the first step, every ``--eval-every`` steps, at the end) calls the
    membership's ``busy`` once per held-out batch: under torchft that is the stall watch's progress, so a long
    evaluation is not taken for a hang (tests/faults/test_stall.py). One worker, in this process."""
    from quietsync.commands.main import main
    from quietsync.train import world

    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    calls: list[int] = []
    monkeypatch.setattr(world.FixedWorld, "busy", lambda self: calls.append(1))
    flags = small_job(tmp_path, nproc=1)
    flags[flags.index("--eval-windows") + 1] = "6"
    flags[flags.index("--eval-every") + 1] = "2"
    out = tmp_path / "run"
    assert main(["train", *flags, "--strategy", "ddp", "--max-steps", "3",
                 "--threads", "1", "--no-export", "--out", str(out)]) in (0, None)
    evals = [r for r in map(json.loads, (out / "metrics-rank0.jsonl").read_text().splitlines())
             if r.get("event") == "eval"]
    assert [e["step"] for e in evals] == [0, 2, 3]
    assert len(calls) == 3 * len(evals)  # 6 held-out windows in batches of --micro-batch-size 2, at each evaluation
