"""quietsync.accelerate: QuietOptimizer / QuietAccelerator against plain training, and the example under
the real ``accelerate launch``."""

from __future__ import annotations

import copy
import math
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
import torch  # noqa: E402

from quietsync.accelerate import QuietOptimizer, strategy_kwargs_from_optimizer  # noqa: E402

from .distributed import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batches(n: int, size: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 6, generator=g), torch.randn(size, 2, generator=g)) for _ in range(n)]


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _factor(step: int) -> float:
    """The LambdaLR factor the tests schedule with (warm-up, then decay)."""
    return min(1.0, (step + 1) / 3) * 0.8 ** max(0, step - 2)


def _reference(steps: int, micro: int, world: int, lr: float, sched_per_step: int, clip: float | None = None,
               norms: list | None = None) -> list[torch.Tensor]:
    """Plain single-process SGD: each step on the concatenation of every worker's micro-batches (with ``clip``,
    ``torch.nn.utils.clip_grad_norm_`` first; its pre-clip norms appended to ``norms``)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _factor)
    data = [_batches(steps * micro, 4, seed=10 + r) for r in range(world)]
    for s in range(steps):
        chunk = [data[r][s * micro + m] for r in range(world) for m in range(micro)]
        x = torch.cat([c[0] for c in chunk])
        y = torch.cat([c[1] for c in chunk])
        opt.zero_grad()
        _loss(model, (x, y)).backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if norms is not None:
                norms.append(float(norm))
        opt.step()
        for _ in range(sched_per_step):
            sched.step()
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------------------------- workers (2 gloo ranks)
def _accelerate_worker(rank: int, world: int, strategy: str, steps: int, micro: int, lr: float,
                       clip: float | None = None, mixed_precision: str = "no") -> dict:
    """An ordinary Accelerate loop with a QuietAccelerator; rank r trains on its own micro-batches (with
    ``clip``: ``accelerator.clip_grad_norm_`` between backward and step, as Accelerate's docs write it)."""
    from quietsync.accelerate import QuietAccelerator

    accelerator = QuietAccelerator(strategy=strategy, gradient_accumulation_steps=micro,
                                   mixed_precision=mixed_precision)
    model = _model()
    autocast_seen = []
    model[1].register_forward_hook(lambda m, i, o: autocast_seen.append((torch.is_autocast_enabled("cpu"),
                                                                         i[0].dtype)))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _factor)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    assert not isinstance(model, torch.nn.parallel.DistributedDataParallel) or strategy == "ddp"
    commits, applied, scheduled, norms = [], [], [], []
    for batch in _batches(steps * micro, 4, seed=10 + rank):
        with accelerator.accumulate(model):
            loss = _loss(model, batch)
            lr_now = optimizer.param_groups[0]["lr"]
            accelerator.backward(loss)
            if clip is not None and accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), clip)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        committed = accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped
        commits.append(committed)
        if committed:
            scheduled.append(lr_now)
            applied.append(optimizer.strategy.optimizer.param_groups[0]["lr"])  # what the strategy stepped with
    with optimizer.committed_params() as m:
        params = [p.detach().clone() for p in accelerator.unwrap_model(m).parameters()]
    out = {"params": params, "commits": commits, "applied": applied, "scheduled": scheduled, "norms": norms,
           "autocast": autocast_seen, "precision": optimizer.strategy.precision.name,
           "overflows": 0 if optimizer.strategy.scaler is None else optimizer.strategy.scaler.skipped_total,
           "steps": optimizer.steps, "bytes": optimizer.last_step_metrics().bytes_sent,
           "ddp_wrapped_by_accelerate": any(isinstance(x, torch.nn.parallel.DistributedDataParallel)
                                            and x is not optimizer.model for x in accelerator._models)}
    accelerator.end_training()
    return out


@pytest.mark.timeout(60)
def test_zero1_sgd_under_accelerate_equals_single_process_training_on_the_concatenated_batch():
    steps, lr = 4, 0.2
    results = run_ranks(_accelerate_worker, 2, "zero1", steps, 1, lr, timeout=55)
    # Accelerate steps a scheduler once per process per optimizer step: 2 factor steps per step here.
    ref = _reference(steps, 1, 2, lr, sched_per_step=2)
    for r in results:
        assert r["steps"] == steps and r["bytes"] > 0 and not r["ddp_wrapped_by_accelerate"]
        for p, q in zip(r["params"], ref):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    assert not torch.equal(ref[0], _model()[0].weight)  # training moved the parameters


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_accumulate_with_two_steps_commits_every_second_micro_batch(strategy):
    steps, lr = 3, 0.2
    results = run_ranks(_accelerate_worker, 2, strategy, steps, 2, lr, timeout=55)
    ref = _reference(steps, 2, 2, lr, sched_per_step=2)
    for r in results:
        assert r["commits"] == [False, True] * steps
        for p, q in zip(r["params"], ref):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("strategy", "micro"), [("zero1", 1), ("ddp", 2)])
