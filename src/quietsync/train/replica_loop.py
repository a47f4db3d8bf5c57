"""One worker of one replica group under ``--fault-tolerance torchft``: its set-up and its membership
(:class:`TorchftQuorum`) in the trainer's one step loop (:func:`quietsync.train.loop.train_steps`).

Per worker: the transport of the replica group (:class:`~quietsync.faults.transport.FaultTolerantTransport`) and
its torchft Manager (:class:`~quietsync.faults.quorum.ReplicaQuorum`, started first, so the Lighthouse sees every
replica of a fresh job before the first quorum), then the corpus, the model (same seed on every replica), one
warm-up forward and backward (:func:`warm_up`: a returning replica's first step then costs what any step does) and
the strategy, whose learning-rate schedule reads the dealer's position in tokens. Then ``quorum.join()`` (heal
from a live peer if the others are ahead) and the loop, in which the quorum answers::

    before a step:     if quorum.round_due: quorum.start_round()   # after a commit: joiners heal here
    its micro-batches: dealer.deal(quorum.members, ...)            # this step's windows (train/window_dealer.py)
    its commit:        strategy.step()                             # its collectives over the replicas commit
                                                                   # through the quorum (retried among survivors);
                                                                   # a round that is not finite is voted on, not
                                                                   # stepped (--on-nonfinite: replica_nonfinite.py)
    after a commit:    if alone: strategy.settle(); tick the quorum if nothing committed (a round boundary)
    the close:         the totals; a last round (replicas waiting to join see the run is over)

then the export and the summary.

Records (``metrics-rank{R}.jsonl``, R the worker's rank in the nominal job) continue across a replica's restarts
(a healed incarnation appends after the step it healed at) and hold, besides the usual fields, ``members`` (the
replica groups of the step's quorum), ``healed`` and ``retries`` counters, ``unix_s`` (wall clock, to put the
replicas on one timeline), ``start`` (a replica's first step: its set-up marks) and ``rounds`` (the phases of each
round start since the previous step that changed the quorum or moved state:
:meth:`~quietsync.faults.quorum.ReplicaQuorum._phases`); with ``QUIETSYNC_AUDIT_DATA=1`` also the windows the
worker trained in the step (``windows``) and every commit logged since its previous step (``commits``: its number,
the replica groups in it, the step it was launched at, the windows it committed and gave back).
The replica group whose rank-0 replica leads the final quorum writes ``summary.json`` and ``OUT/model``.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..cli.launch import note_failure
from ..data.sequences import ShardedSequences, eval_batches
from ..faults.async_join import abstain_micro_batch, async_join_problem
from ..faults.flags import QUORUM_TIMEOUT_S, quorum_timeout_s
from ..faults.heal import heal_state, load_heal_state
from ..faults.inject import flip_bit, hold, poison, reached, ready
from ..faults.quorum import ReplicaQuorum
from ..faults.store import replica_store
from ..faults.transport import FaultTolerantTransport
from ..link import parse_links
from ..models.causal_lm import count_parameters, param_groups
from ..strategies import StrategyConfig, make_strategy
from ..strategies.parts.precision import parse_precision
from ..topology import GROUPS
from . import replicas as replica_check
from .allocator import keep_freed_memory
from .elastic import accumulation_field
from .export import MODEL_DIR, export_model
from .job_data import open_job_data
from .job_model import job_model
from .loop import ADAMW_BETAS, AUDIT_ENV, job_record, job_summary, lm_loss, train_steps
from .membership import ABSTAIN, COMMITTED, DROPPED, OPEN, STEP_SUMS
from .metrics import MetricsWriter, write_summary
from .nonfinite import NonFiniteError
from .preflight import data_problem
from .replica_nonfinite import ReplicaNonFinite, dropped_in, finite_and_fingerprint
from .schedule import warmup_cosine
from .sinks import open_sinks
from .window_dealer import WindowDealer

HOST_ENV = "QUIETSYNC_FT_HOST"
"""The address other replica groups reach this one at (default: 127.0.0.1 when the Lighthouse is on this machine's
loopback, else the host name)."""


def advertised_host(lighthouse: str) -> str:
    """The address the other replica groups reach this one at (:data:`HOST_ENV`)."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    host = lighthouse.rpartition("://")[2].rpartition(":")[0].strip("[]")  # [::1]:port: an IPv6 host in brackets
    return "127.0.0.1" if host in ("127.0.0.1", "localhost", "::1") else socket.gethostname()


