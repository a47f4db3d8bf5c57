"""The run's end says whether every worker holds the same committed parameters, bit for bit
(``quietsync.train.replicas``): a fingerprint that any one changed bit changes, compared in the end-of-run agreement."""

from __future__ import annotations

import json

import pytest
import torch

import quietsync
from quietsync.train.nonfinite import NonFiniteGuard
from quietsync.train.replicas import fingerprint_row, slots, verdict, verdict_of_slots, warning
from tests.distributed import run_ranks


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(dtype)


def _flip_one_bit(model: torch.nn.Module, which: int, bit: int) -> None:
    p = list(model.parameters())[which]
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[p.element_size()]
    with torch.no_grad():
        p.view(ints).view(-1)[-1] ^= (1 << bit) if bit < 8 * p.element_size() - 1 else -(1 << bit)  # the sign bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_one_flipped_bit_anywhere_changes_the_fingerprint(dtype):
    a = _model(dtype)
    mark = fingerprint_row(a)
    assert fingerprint_row(_model(dtype)) == mark  # the same bits: the same numbers
    width = 8 * torch.empty((), dtype=dtype).element_size()
    for which in range(len(list(a.parameters()))):
        for bit in range(width):  # the sign and exponent bits of fp64 too (a sum modulo 2**52 would miss them)
            b = _model(dtype)
            _flip_one_bit(b, which, bit)
            assert fingerprint_row(b)[0] != mark[0], (which, bit)


def test_the_numbers_cross_float64_exactly():
    for value in fingerprint_row(_model()):
        assert 0 <= value < 2**52 and value == int(value)


def test_the_workers_outside_the_largest_group_of_equal_fingerprints_are_named():
    same, odd = [1.0, 2.0], [1.0, 3.0]
    assert verdict([same, same]) == {"checked": True, "differ": []}
    assert verdict([same, odd]) == {"checked": True, "differ": [1]}  # a tie: rank 0's group counts as the largest
    assert verdict([odd, same, same]) == {"checked": True, "differ": [0]}
    assert verdict([same, odd, same, odd, same]) == {"checked": True, "differ": [1, 3]}
    assert verdict([[-1.0, -1.0], [-1.0, -1.0]]) == {"checked": False}  # every parameter sharded
    assert "ranks 1, 3 differ" in warning([1, 3], 7) and "after step 7" in warning([1, 3], 7)


def test_fingerprints_in_slots_summed_over_the_present_workers_name_the_job_ranks_that_differ():
    # torchft: each worker writes [present, fingerprint] at its rank's slot of the nominal job; one sum, every slot
    # with one writer; a replica group absent at the end left its slots zero and is not compared
    same, odd = [5.0, 7.0], [5.0, 8.0]
    rows = [slots(same, 0, 4), slots(odd, 1, 4), slots(same, 3, 4)]  # rank 2 absent
    summed = [sum(col) for col in zip(*rows)]
    assert verdict_of_slots(summed) == {"checked": True, "differ": [1]}
    assert verdict_of_slots([sum(c) for c in zip(slots(same, 0, 2), slots(same, 1, 2))]) == {
        "checked": True, "differ": []}
    assert verdict_of_slots(slots([-1.0, -1.0], 0, 1)) == {"checked": False}  # every parameter sharded
    assert "export is replica group 1's" in warning([2], 9, "the export is replica group 1's")