def test_clip_grad_norm_clips_the_committed_gradient_and_returns_its_norm(strategy, micro):
    steps, lr, clip = 3, 0.2, 0.05
    results = run_ranks(_accelerate_worker, 2, strategy, steps, micro, lr, clip, timeout=85)
    norms: list[float] = []
    ref = _reference(steps, micro, 2, lr, sched_per_step=2, clip=clip, norms=norms)
    assert all(n > clip for n in norms)  # every step clips
    for r in results:
        assert r["norms"] == pytest.approx(norms, rel=1e-5)
        for p, q in zip(r["params"], ref):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mixed_precision", ["bf16", "fp16"])
def test_mixed_precision_becomes_the_strategy_precision(mixed_precision):
    results = run_ranks(_accelerate_worker, 2, "zero1", 3, 1, 0.2, None, mixed_precision, timeout=85)
    want = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
    for r in results:
        # fp16: loss scaling starts at 2**16; a round that overflows is skipped (on both workers)
        assert r["precision"] == mixed_precision and r["steps"] + r["overflows"] == 3 and r["steps"] > 0
        assert r["autocast"] and all(on and dtype == want for on, dtype in r["autocast"])
        assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in r["params"])
    torch.testing.assert_close(results[0]["params"], results[1]["params"], atol=0, rtol=0)


@pytest.mark.timeout(60)
def test_the_lr_the_strategy_applies_follows_the_scheduler():
    results = run_ranks(_accelerate_worker, 2, "zero1", 4, 1, 0.2, timeout=55)
    expected = [0.2 * _factor(2 * s) for s in range(4)]
    for r in results:
        assert r["scheduled"] == pytest.approx(expected)
        assert r["applied"] == pytest.approx(expected)


# ---------------------------------------------------------------------------------- single process
def test_single_process_schedule_and_sgd_match_plain_torch():
    """World of one, no Accelerate: QuietOptimizer + LambdaLR = torch SGD + LambdaLR, step by step."""
    quiet_model, plain_model = _model(), _model()
    quiet = QuietOptimizer(quiet_model, torch.optim.SGD(quiet_model.parameters(), lr=0.1), "zero1")
    sched = torch.optim.lr_scheduler.LambdaLR(quiet, _factor)  # built on the QuietOptimizer
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1)
    plain_sched = torch.optim.lr_scheduler.LambdaLR(plain, _factor)
    for batch in _batches(5, 4):
        quiet.backward(_loss(quiet.model, batch))  # the strategy's step is owed until step()
        quiet.step()
        assert not quiet.step_was_skipped
        sched.step()
        quiet.zero_grad()
        plain.zero_grad()
        _loss(plain_model, batch).backward()
        plain.step()
        plain_sched.step()
        assert quiet.last_step_metrics().lr == pytest.approx(0.1 * _factor(quiet.steps - 1))
    for p, q in zip(quiet_model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    quiet.close()


@pytest.mark.parametrize("strategy", ["zero1", "ddp"])
def test_optimizer_state_dict_round_trip_resumes_exactly(strategy):
    def make():
        model = _model()
        opt = QuietOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), strategy, accumulation=2)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _factor)

    data = _batches(8, 4)
    model, opt, sched = make()

    def train(opt, sched, batches):
        for b in batches:
            opt.backward(_loss(opt.model, b))
            opt.step()
            if not opt.step_was_skipped:
                sched.step()

    train(opt, sched, data[:3])  # a step and a half: a pending micro-batch is part of the state
    saved_opt, saved_sched = copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict())
    train(opt, sched, data[3:])
    final = [p.detach().clone() for p in model.parameters()]

    model2, opt2, sched2 = make()
    opt2.load_state_dict(saved_opt)
    sched2.load_state_dict(saved_sched)
    assert opt2.steps == 1 and opt2.param_groups[0]["lr"] == pytest.approx(1e-2 * _factor(1))
    train(opt2, sched2, data[3:])
    assert opt2.steps == opt.steps == 4
    for p, q in zip(model2.parameters(), final):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
    with pytest.raises(ValueError, match="not saved by a QuietOptimizer"):
        opt2.load_state_dict(sched.state_dict())
    opt.close()
    opt2.close()