def process_started_unix() -> float | None:
    """When this process started (wall clock; Linux ``/proc``), None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            # field 22, starttime (clock ticks after boot); split after the last ")": the name may hold spaces
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class TorchftQuorum:
    """The membership of one worker of one replica group under a torchft quorum
    (:mod:`quietsync.train.membership`; the protocol's methods are documented there).

    Args:
        cfg: the run's flags.
        strategy: this worker's strategy.
        transport: the replica group's transport.
        quorum: the replica group's torchft Manager.
        dealer: the job's window dealer (its state heals with the strategy's).
        state: the run's own heal state (``finished``).
        healed_at_join: whether this replica healed from a live peer when it joined.
        marks: wall-clock marks of this replica's start, logged with its first step as ``start``:
            ``process_start``, ``loop_start`` (imports done), ``manager`` (torchft's Manager up: heartbeats),
            ``data`` (corpus mapped), ``model``, ``warm`` (:func:`warm_up` done), ``ready`` (strategy built,
            held-out batches and records open), ``joined``; a standby (``--standby``) also ``standby`` (prepared,
            waiting) and ``activated`` (its file seen; its ``manager`` follows).
        audit: whether records hold the windows and commits (``QUIETSYNC_AUDIT_DATA``).
    """

    speaks = False  # the replica groups come and go: the lead of the final quorum prints the closing line

    def __init__(self, cfg: Any, strategy: Any, transport: FaultTolerantTransport, quorum: ReplicaQuorum,
                 dealer: WindowDealer, state: dict[str, Any], healed_at_join: bool, marks: dict[str, float | None],
                 audit: bool) -> None:
        self.cfg, self.transport, self.quorum, self.dealer, self.state = cfg, transport, quorum, dealer, state
        self.marks, self.audit = marks, audit
        self.rank = transport.topology.rank
        self.fresh = strategy.steps == 0 and not healed_at_join
        self.guard = ReplicaNonFinite(cfg.on_nonfinite, strategy, quorum, cfg.nonfinite_skip_limit)
        self.accumulation = dealer.per_replica // (cfg.micro_batch_size * transport.workers)
        self.windows: list[int] = []  # this worker's windows of the step being trained
        self.dropped_windows: list[int] = []  # windows of dropped rounds given back since the last record
        self.finish_commits: list[dict[str, Any]] = []
        self._commits = self._retries = 0  # the quorum's counters when the step began
        self.first_differ: int | None = None  # --check-replicas-every: the first checked step whose workers differed
        self.leave: str | None = None  # --on-replicas-differ heal: why this replica group leaves after this step

    @property
    def ended(self) -> bool:
        return bool(self.state["finished"])

    def position(self, strategy: Any) -> float:
        return self.dealer.position()

    def begin_step(self, strategy: Any) -> None:
        self.quorum.progress()  # the stall watch counts from each step's start, micro-batch and commit
        hold(strategy.steps + 1)  # a test's hold point (QUIETSYNC_FT_HOLD; nothing without it)
        if self.quorum.round_due:
            self.quorum.start_round()  # after a commit: joiners heal here

    def micro_batches(self, strategy: Any) -> Iterator[torch.Tensor]:
        self._commits, self._retries = self.quorum.commits, self.quorum.retries
        mb, w = self.cfg.micro_batch_size, self.transport.workers
        self.windows = self.dealer.deal(self.quorum.members, self.transport.replica, strategy.steps)[
            self.transport.local_rank::w]  # worker i of the group: every W-th window of its slot
        if self.quorum.abstains:  # just healed: no data of its own this step (faults/async_join.py)
            self.windows = []
            return iter([ABSTAIN] * self.accumulation)
        return (self.dealer.batch(self.windows[a * mb:(a + 1) * mb]) for a in range(self.accumulation))

    def abstain(self, strategy: Any) -> torch.Tensor | None:
        abstain_micro_batch(strategy)
        return None

    def fed(self, strategy: Any, index: int, loss: torch.Tensor | None) -> torch.Tensor | None:
        self.quorum.progress()
        # a test's injected non-finite value (QUIETSYNC_FT_NONFINITE), on the step's first micro-batch
        return poison(strategy.steps + 1, loss, strategy.module) if index == 0 else loss

    def commit(self, strategy: Any, index: int) -> str:
        self.quorum.progress()
        if index == self.accumulation - 1:
            reached("step")
        try:
            if strategy.round_closes and not self.guard.round_finite():
                self.guard.vote()  # instead of stepping: the others learn it at their next unit
            return COMMITTED if strategy.step() else OPEN
        except Exception as e:
            vote = dropped_in(e)
            if vote is None:
                raise
            self.guard.dropped(vote)  # raises under stop: no replica committed the round
            self.dropped_windows.extend(self.dealer.drop())  # skip: dealt again first, from the next step
            return DROPPED

    def after_commit(self, strategy: Any) -> None:
        if self.transport.group_size("replicate") == 1:
            strategy.settle()  # an exchange in flight commits first (alone it has no network to hide)
            if self.quorum.commits == self._commits:
                self.quorum.run(lambda: None, [])  # alone, a strategy skips its exchange: the quorum still ticks,
                # so a returning replica finds a round boundary to join at
        every = self.cfg.check_replicas_every
        if every and strategy.steps % every == 0:  # the fingerprint rides in the next unit's vote
            with strategy.paused(), strategy.committed_params() as module:
                row = replica_check.fingerprint_of(strategy, module)
            if row[0] >= 0:  # something replicated to compare
                self.quorum.marks = (strategy.steps, int(row[0]), int(row[1]))

    def busy(self) -> None:
        self.quorum.progress()

    def step_tokens(self, fed: int) -> int:
        return len(self.windows) * self.cfg.seq_len

    def tokens_total(self, fed: int) -> int:
        return self.dealer.committed * self.cfg.seq_len

    def record(self, record: dict[str, Any]) -> None:
        quorum = self.quorum
        record.update({"members": quorum.members, "position": self.dealer.position(), "healed": quorum.healed,
                       "retries": quorum.retries - self._retries})
        commits = self.dealer.take_commits()
        if self.audit:
            record["windows"] = self.windows
            if commits:
                record["commits"] = commits
            if self.dropped_windows:
                record["dropped"] = list(self.dropped_windows)
        self.dropped_windows.clear()
        if self.marks:
            record["start"], self.marks = dict(self.marks), {}  # the first step only
        rounds = quorum.take_rounds()
        if rounds:
            record["rounds"] = rounds
        got, quorum.received_marks = quorum.received_marks, {}
        found = replica_check.verdict_of_marks(got, self.transport.replica, self.transport.workers,
                                               self.transport.local_rank)
        if found is not None:  # this step's vote carried the fingerprints of the step it names
            record["replicas"] = found
            if self.cfg.on_replicas_differ == "heal":
                self.leave = self._leaves(found)
            if found["differ"] and self.first_differ is None:
                self.first_differ = found["step"]
                if quorum.members and quorum.members[0] == self.transport.replica:  # said once, by the lead group
                    print(replica_check.warning(found["differ"], found["step"],
                                                f"the export is replica group {quorum.members[0]}'s"), flush=True)

    def _leaves(self, found: dict[str, Any]) -> str | None:
        """``--on-replicas-differ heal``: why this replica group leaves (one decision for the whole group: each worker
        compared its own counterparts), or None."""
        mine = self.rank in found["differ"]
        if self.transport.workers > 1:  # every worker of the group got a verdict from the same vote: all take part
            flag = torch.tensor([int(mine)], dtype=torch.int64, device=self.transport.device)
            self.transport.all_reduce(flag, "shard", op="max", name="replica_check")
            mine = bool(flag)
        return replica_check.heal_message(self.transport.replica, found["step"]) if mine else None

    def finish(self, strategy: Any) -> bool:
        self._retries, self.windows = self.quorum.retries, []
        if strategy.finish():
            return True
        self.finish_commits = self.dealer.take_commits()  # the last partial round synced without a step of its own
        return False

    def after_step(self, strategy: Any, stopping: bool, tokens_fed: int) -> None:
        if self.leave is not None:  # after its record: the step is committed and logged, the others go on
            raise replica_check.ReplicasDiffer(self.leave)
        flip_bit(strategy.steps, self.rank, strategy.module)  # QUIETSYNC_FLIP_BIT: a test's memory error

    def close(self, strategy: Any, result: dict[str, Any]) -> dict[str, Any]:
        self.state["finished"] = True  # part of the heal state: a late joiner sees the run ended
        totals = _totals(self.transport, result, result["tokens_logged"], strategy)
        if totals.pop("nonfinite_params"):
            raise NonFiniteError(f"the committed parameters after step {strategy.steps} are not finite on "
                                 f"{int(totals['nonfinite_workers'])} worker(s); the run is not exported")
        self.quorum.start_round()  # replicas waiting to join take the final state and stop
        self.quorum.unwatch()  # the export that follows is nobody's wait
        found = replica_check.with_why(totals.pop("replicas"), strategy)
        if self.cfg.check_replicas_every:
            found["first_differ_step"] = self.first_differ
        if (found.get("differ") and self.first_differ is None and self.quorum.members[0] == self.transport.replica
                and self.transport.local_rank == 0):
            print(replica_check.warning(found["differ"], strategy.steps,
                                        f"the export is replica group {self.quorum.members[0]}'s"), flush=True)
        return {"totals": totals, "finish_commits": self.finish_commits if self.audit else None, "replicas": found}

    def failure(self, error: Exception, strategy: Any) -> Exception | None:
        vote = None if isinstance(error, NonFiniteError) else dropped_in(error)
        if vote is None:
            return None
        self.guard.dropped(vote)  # a vote met outside a step (an outer sync, the run's end): stop
        return NonFiniteError(f"{vote} (--on-nonfinite {self.cfg.on_nonfinite})")


def run_replica(cfg: Any, strategy_config: StrategyConfig | None, replica: int, replicas: int,
                lighthouse: str) -> dict | None:
    """Train as one worker of replica group ``replica`` (of ``replicas``) against the Lighthouse at
    ``lighthouse``; the summary where this worker wrote it, else None."""
    t_setup = time.perf_counter()
    marks = {"process_start": process_started_unix(), "loop_start": time.time()}
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    keep_freed_memory()  # its first steps after a heal, which its peers wait for, fault no fresh pages
    transport = FaultTolerantTransport(replica, replicas, links=parse_links(cfg.link), timeout_s=cfg.timeout_s)
    quorum, strategy, store, metrics = None, None, None, None
    standby = getattr(cfg, "standby", None)
    try:
        host = advertised_host(lighthouse)

        def connect() -> tuple[Any, ReplicaQuorum]:
            address, server = replica_store(transport, host, cfg.timeout_s)
            manager = ReplicaQuorum(transport, lighthouse, address, timeout_s=cfg.timeout_s,
                                    quorum_timeout_s=quorum_timeout_s(cfg.timeout_s), hostname=host)
            marks["manager"] = time.time()
            return server, manager

        if not standby:  # heartbeats first: the Lighthouse sees every replica of a fresh job before its first quorum
            store, quorum = connect()
        data = open_job_data(cfg)  # prepared once (train/job_data.py), memory-mapped by every worker
        tokenizer, eos, train_tokens, eval_tokens = data.tokenizer, data.eos, data.train, data.eval
        too_small = data_problem(train_tokens.numel(), eval_tokens.numel(), cfg, replicas * transport.workers)
        if too_small:
            raise ValueError(too_small)
        marks["data"] = time.time()
        model = job_model(cfg, tokenizer.get_vocab_size(), eos, transport.device)
        vocab_size = model.config.vocab_size  # what trains, whatever --vocab-size said
        marks["model"] = time.time()
        warm_up(model, cfg, transport.device)
        marks["warm"] = time.time()
        n_params = count_parameters(model)
        field = accumulation_field(strategy_config)
        accumulation = int(getattr(strategy_config, field)) if field else 1
        # one reader (rank 0 of 1): the dealer hands its windows to the replicas
        reader = ShardedSequences(train_tokens, cfg.seq_len, cfg.micro_batch_size, 0, 1, cfg.seed)
        lag = int(getattr(strategy_config, "overlap_delay", 0) or 0)  # a commit lands up to τ steps late
        dealer = WindowDealer(reader, accumulation * cfg.micro_batch_size * transport.workers, replicas, lag)
        schedule = warmup_cosine(cfg.warmup, cfg.max_steps, cfg.min_lr_ratio)
        strategy = make_strategy(
            cfg.strategy, model, torch.optim.AdamW, param_groups=param_groups(model, cfg.weight_decay),
            transport=transport, config=strategy_config, lr_schedule=lambda step: schedule(dealer.position_at(step)),
            precision=cfg.precision, max_grad_norm=cfg.clip_norm, lr=cfg.lr, weight_decay=cfg.weight_decay,
            betas=ADAMW_BETAS)
        # everything that does not depend on the heal is ready before the join: a returning replica's peers wait
        # in their next collective from the moment its heal ends until its first step
        held_out = eval_batches(eval_tokens, cfg.seq_len, cfg.micro_batch_size, cfg.eval_windows)
        if standby:
            marks["standby"] = time.time()
            prepared = marks["standby"] - marks["loop_start"]
            print(f"quietsync: replica group {replica}: standing by (prepared {prepared:.1f} s after its imports); "
                  f"it joins when {standby} exists", flush=True)
            wait_for(standby)
            marks["activated"] = time.time()
            store, quorum = connect()
        state: dict[str, Any] = {"finished": False}
        quorum.register("strategy", lambda: heal_state(strategy), lambda s: load_heal_state(strategy, s))
        quorum.register("dealer", dealer.state_dict, dealer.load_state_dict)
        quorum.register("run", lambda: dict(state), state.update)
        quorum.on_commit(dealer.commit)
        quorum.async_join = cfg.async_join and async_join_problem(strategy) is None
        metrics = MetricsWriter(cfg.out, transport.topology.rank, append=True, sinks=open_sinks(
            cfg.log_with, cfg.out, transport.topology.rank, append=True,
            config={"config": job_record(cfg, vocab_size), "strategy_config": dataclasses.asdict(strategy.config)}))
        marks["ready"] = time.time()
        hold(0)  # a test's hold before the first quorum
        ready()
        healed = quorum.join()
        marks["joined"] = time.time()
        if not healed:  # a healed replica took a live peer's parameters
            check_same_start(strategy, transport)
        audit = os.environ.get(AUDIT_ENV, "") not in ("", "0")
        membership = TorchftQuorum(cfg, strategy, transport, quorum, dealer, state, healed, marks, audit)
        result = train_steps(cfg, strategy, membership, metrics, held_out, t_setup)
        if result is None:  # joined a run that had ended: nothing to do
            return None
        lead_group = quorum.members[0] == replica
        lead = lead_group and transport.local_rank == 0
        if cfg.export and lead_group:  # every worker of the group: sharded strategies gather the parameters
            with strategy.paused(), strategy.committed_params() as module:
                if lead:
                    export_model(module, tokenizer, os.path.join(cfg.out, MODEL_DIR))
        summary = None
        if lead:
            summary = _summary(cfg, strategy_config, membership, strategy, n_params, result, vocab_size)
            write_summary(cfg.out, summary)
            ft = summary["fault_tolerance"]
            print(f"quietsync train: --fault-tolerance torchft: {summary['steps']} steps, {summary['tokens']} tokens "
                  f"committed in {summary['wall_s']:.1f}s; last eval loss {summary['last_eval_loss']:.4f}; "
                  f"{heals_text(ft['heals'], ft['final_members'])}; results in {os.path.abspath(cfg.out)}",
                  flush=True)
        return summary
    except BaseException:
        note_failure()
        raise
    finally:
        if metrics is not None:
            metrics.close()
        if strategy is not None:
            strategy.close()
        if quorum is not None:
            quorum.shutdown()
        transport.close()
        del store  # the replica group's TCPStore server (rank 0) is kept alive until here


STANDBY_POLL_S = 0.01
"""How often a standby looks for its activation file (a stat call: no load)."""


def wait_for(path: str) -> None:
    """A standby's wait (``--standby PATH``): until the file ``PATH`` exists. It holds no connection meanwhile: the
    Lighthouse does not know it, so it never counts as a member, a straggler or a heal source."""
    while not os.path.exists(path):
        time.sleep(STANDBY_POLL_S)


def warm_up(model: torch.nn.Module, cfg: Any, device: torch.device) -> None:
    """One forward and backward of a micro-batch's shape on the bare model (before the strategy wraps it), its
    gradient dropped and the random state left as it was: the first step's one-time costs (the allocator's first
    buffers, autograd's first graph, lazy initialisation, ``--compile``'s compilation) are paid before this replica
    asks to join, while the others train -- not in its first step, in whose collective they wait for it. On the
    goodput benchmark's model a fresh process's first step took ~30 ms more than its second."""
    batch = torch.zeros((cfg.micro_batch_size, cfg.seq_len), dtype=torch.long, device=device)
    # only this GPU's RNG (fork_rng otherwise forks every visible device's)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with parse_precision(cfg.precision).autocast(device.type):
            loss = lm_loss(model, batch)
        loss.backward()
    for p in model.parameters():
        p.grad = None


def check_same_start(strategy: Any, transport: FaultTolerantTransport) -> None:
    """Replicas of a fresh job must start from the same parameters (every replica builds its model from the same
    seed; no initial broadcast crosses replicas): one all-reduce of each replica's parameter checksum checks it."""
    with torch.no_grad():
        total = sum(float(p.detach().double().sum()) for p in strategy.module.parameters())
    # max of x and of -x in one all-reduce: their sum is max - min, 0 when every replica agrees
    sums = torch.tensor([total, -total], dtype=torch.float64, device=transport.device)
    transport.all_reduce(sums, "replicate", op="max", name="start_check")
    if abs(float(sums[0]) + float(sums[1])) > 1e-9 * max(1.0, abs(total)):
        raise ValueError("the replica groups start from different parameters (build the model from the same seed "
                         "on every replica group: --seed, the same --model)")