def _end(rank: int, world: int, name: str) -> list[dict]:
    s = quietsync.make_strategy(name, _model(), torch.optim.AdamW, lr=0.01)
    guard = NonFiniteGuard("stop", s)
    try:
        g = torch.Generator().manual_seed(rank)
        while not s.step():
            x = torch.randn(4, 6, generator=g)
            s.forward_backward((x, x[:, :3]), lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
        found = [verdict(guard.check_parameters(fingerprint_row))]
        if rank == 1:  # as a flipped bit in a worker's memory would
            with s.committed_params() as m:
                _flip_one_bit(m, 2, 5)
        found.append(verdict(guard.check_parameters(fingerprint_row)))
        return found
    finally:
        guard.close()
        s.close()


@pytest.mark.timeout(120)
def test_replicas_that_agree_are_said_to_and_one_flipped_bit_on_one_worker_is_named_on_every_worker():
    out = run_ranks(_end, 2, "ddp", timeout=100)
    want = [{"checked": True, "differ": []}, {"checked": True, "differ": [1]}]
    assert out == [want, want]


def _every(rank: int, world: int, name: str) -> list[dict]:
    s = quietsync.make_strategy(name, _model(), torch.optim.AdamW, lr=0.01)
    guard = NonFiniteGuard("stop", s)
    found = []
    try:
        g = torch.Generator().manual_seed(rank)  # each worker its own data: only the commits make them agree
        while s.steps < 4:
            x = torch.randn(4, 6, generator=g)
            s.forward_backward((x, x[:, :3]), lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
            if s.step():  # mid-run, as --check-replicas-every reads them: a step in flight, a round half done
                found.append(verdict(guard.check_parameters(fingerprint_row)))
        s.finish()
        return [*found, verdict(guard.check_parameters(fingerprint_row))]
    finally:
        guard.close()
        s.close()


@pytest.mark.timeout(200)
def test_every_strategy_commits_the_same_parameters_on_every_worker_after_every_step():
    for name in ("ddp", "zero1", "acco", "dpu", "wp", "demo", "fsdp", "localsgd", "diloco"):
        out = run_ranks(_every, 2, name, timeout=100)
        assert out[0] == out[1] and len(out[0]) == 5 and all(v == {"checked": True, "differ": []} for v in out[0]), (
            name, out)


def _own_steps(rank: int, world: int, knobs: dict) -> torch.Tensor:
    s = quietsync.make_strategy("demo", _model(), torch.optim.SGD, config=knobs, lr=0.01)
    try:
        g = torch.Generator().manual_seed(rank)  # each worker its own data
        while s.steps < 3:
            x = torch.randn(4, 6, generator=g)
            s.forward_backward((x, x[:, :3]), lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
            s.step()
        with s.committed_params() as m:
            return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()
    finally:
        s.close()


APART = [({"replicator": "none"}, "--replicator none"), ({"replicate_every": 2}, "--replicate-every 2"),
         ({"skip_every": 2}, "--skip-every 2")]


@pytest.mark.timeout(200)
def test_settings_that_apply_each_workers_own_gradient_leave_the_workers_parameters_apart():
    # DeToNATION's periodic replication: a step that does not replicate applies the worker's own gradient, and what it
    # added stays (the later replicated updates are the same on every worker); without replication nothing is shared
    for knobs, _ in APART:
        a, b = run_ranks(_own_steps, 2, knobs, timeout=100)
        assert not torch.equal(a, b), knobs
    a, b = run_ranks(_own_steps, 2, {}, timeout=100)  # replicating every step: the same
    assert torch.equal(a, b)


@pytest.mark.long
@pytest.mark.timeout(240)
def test_a_run_whose_workers_keep_their_own_parameters_is_not_called_different_and_the_checks_are_refused(tmp_path):
    from ._run import small_job, train, train_subprocess

    out = tmp_path / "run"
    done = train(*small_job(tmp_path), "--strategy", "demo", "--replicate-every", "2", "--max-steps", "4",
                 "--no-export", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "differ" not in done.stdout + done.stderr  # no warning of a flipped bit where the workers part by design
    found = json.loads((out / "summary.json").read_text())["replicas"]
    assert found["checked"] is False and "--replicate-every 2" in found["why"], found
    for flags, (_, flag) in zip((["--check-replicas-every", "2"], ["--on-replicas-differ", "stop"],
                                 ["--check-replicas-every", "1"]), APART):
        knob = flag.split()
        refused = train_subprocess(*small_job(tmp_path), "--strategy", "demo", *knob, *flags, "--max-steps", "4")
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert f"has nothing to compare: with {flag} " in refused.stderr.strip().splitlines()[-1], refused.stderr


@pytest.mark.long
@pytest.mark.timeout(240)
def test_a_bit_flipped_mid_run_is_named_at_the_next_periodic_check_and_said_once(tmp_path, monkeypatch):
    from quietsync.train.metrics import read_jsonl

    from ._run import small_job, train_subprocess

    monkeypatch.setenv("QUIETSYNC_FLIP_BIT", "1:3")  # rank 1, after its step 3: one bit of its parameters
    out = tmp_path / "run"
    proc = train_subprocess(*small_job(tmp_path), "--strategy", "ddp", "--max-steps", "6",
                            "--check-replicas-every", "2", "--no-export", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("warning: after step 4 the committed parameters of rank 1 differ") == 1, proc.stdout
    assert "warning: after step 6" not in proc.stdout  # said once: the difference stays
    for rank in (0, 1):  # every worker's record holds the same verdict at the checked steps, none elsewhere
        steps = [r for r in read_jsonl(out / f"metrics-rank{rank}.jsonl") if "event" not in r]
        assert {r["step"]: r.get("replicas") for r in steps} == {
            1: None, 2: {"checked": True, "differ": []}, 3: None, 4: {"checked": True, "differ": [1]}, 5: None,
            6: {"checked": True, "differ": [1]}}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["replicas"] == {"checked": True, "differ": [1], "first_differ_step": 4}


def _stopped(tmp_path, monkeypatch, every: int):
    """A ddp run of 8 steps, a checkpoint every 2, checks every ``every``, ``--on-replicas-differ stop``, with one bit
    of rank 1's parameters flipped after step 3: its process and its output folder."""
    from ._run import small_job, train_subprocess

    monkeypatch.setenv("QUIETSYNC_FLIP_BIT", "1:3")
    out = tmp_path / "run"
    proc = train_subprocess(*small_job(tmp_path), "--strategy", "ddp", "--max-steps", "8", "--save-every", "2",
                            "--check-replicas-every", str(every), "--on-replicas-differ", "stop", "--out", str(out))
    assert proc.returncode != 0
    return proc, out


@pytest.mark.long
@pytest.mark.timeout(240)
def test_on_replicas_differ_stop_stops_every_worker_at_the_check_naming_the_last_agreed_step(tmp_path, monkeypatch):
    from ._run import small_job, train_subprocess

    proc, out = _stopped(tmp_path, monkeypatch, 2)
    assert ("after step 4 the committed parameters of rank 1 differ from the other workers' (--on-replicas-differ "
            "stop); the last check where every worker agreed was after step 2") in proc.stderr, proc.stderr[-3000:]
    assert "newest checkpoint: " in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.split("newest checkpoint: ")[1].split()[0].endswith("step-0000002")  # step 4's was not written
    assert not (out / "summary.json").exists() and not (out / "model").exists()  # nothing exported
    # resumed from it (the memory error gone), every worker holds the same parameters again, to the end
    monkeypatch.delenv("QUIETSYNC_FLIP_BIT")
    again = train_subprocess(*small_job(tmp_path), "--strategy", "ddp", "--max-steps", "8", "--save-every", "2",
                             "--check-replicas-every", "2", "--on-replicas-differ", "stop", "--out", str(out),
                             "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["replicas"] == {"checked": True, "differ": [], "first_differ_step": None}


@pytest.mark.long
@pytest.mark.timeout(240)
def test_with_stop_every_checkpoint_is_checked_before_it_is_written(tmp_path, monkeypatch):
    proc, out = _stopped(tmp_path, monkeypatch, 10)  # no periodic check before step 10, a checkpoint every 2
    assert "after step 4 the committed parameters of rank 1 differ" in proc.stderr, proc.stderr[-3000:]
    assert "the last check where every worker agreed was after step 2" in proc.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000002"]


@pytest.mark.long
@pytest.mark.timeout(240)
def test_under_torchft_the_periodic_check_rides_in_the_next_vote_and_names_the_flipped_replica(tmp_path, monkeypatch):
    pytest.importorskip("torchft")
    from quietsync.train.metrics import read_jsonl

    from ._run import small_job, train_subprocess

    monkeypatch.setenv("QUIETSYNC_FLIP_BIT", "1:3")  # replica group 1's worker, after its step 3
    out = tmp_path / "run"
    proc = train_subprocess(*small_job(tmp_path), "--strategy", "ddp", "--max-steps", "8", "--fault-tolerance",
                            "torchft", "--check-replicas-every", "2", "--no-export", "--out", str(out), timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("warning: after step 4 the committed parameters of rank 1 differ") == 1, proc.stdout
    for rank in (0, 1):  # a check after step S is in the record of the step whose vote carried it, S + 1
        steps = [r for r in read_jsonl(out / f"metrics-rank{rank}.jsonl") if "event" not in r]
        assert {r["step"]: r["replicas"] for r in steps if "replicas" in r} == {
            3: {"checked": True, "differ": [], "step": 2}, 5: {"checked": True, "differ": [1], "step": 4},
            7: {"checked": True, "differ": [1], "step": 6}}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["replicas"] == {"checked": True, "differ": [1], "first_differ_step": 4}