def test_specification_keeps_user_options_and_base_lr():
    model = _model()
    groups = [{"params": list(model[0].parameters()), "weight_decay": 0.0},
              {"params": list(model[2].parameters())}]
    opt = torch.optim.AdamW(groups, lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0)  # warm-up from 0: lr is 0 now, initial_lr kept
    spec = strategy_kwargs_from_optimizer(opt)
    assert spec["optimizer"] is torch.optim.AdamW
    assert spec["lr"] == 3e-3 and spec["weight_decay"] == 0.1 and spec["betas"] == (0.9, 0.95)
    assert "eps" not in spec and "amsgrad" not in spec  # left at the class defaults
    assert spec["param_groups"][0]["weight_decay"] == 0.0 and "weight_decay" not in spec["param_groups"][1]
    assert [g["lr"] for g in spec["param_groups"]] == [3e-3, 3e-3]


def test_misuse_fails_early_and_clearly():
    model = _model()
    with pytest.raises(ValueError, match="strategy must be one of .*zero1"):
        QuietOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), "nope")
    # the Accelerate/Trainer path names a misspelt config field as make_strategy does (it was a raw TypeError)
    with pytest.raises(ValueError, match=r"'sync_evry' is not a field of DiLoCoConfig \(did you mean 'sync_every'"):
        QuietOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), "diloco", config={"sync_evry": 4})
    with pytest.raises(ValueError, match="decides its own accumulation"):
        QuietOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), "acco", accumulation=2)
    with pytest.raises(ValueError, match="conflicts"):
        QuietOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), "zero1",
                       config={"accumulation": 3}, accumulation=2)
    with pytest.raises(ValueError, match="learning rate of parameter group 0 is 0"):
        QuietOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.0), "zero1")
    quiet = QuietOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), "zero1")
    with pytest.raises(ValueError, match="closures"):
        quiet.step(lambda: 0.0)
    quiet.close()


def test_quiet_accelerator_rejects_unknown_strategy_before_touching_accelerate():
    from quietsync.accelerate import QuietAccelerator

    with pytest.raises(ValueError, match="strategy must be one of"):
        QuietAccelerator(strategy="nope")


def test_accelerator_backward_is_refused_for_a_strategy_that_owns_its_schedule_naming_forward_backward():
    """cdp runs forward and backward itself: a loss computed outside cannot feed it (it used to hang: no step ever
    committed); accelerator.forward_backward(batch, loss_fn) does."""
    from quietsync.accelerate import QuietAccelerator

    accelerator = QuietAccelerator(strategy="cdp")
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=r"strategy cdp schedules forward and backward itself.*"
                                           r"accelerator\.forward_backward\(batch"):
        accelerator.backward(_loss(model, _batches(1, 4)[0]))
    committed = 0
    for batch in _batches(6, 4):
        accelerator.forward_backward(batch, _loss)
        optimizer.step()
        committed += not optimizer.step_was_skipped
    assert committed == optimizer.steps >= 2
    optimizer.close()


def _save_load_worker(rank: int, world: int, strategy: str, folder: str) -> dict:
    """Train 3 micro-batches, ``save_state``, train 5 more; ``load_state`` and train the same 5 again."""
    from quietsync.accelerate import QuietAccelerator

    accelerator = QuietAccelerator(strategy=strategy, gradient_accumulation_steps=2)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer,
                                                      torch.optim.lr_scheduler.LambdaLR(optimizer, _factor))
    data = _batches(8, 4, seed=20 + rank)
    if rank == 0:  # the main process writes the model and scheduler: late, the other rank must still find them
        accelerator.register_save_state_pre_hook(lambda models, weights, folder: time.sleep(1.0))

    def train(batches):
        for batch in batches:
            with accelerator.accumulate(model):
                accelerator.backward(_loss(model, batch))
                optimizer.step()
                scheduler.step()
        return [p.detach().clone() for p in model.parameters()], optimizer.steps

    train(data[:3])  # a step and a half: the pending micro-batch is part of the state
    location = accelerator.save_state(folder)
    first, steps = train(data[3:])
    accelerator.load_state(location)
    again, steps_again = train(data[3:])
    accelerator.end_training()
    return {"first": first, "again": again, "steps": (steps, steps_again),
            "files": sorted(f for f in __import__("os").listdir(location) if f.startswith("quietsync-"))}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["zero1", "diloco"])
def test_save_state_and_load_state_keep_every_ranks_own_strategy_state(strategy, tmp_path):
    """A shard (zero1) and an outer round in progress (diloco) differ per rank: each rank saves its own state with
    ``accelerator.save_state`` (Accelerate would save rank 0's alone) and ``load_state`` rewinds every rank to it
    exactly."""
    results = run_ranks(_save_load_worker, 2, strategy, str(tmp_path / "state"), timeout=100)
    for r in results:
        assert r["files"] == ["quietsync-optimizer-rank0-of-2.pt", "quietsync-optimizer-rank1-of-2.pt"]
        assert r["steps"][0] == r["steps"][1] == 4, r["steps"]
        for a, b in zip(r["first"], r["again"]):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy,config,drifts", [
    ("acco", None, True), ("zero1", None, False),
    ("localsgd", {"sync_every": 2, "inner_steps": "adaptive"}, True), ("localsgd", {"sync_every": 2}, False)])