def _totals(transport: FaultTolerantTransport, sums: dict[str, float], tokens: int, strategy: Any) -> dict[str, Any]:
    """Every present replica's counters summed (inside the replica group, then across the replicas), in the form
    of :func:`quietsync.train.loop.job_summary`'s totals but ``micro_batches`` (:func:`_summary` counts the
    committed ones), and ``nonfinite_params``: whether any worker's committed parameters are not finite (the same on
    every replica: one all-reduce)."""
    snap = transport.meter.snapshot()
    keys = [(g, d) for g in GROUPS for d in ("sent", "recv")]
    flag, mark = finite_and_fingerprint(strategy)
    values = [float(tokens), flag, *(float(sums[k]) for k in STEP_SUMS)]
    values += [float(snap.get(g, {}).get(d, 0)) for g, d in keys]
    heals = [0.0] * transport.replicas  # this group's own heals, at its index (one worker of the group counts them)
    if transport.local_rank == 0 and transport.quorum is not None:
        heals[transport.replica] = float(transport.quorum.healed)
    values += heals
    workers = transport.replicas * transport.workers
    values += replica_check.slots(mark, transport.replica * transport.workers + transport.local_rank, workers)
    t = torch.tensor(values, dtype=torch.float64, device=transport.device)
    if transport.workers > 1:
        transport.all_reduce(t, "shard", op="sum", name="summary")
    transport.all_reduce(t, "replicate", op="sum", name="summary")
    v = t.tolist()
    found = replica_check.verdict_of_slots(v[len(v) - 3 * workers:])
    v = v[: len(v) - 3 * workers]
    by_group = {g: {"sent": 0, "recv": 0} for g in GROUPS}
    for (g, d), x in zip(keys, v[2 + len(STEP_SUMS):]):
        by_group[g][d] = int(x)
    return {"tokens": int(v[0]), "nonfinite_params": v[1] > 0,
            "nonfinite_workers": v[1], **dict(zip(STEP_SUMS, v[2:2 + len(STEP_SUMS)])),
            "bytes_by_group": {g: c for g, c in by_group.items() if c["sent"] or c["recv"]},
            "heals": [int(x) for x in v[len(v) - transport.replicas:]], "replicas": found}


