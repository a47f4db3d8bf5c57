"""The training loop of `quietsync train`, one for every mode, run by every worker, written on the strategy
contract; and the set-up of a fixed or elastic world's worker.

:func:`train_steps` is the step loop. What differs between the modes -- a fixed world, torchrun's elastic world,
one replica group under a torchft quorum -- it asks a :class:`~quietsync.train.membership.Membership`
(train/world.py: ``FixedWorld``, ``ElasticWorld``; train/replica_loop.py: ``TorchftQuorum``)::

    while stopped_by is None:
        membership.begin_step()                              # torchft: a round start when due (joiners heal)
        for batch in membership.micro_batches():             # the stream, or the windows dealt for this step
            strategy.forward_backward(batch, lm_loss)        # (+ --slow-worker sleep, --profile-steps)
            guard.see(loss)                                  # --on-nonfinite (train/nonfinite.py)
            outcome = membership.commit()                    # step(), or the round dropped on every worker
            if outcome != OPEN: break
        if committed: log, eval (if due), stopped_by = budgets.check(...)   # agreed (train/budgets.py)
        if stopped_by: strategy.finish(), the last eval
        membership.after_step()                              # a checkpoint when due
    membership.close()                                       # parameters checked; torchft: totals, last round

The run ends with ``strategy.finish()`` on every worker, after the committed step at which a budget was reached
(counting a step the strategy has in flight, ``steps_in_flight``, so dpu/wp/acco end on exactly --max-steps):
local methods sync their last partial round, overlapped methods drain theirs, and the final evaluation, the
last checkpoint and the exported model see every step.

Per worker of a fixed or elastic world (:func:`run`): build the topology and transport from the environment,
map the prepared token shards and load their tokenizer (train/job_data.py), build the GPT-Neo preset (same seed
on every worker) and the strategy, then run the loop. The model is built, then (``--activation-checkpointing``,
``--compile``) checkpointed and compiled block by block, then handed to the strategy with ``--precision`` and
``--max-grad-norm`` (the strategy autocasts the forward, scales the fp16 loss and clips the gradient it commits;
see ``Strategy``). Evaluation runs under the same autocast.

Evaluation needs no communication: every worker evaluates the same held-out windows on its committed
parameters (identical across workers for synchronous strategies) and logs the result; rank 0's is the one
reported. The collectives the loop issues itself: the non-finite guard's agreements (one tiny all-reduce per
round for strategies that drop rounds, one per checkpoint and one at the end, on the transport's control
group), the budgets' agreement on the same group (one tiny all-reduce per committed step, only when --max-tokens,
--max-time-s or --target-loss is set) and one all-reduce of the totals after ``strategy.close()``, for the
summary; and, for a strategy that can reshard, torch.distributed.checkpoint's own when a checkpoint's
world-size-independent part is written or read (train/logical_checkpoint.py). Only rank 0 prints.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from ..cli.launch import note_failure
from ..data.sequences import eval_batches
from ..link import idle_links, parse_links
from ..models.causal_lm import count_parameters, param_groups
from ..strategies import Strategy, StrategyConfig, make_strategy
from ..topology import Topology
from ..transport import Transport
from .adaptive_rounds import round_length, training_stream
from .allocator import keep_freed_memory
from .budgets import BudgetWatch
from .config import TrainConfig
from .elastic import Nominal, TokenSchedule, rescaled
from .export import MODEL_DIR, export_model
from .job_data import open_job_data
from .job_model import job_model
from .membership import ABSTAIN, COMMITTED, DROPPED, OPEN, STEP_SUMS, Membership
from .metrics import MetricsWriter, format_summary, knob_change, write_summary
from .preflight import data_problem
from .profile import StepProfiler
from .resume_check import ResumeMismatch, data_change
from .schedule import warmup_cosine
from .sinks import open_sinks
from .slow_worker import MicroBatchTimer
from .world import ElasticWorld, FixedWorld, Resume, gather_totals

ADAMW_BETAS = (0.9, 0.95)
"""AdamW betas of the trainer (GPT-style)."""

AUDIT_ENV = "QUIETSYNC_AUDIT_DATA"
"""Set to 1: every step record also holds ``windows``, the ``[epoch, first token offset]`` of each training
window this worker fed since the previous committed step, and ``world_size`` (an audit of the data order:
across resumes and membership changes no window may be read twice or skipped)."""


def _set_threads(cfg: TrainConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    elif "LOCAL_WORLD_SIZE" in os.environ:  # auto: the node's cores split among its workers (each would take them all)
        local_world = max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token loss of one micro-batch of token ids (the trainer's ``loss_fn``)."""
    return model(input_ids=batch, labels=batch).loss


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[torch.Tensor], device: torch.device,
             each: Callable[[], None] | None = None) -> float:
    """Mean next-token loss of ``model`` over ``batches`` (model left in train mode); ``each`` is called after every
    batch (the loop's :meth:`~quietsync.train.membership.Membership.busy`)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        batch = batch.to(device, non_blocking=True)
        # weighted by windows: the last batch may be shorter (eval_batches)
        total += float(model(input_ids=batch, labels=batch).loss) * batch.shape[0]
        count += batch.shape[0]
        if each is not None:
            each()
    model.train(was_training)
    return total / max(1, count)


class _Printer:
    """Printing by the worker that speaks (rank 0), not tearing the progress bar."""

    def __init__(self, enabled: bool, bar: Any) -> None:
        self.enabled = enabled
        self.bar = bar

    def __call__(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None and not self.bar.disable:
            self.bar.write(text)
        else:
            print(text, flush=True)


def _step_plan(cfg: TrainConfig, strategy_config: StrategyConfig | None, world: int,
               resume: Resume | None) -> tuple[StrategyConfig | None, TokenSchedule, Nominal]:
    """The strategy config this world runs (``--batch-policy``), the learning-rate schedule's clock and the run's
    nominal step."""
    schedule = warmup_cosine(cfg.warmup, cfg.max_steps, cfg.min_lr_ratio)
    if resume is None:
        return strategy_config, TokenSchedule(schedule, 0, 0.0, 1.0), Nominal.of(strategy_config, world)
    state = resume.state
    if "nominal" in state:
        nominal = Nominal(**state["nominal"])
    else:  # a checkpoint of an older quietsync: its world at the flags' accumulation
        nominal = Nominal(int(state.get("world_size", world)), Nominal.of(strategy_config, 1).accumulation)
    step = int(state["strategy"]["steps"])
    # a checkpoint without one (older quietsync) ran the plain schedule: its position is its step
    position = float(state.get("schedule_position", step))
    run_config, ratio = rescaled(strategy_config, cfg.batch_policy, nominal, world)
    return run_config, TokenSchedule(schedule, step, position, ratio), nominal


def run(cfg: TrainConfig, strategy_config: StrategyConfig | None = None, nodes: int | None = None) -> dict | None:
    """Train as one worker of the job described by the environment; rank 0 returns the summary."""
    t_setup = time.perf_counter()
    _set_threads(cfg)
    keep_freed_memory()  # what a step frees stays for the next one: no fresh pages faulted every step (allocator.py)
    topology = Topology.from_env(nodes=nodes if nodes is not None else cfg.nodes)
    rank, world = topology.rank, topology.world_size
    slow = cfg.slow()
    if slow is not None and slow.rank >= world:
        raise ValueError(f"--slow-worker rank must be < the world size {world}, got {slow.rank}")
    links = parse_links(cfg.link)
    transport = Transport(topology, links=links, timeout_s=cfg.timeout_s)
    if rank == 0:  # a link no traffic crosses would leave the run unthrottled without a word
        for line in idle_links(links, topology.nodes, topology.workers_per_node):
            print(f"quietsync train: {line}", flush=True)
    device = transport.device
    strategy = None
    kind = ElasticWorld if cfg.elastic else FixedWorld  # the membership: how resume is agreed, how it steps
    try:
        resume = kind.resume_point(cfg, strategy_config, topology, transport)
        if resume is not None and resume.finished:
            if rank == 0:
                print(f"quietsync train: --elastic: the run is complete ({resume.folder.name} reached --max-steps "
                      f"{cfg.max_steps}); results in {os.path.abspath(cfg.out)}", flush=True)
            return None
        data = open_job_data(cfg)  # prepared once (train/job_data.py), memory-mapped by every worker
        tokenizer, eos, train_tokens, eval_tokens = data.tokenizer, data.eos, data.train, data.eval
        too_small = data_problem(train_tokens.numel(), eval_tokens.numel(), cfg, world)
        if too_small:
            raise ValueError(too_small)
        changed = None if resume is None else data_change(resume.state, cfg, data.identity, resume.folder)
        if changed:  # under torchrun no launcher compared it
            raise ResumeMismatch(changed)
        model = job_model(cfg, tokenizer.get_vocab_size(), eos, device)
        vocab_size = model.config.vocab_size  # what trains, whatever --vocab-size said
        n_params = count_parameters(model)
        run_config, clock, nominal = _step_plan(cfg, strategy_config, world, resume)
        strategy = make_strategy(
            cfg.strategy, model, torch.optim.AdamW,
            param_groups=param_groups(model, cfg.weight_decay),
            transport=transport, config=run_config,
            # nothing rescaled (ratio 1, position = step): the run's own schedule, as an uninterrupted run has it
            lr_schedule=clock.schedule if clock.ratio == 1.0 and clock.anchor_position == clock.anchor_step
            else clock,
            precision=cfg.precision, max_grad_norm=cfg.clip_norm,
            lr=cfg.lr, weight_decay=cfg.weight_decay, betas=ADAMW_BETAS,
        )
        # adaptive inner steps: each round's windows dealt by the agreed plan (train/adaptive_rounds.py)
        stream = training_stream(strategy, train_tokens, cfg.seq_len, cfg.micro_batch_size, rank, world, cfg.seed)
        held_out = eval_batches(eval_tokens, cfg.seq_len, cfg.micro_batch_size, cfg.eval_windows)
        tokens_total = 0
        resume_step = None
        if resume is not None:
            if resume.same_layout:
                strategy.load_state_dict(resume.state["strategy"])
                stream.load_state_dict(resume.state["data"])
                tokens_total = int(resume.state["tokens_total"])
                torch.set_rng_state(resume.state["rng"])
            else:  # another world size or node count (check_checkpoint allowed it)
                from .logical_checkpoint import load_logical  # torch.distributed.checkpoint: 1.4 s to import

                tokens_total = load_logical(resume.folder, strategy, stream)
            resume_step = strategy.steps  # the metrics files are cut back to it (a crash may have logged past it)
        note = kind.start_note(cfg, resume, world, run_config, clock)
        if rank == 0 and note:
            print(f"quietsync train: {note}", flush=True)
        clock_offset = time.time() - time.perf_counter()  # once per run: turns span times into wall clock (trace.py)
        audit = os.environ.get(AUDIT_ENV, "") not in ("", "0")
        membership = kind(cfg, strategy, strategy_config, clock, nominal, stream, resume_step is not None, audit,
                          data.identity)
        metrics = MetricsWriter(cfg.out, rank, resume_step, sinks=open_sinks(
            cfg.log_with, cfg.out, rank, resume=resume_step is not None,
            config={"config": job_record(cfg, vocab_size), "strategy_config": dataclasses.asdict(strategy.config)}))
        result = train_steps(cfg, strategy, membership, metrics, held_out, t_setup, tokens_total)
        result["memory_bytes"] = strategy.memory_report()  # before export: buffers as training held them
        if cfg.export:  # the committed parameters, as from_pretrained loads them (every worker: fsdp gathers)
            with strategy.paused(), strategy.committed_params() as module:
                if rank == 0:
                    export_model(module, tokenizer, os.path.join(cfg.out, MODEL_DIR))
        strategy.close()
        from .trace import collect_spans, write_merged_trace

        spans = collect_spans(transport.recorder) if cfg.trace else []
        totals = gather_totals(transport, result)
        if cfg.trace:  # every worker's spans, gathered into rank 0's OUT/trace.json
            write_merged_trace(cfg.out, transport, spans, clock_offset)
        summary = None
        if rank == 0:
            summary = job_summary(cfg, strategy, strategy_config, topology, n_params, result, totals, vocab_size)
            write_summary(cfg.out, summary)
            if cfg.plot:
                from .plots import plot_loss

                plot_loss(cfg.out, world, title=f"{cfg.strategy}, {world} workers, {cfg.model} model")
            if cfg.trace and cfg.plot:
                from .trace import plot_timeline

                plot_timeline(cfg.out, strategy.steps, title=f"{cfg.strategy}, {world} workers")
            print(format_summary(summary), flush=True)
            print(f"results in {os.path.abspath(cfg.out)}", flush=True)
        return summary
    except BaseException:
        note_failure()  # before the clean-up below, which may block on peers: the launcher blames the first
        raise
    finally:
        if strategy is not None:
            strategy.close()
        transport.close()  # also takes down torch.distributed's default group when the transport set it up


class _NoBar:
    """The progress bar of a worker that shows none (``tqdm`` is not imported for it)."""

    disable = True

    def __init__(self, initial: int) -> None:
        self.n = initial

    def update(self, n: int) -> None:
        self.n += n

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def train_steps(cfg: TrainConfig, strategy: Strategy, membership: Membership, metrics: MetricsWriter,
                held_out: list[torch.Tensor], t_setup: float, tokens_fed: int = 0) -> dict[str, Any] | None:
    """The step loop, one for every mode (``membership``: :mod:`quietsync.train.membership`): micro-batches until the
    first budget is reached (``--max-steps`` counted on the membership's position, or one of train/budgets.py, agreed
    by every worker); logs, evaluates, and lets the membership save. None when the run ended without this worker
    (a torchft replica that healed into a finished run)."""
    device, rank = strategy.transport.device, membership.rank
    if membership.ended:
        return None
    guard = membership.guard
    timer = MicroBatchTimer(cfg.slow(), rank, device)
    if membership.speaks:
        print(f"quietsync train: strategy {cfg.strategy}, {strategy.world_size} worker(s), model {cfg.model} "
              f"({count_parameters(strategy.module) / 1e6:.2f} M parameters), {cfg.budgets().describe()}, "
              f"out {cfg.out}", flush=True)
    if membership.speaks and cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.max_steps, initial=strategy.steps, unit="step", dynamic_ncols=True, mininterval=0.5,
                   desc=f"{cfg.strategy}")
    else:
        bar = _NoBar(strategy.steps)
    say = _Printer(membership.speaks, bar)
    # a resumed run goes on from the records kept up to its checkpoint: its evaluations and sums
    evals = [r for r in metrics.kept if r.get("event") == "eval"]
    adapted = [c for c in map(knob_change, (r for r in metrics.kept if "event" not in r)) if c is not None]
    sums = {k: sum(r[k] for r in metrics.kept if "event" not in r) for k in STEP_SUMS}
    # the meter restarts with the process: the kept steps' bytes, per group, are added to it for the totals
    # (set-up traffic is the resumed process's own, so each byte of an unbroken run is counted once)
    bytes_before: dict[str, dict[str, int]] = {}
    for r in (r for r in metrics.kept if "event" not in r):
        for group, v in r.get("bytes_by_group", {}).items():
            c = bytes_before.setdefault(group, {"sent": 0, "recv": 0})
            c["sent"] += int(v["sent"])
            c["recv"] += int(v["recv"])
    tokens_logged = 0  # the tokens of the steps this loop logged
    setup_s = time.perf_counter() - t_setup
    # time_s continues across a resume (the clock restarts where the kept records end)
    elapsed = max((r.get("time_s", 0.0) for r in metrics.kept), default=0.0)
    strategy.transport.start_link_clocks(elapsed)  # a --link schedule follows training time (not setup's)
    t0 = time.perf_counter() - elapsed

    def run_eval() -> float:
        t = time.perf_counter()
        # the raw module: no wrapper hooks or collectives in eval; its time is not the next step's compute
        with strategy.paused(), strategy.committed_params(), strategy.autocast():  # the run's --precision
            loss = evaluate(strategy.module, held_out, device, each=membership.busy)
        now = time.perf_counter()
        evals.append(metrics.eval(strategy.steps, loss, membership.tokens_total(tokens_fed), now - t, now - t0))
        bar.set_postfix(eval=f"{loss:.3f}", refresh=False)
        if bar.disable:
            say(f"step {strategy.steps:>6}  eval loss {loss:.4f}")
        return loss

    def log_step(losses: list[torch.Tensor], fed: int) -> None:
        """The metrics record of the step just committed (``losses``/``fed``: the micro-batches fed for it; none
        for a step that finish() committed)."""
        nonlocal tokens_logged
        m = strategy.last_step_metrics()
        # no micro-batch fed (a step finish() committed): NaN, written as null
        step_loss = float(torch.stack(losses).mean()) if losses else float("nan")
        record = {
            "step": m.step, "rank": rank, "loss": step_loss, "lr": m.lr, "tokens": membership.step_tokens(fed),
            "tokens_total": membership.tokens_total(tokens_fed), "micro_batches": m.micro_batches,
            "compute_s": m.compute_s, "comm_s": m.comm_s, "idle_s": m.idle_s, "bytes_sent": m.bytes_sent,
            "bytes_recv": m.bytes_recv, "bytes_by_group": m.bytes_by_group, "slow_sleep_s": timer.slept_s,
            "time_s": time.perf_counter() - t0, "unix_s": time.time(),
        }
        if m.extra:
            record["extra"] = m.extra
        change = knob_change(record)
        if change is not None:  # --adapt re-picked a knob: said as it happens, listed in the summary
            adapted.append(change)
            say(f"step {m.step:>6}  --adapt: {change['knob']} {change['old']} -> {change['new']}; {change['why']}")
        skipped = guard.committed()
        if skipped:
            record["skipped_rounds"] = skipped
            say(f"step {m.step:>6}  {skipped} round(s) with a non-finite loss or gradient skipped before it")
        membership.record(record)
        metrics.step(record)
        for k in sums:
            sums[k] += record[k]
        tokens_logged += record["tokens"]
        timer.slept_s = 0.0  # slow_sleep_s is per step
        bar.update(max(0, m.step - bar.n))  # a step may span several (adaptive inner steps)
        shown = {"loss": f"{step_loss:.3f}", "lr": f"{m.lr:.2e}"}
        if m.extra.get("grad_norm") is not None:
            shown["grad_norm"] = f"{m.extra['grad_norm']:.3g}"
        bar.set_postfix(shown, refresh=False)

    budgets = BudgetWatch(cfg.budgets(), strategy)
    rounds = round_length(strategy.config)  # adaptive inner steps: L, the steps of a round (None: any step ends)

    def mid_round() -> bool:
        """Adaptive inner steps inside a round: the workers' nominal steps agree only at round ends, where
        --max-steps falls, except after a resume on another number of workers (the schedule follows tokens); the
        round is finished first, as --max-tokens may be passed by up to a round."""
        return bool(rounds) and strategy.steps % rounds != 0

    stopped_by = "max_steps" if membership.position(strategy) >= cfg.max_steps else None  # nothing left to train
    profiler = StepProfiler(cfg.profile_steps, cfg.out, rank, device)
    # the summary's nonfinite_skips counts the whole run, the kept records' skips too
    skipped_before = sum(r.get("skipped_rounds", 0) for r in metrics.kept if "event" not in r)
    losses: list[torch.Tensor] = []
    step_tokens = 0  # this worker's tokens fed since the last committed step
    ended = False

    def end_run() -> None:
        """The run ends here on every worker: sync or drain what is in flight (``finish``; a step it commits is
        logged and evaluated like any other), and every run ends with an evaluation of its last step."""
        nonlocal losses, step_tokens, ended
        ended = True
        if stopped_by != "max_steps":
            say(f"step {strategy.steps:>6}  stopped by {stopped_by} ({cfg.budgets().describe()})")
        if membership.finish(strategy):
            log_step(losses, step_tokens)
            losses, step_tokens = [], 0
        if not evals or evals[-1]["step"] != strategy.steps:  # not twice: --eval-every may have hit this step
            run_eval()

    try:
        if membership.fresh:
            run_eval()
        while stopped_by is None:
            membership.begin_step(strategy)
            if membership.ended:  # a torchft replica that healed into a run that ended meanwhile
                return None
            if membership.position(strategy) >= cfg.max_steps and not mid_round():
                stopped_by = "max_steps"  # a torchft replica that healed at the last step
                break
            losses = []
            outcome, index, batches = OPEN, -1, membership.micro_batches(strategy)
            while True:
                profiler.before_micro_batch(strategy.steps)
                batch = next(batches, None)
                if batch is None:
                    break
                index += 1
                if batch is ABSTAIN:
                    loss = membership.abstain(strategy)
                else:
                    batch = batch.to(device, non_blocking=True)
                    timer.start()
                    loss = strategy.forward_backward(batch, lm_loss)
                    timer.stop()
                    step_tokens += batch.numel()
                    tokens_fed += batch.numel()
                    loss = membership.fed(strategy, index, loss)
                guard.see(loss)
                if loss is not None:
                    losses.append(loss)
                outcome = membership.commit(strategy, index)
                if outcome != OPEN:
                    break
                if strategy.steps_in_flight and membership.position(strategy) >= cfg.max_steps:
                    break  # an update began that finish() will commit: the last step is in flight
            if outcome == DROPPED:  # on every worker: the step starts again
                continue
            eval_loss = None
            if outcome == COMMITTED:
                membership.after_commit(strategy)
                profiler.after_commit(strategy.steps)
                log_step(losses, step_tokens)
                losses, step_tokens = [], 0
                evaluated = bool(cfg.eval_every) and strategy.steps % cfg.eval_every == 0
                eval_loss = run_eval() if evaluated else None
                stopped_by = budgets.check(tokens_fed, time.perf_counter() - t0, eval_loss,
                                           steps=membership.position(strategy), evaluated=evaluated)
                if stopped_by == "max_steps" and mid_round():
                    stopped_by = None
            # the micro-batch loop broke off with the last step in flight: finish() commits it
            elif strategy.steps_in_flight and membership.position(strategy) >= cfg.max_steps:
                stopped_by = "max_steps"
            else:
                raise RuntimeError(f"strategy {cfg.strategy} did not commit after {index + 1} micro-batch(es)")
            if stopped_by is not None:
                end_run()
            membership.after_step(strategy, stopped_by is not None, tokens_fed)
        if not ended:  # nothing was left to train, or a torchft replica healed at the last step
            end_run()
        result = {
            "setup_s": setup_s, "tokens_total": tokens_fed, "evals": evals, "adapted": adapted,
            "micro_batches": strategy.micro_batches,
            "nonfinite_skips": skipped_before + guard.skipped, "stopped_by": stopped_by, "tokens_logged": tokens_logged,
            "bytes_before": bytes_before, **sums,
        }
        result.update(membership.close(strategy, result))
    except Exception as e:
        instead = membership.failure(e, strategy)
        if instead is None:
            raise
        raise instead from None
    finally:
        profiler.close()
        bar.close()
        metrics.close()
    result["wall_s"] = time.perf_counter() - t0
    return result


def job_record(cfg: Any, vocab_size: int | None) -> dict[str, Any]:
    """The job's fields as recorded (summary.json, the loggers), with the vocabulary size the model has."""
    return {**dataclasses.asdict(cfg), **({"vocab_size": int(vocab_size)} if vocab_size is not None else {})}