def test_a_collective_between_micro_batches_of_drifting_workers_is_refused_in_one_line(strategy, config, drifts):
    """acco's workers reach a step after different numbers of micro-batches, and under adaptive inner steps a slow
    worker takes fewer steps per round: a gather in the loop could wait forever for a peer waiting inside its step
    (or already stopped), so it is refused until ``finish()``; a strategy in lockstep (zero1, localsgd with fixed
    inner steps) gathers as Accelerate does."""
    from quietsync.accelerate import QuietAccelerator

    accelerator = QuietAccelerator(strategy=strategy, strategy_config=config)
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for batch in _batches(3, 4):
        accelerator.backward(_loss(model, batch))
        optimizer.step()
    calls = {"gather": lambda: accelerator.gather(torch.ones(2)),
             "gather_for_metrics": lambda: accelerator.gather_for_metrics(torch.ones(2)),
             "reduce": lambda: accelerator.reduce(torch.ones(2)),
             "pad_across_processes": lambda: accelerator.pad_across_processes(torch.ones(2)),
             "wait_for_everyone": accelerator.wait_for_everyone}
    for name, call in calls.items():
        if drifts:
            with pytest.raises(RuntimeError, match=rf"^accelerator\.{name} while strategy {strategy} trains: .*"
                                                   r"after optimizer\.finish\(\)"):
                call()
        else:
            call()
    optimizer.finish()
    assert accelerator.gather(torch.ones(2)).tolist() == [1.0, 1.0]  # finished: nothing drifts any more
    accelerator.wait_for_everyone()
    accelerator.end_training()


@pytest.mark.parametrize("strategy", ["dpu", "wp", "acco"])
def test_a_background_update_applies_the_schedulers_lr_of_its_own_step(strategy):
    """dpu/wp/acco compute an update on their communication thread, started when the previous step commits --
    before the loop stepped its scheduler. The lr it applies is the scheduler's for its step, not whichever lr
    the thread happened to read first (the job waits for the loop's next call)."""
    model = _model()
    quiet = QuietOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy,
                           config={"deterministic_accumulation": 1})
    sched = torch.optim.lr_scheduler.LambdaLR(quiet, lambda s: 1.0 / (1 + s))
    for batch in _batches(12, 4):
        quiet.forward_backward(batch, _loss)
        quiet.step()
        if not quiet.step_was_skipped:
            assert quiet.last_step_metrics().lr == pytest.approx(0.1 / quiet.steps)  # step k: lr 0.1 / k
            sched.step()
    assert quiet.steps >= 4
    quiet.close()


# ---------------------------------------------------------------------------------- the real launcher
@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_example_with_gradient_accumulation_and_forward_backward_under_accelerate_launch(tmp_path):
    """accumulate() with gradient_accumulation_steps=2: every second micro-batch commits (one launch, three
    strategies, fed through accelerator.forward_backward; every strategy with accumulation 1 and the usual
    accelerator.backward in tests/test_front_doors.py)."""
    from .test_front_doors import accelerate_launch

    records = accelerate_launch(tmp_path / "out.jsonl", "--strategy", "zero1,ddp,diloco", "--steps", "3",
                                "--accumulation", "2", "--forward-backward")
    for name, (r0, r1) in records.items():
        assert r0["world"] == 2 and r0["checksum"] == r1["checksum"], name  # replicas identical
        assert r0["steps"] == 3 and r0["micro_batches"] == 6 and r0["moved"] > 0, name
        assert math.isfinite(r0["final_loss"]) and r0["final_loss"] != r1["final_loss"], name  # own data
        assert r0["bytes_sent"] > 0 or name == "diloco", name  # diloco: its one sync is finish()'s


@pytest.mark.timeout(60)
def test_save_state_of_a_strategy_that_cannot_checkpoint_now_writes_nothing(tmp_path):
    """cdp keeps micro-batches in flight at every step: its refusal comes before Accelerate writes any file, so no
    half checkpoint is left for a later load_state to find."""
    from quietsync.accelerate import QuietAccelerator

    accelerator = QuietAccelerator(strategy="cdp")
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for batch in _batches(4, 4):
        accelerator.forward_backward(batch, _loss)
        optimizer.step()
    with pytest.raises(RuntimeError, match="cdp: state_dict\\(\\) with micro-batches in flight"):
        accelerator.save_state(str(tmp_path / "state"))
    assert not (tmp_path / "state").exists()
    accelerator.end_training()