def _summary(cfg: Any, strategy_config: StrategyConfig | None, membership: TorchftQuorum, strategy: Any, n_params: int,
             result: dict[str, Any], vocab_size: int | None = None) -> dict[str, Any]:
    """``summary.json``: :func:`quietsync.train.loop.job_summary`'s fields (counters summed over the replicas
    present at the end; ``tokens`` and ``micro_batches`` the committed ones) and ``fault_tolerance``."""
    quorum, dealer, transport = membership.quorum, membership.dealer, membership.transport
    totals = dict(result["totals"])
    fed = totals["tokens"]
    totals["tokens"] = dealer.committed * cfg.seq_len
    # the micro-batches the whole job committed (every replica group, every incarnation), as tokens: a strategy's
    # own count starts at 0 in a restarted replica and dies with a killed one; the dealer's count heals
    totals["micro_batches"] = dealer.committed // cfg.micro_batch_size
    summary = job_summary(cfg, strategy, strategy_config, transport.topology, n_params,
                          {**result, "stopped_by": "max_steps"}, totals, vocab_size)  # torchft: no other budgets
    summary["fault_tolerance"] = {
        "engine": "torchft", "replicas": transport.replicas, "final_members": quorum.members,
        "schedule_position": dealer.position(), "windows_committed": dealer.committed,
        "windows_dealt": dealer.fresh, "windows_held": dealer.held(),
        "commits": quorum.commits, "tokens_fed_by_present_replicas": fed,
        "finish_commits": result["finish_commits"], "heals": totals["heals"],
    }
    return summary


def heals_text(heals: list[int], present: Sequence[int] | None = None) -> str:
    """``replica group 1 healed 1 time`` (every group that healed, as the groups present at the end count their
    own heals), or ``no replica group healed``; a group not in ``present`` (the final quorum's groups) is named as
    absent, since its heals died with it."""
    absent = [k for k in range(len(heals)) if present is not None and k not in present]
    said = [f"replica group {k} healed {n} time{'s' if n > 1 else ''}" for k, n in enumerate(heals)
            if n and k not in absent]
    text = ", ".join(said) if said else "no replica group present at the end healed" if absent else \
        "no replica group healed"
    if absent:
        text += f" (replica group{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} not present at the end)"
    return text


__all__ = ["HOST_ENV", "QUORUM_TIMEOUT_S", "STANDBY_POLL_S", "advertised_host", "check_same_start",
           "heals_text", "replica_store", "run_replica", "wait_for", "warm_up"]