def job_summary(
    cfg: TrainConfig,
    strategy: Strategy,
    strategy_config: StrategyConfig | None,
    topology: Topology,
    n_params: int,
    result: dict[str, Any],
    totals: dict[str, Any],
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """The ``summary.json`` object (rank 0); ``config.vocab_size`` is the model's (``vocab_size``), not the flag's:
    a prepared folder or a model folder decides it."""
    evals = result["evals"]
    busy = totals["compute_s"] + totals["idle_s"]
    sent = sum(c["sent"] for c in totals["bytes_by_group"].values())
    recv = sum(c["recv"] for c in totals["bytes_by_group"].values())
    return {
        "strategy": cfg.strategy,
        "world_size": topology.world_size,
        "nodes": topology.nodes,
        "model": cfg.model,
        "parameters": n_params,
        "steps": strategy.steps,
        "stopped_by": result["stopped_by"],
        "budgets": dataclasses.asdict(cfg.budgets()),
        "micro_batches": totals["micro_batches"],
        "nonfinite_skips": result["nonfinite_skips"],
        "replicas": result.get("replicas"),
        "tokens": totals["tokens"],
        "wall_s": result["wall_s"],
        "setup_s": result["setup_s"],
        "tokens_per_s": totals["tokens"] / max(result["wall_s"], 1e-9),
        "first_eval_loss": evals[0]["loss"] if evals else None,
        "last_eval_loss": evals[-1]["loss"] if evals else None,
        "eval": [{"step": e["step"], "loss": e["loss"]} for e in evals],
        "adapt": [{k: c[k] for k in ("step", "knob", "old", "new")} for c in result.get("adapted", [])],
        "strategy_summary": strategy.summary(),
        "bytes_sent": sent,
        "bytes_recv": recv,
        "bytes_by_group": totals["bytes_by_group"],
        "bytes_sent_per_step": totals["bytes_sent"] / max(1, strategy.steps),
        "compute_s": totals["compute_s"],
        "comm_s": totals["comm_s"],
        "idle_s": totals["idle_s"],
        "compute_fraction": totals["compute_s"] / busy if busy > 0 else 0.0,
        "memory_bytes": result.get("memory_bytes"),
        "cuda_peak_bytes": (torch.cuda.max_memory_allocated(strategy.transport.device)
                            if strategy.transport.device.type == "cuda" else None),
        "links": list(cfg.link),
        "slow_worker": cfg.slow_worker,
        "config": job_record(cfg, vocab_size),
        "strategy_config": dataclasses.asdict(strategy_config) if strategy_config is not None else None,
    }
