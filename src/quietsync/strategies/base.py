"""The strategy contract: what every quietsync strategy offers a training loop.

A **strategy** decides how and when gradients or parameters cross the network and when the optimizer
runs. The user loop stays an ordinary PyTorch loop::

    strategy = quietsync.make_strategy("zero1", model, torch.optim.AdamW, lr=6e-4, weight_decay=0.1)
    for batch in loader:
        strategy.forward_backward(batch, loss_fn)  # one micro-batch: loss_fn(strategy.model, batch), backward
        if strategy.step():                        # a committed optimizer step happened
            log(strategy.last_step_metrics())
    strategy.finish()                      # every worker: the last round synced or drained (see finish)
    with strategy.committed_params():      # evaluation and checkpoints see the real parameters
        evaluate(strategy.model)
    strategy.close()

Gradient convention: the gradient a step applies is the **sum over micro-batches of the per-micro-batch
loss gradients, divided by the global micro-batch count**, so workers that contributed more weigh more.

Subclasses implement :meth:`_step`, and optionally :meth:`_backward`, :meth:`_state`/:meth:`_load_state`,
:meth:`committed_params` and :meth:`_close` (``docs/contract.md`` lists what a strategy author needs, with a
small tested example). What several strategies share is not inherited but **held**: small
:class:`~quietsync.strategies.parts.part.Part` objects (the sharded flat state, the overlap machinery, an LR
scaler, an accumulator) registered with :meth:`hold` are checkpointed, reported in :meth:`memory_report` and
closed with the strategy. A micro-batch reaches a strategy one way: :meth:`forward_backward` (the default runs
``loss_fn`` and hands the loss to :meth:`_backward`); a strategy that schedules forward and backward itself
(``owns_schedule``: Cyclic DP) overrides :meth:`forward_backward` and refuses :meth:`backward`. Time and bytes
are accounted by the :class:`~quietsync.strategies.parts.accounting.StepAccounting` every strategy holds as
``self.accounting``, restarted once construction returns (set-up traffic such as the initial broadcast belongs
to no step):
``compute_s`` is the main thread's time between strategy calls plus inside ``backward`` (forward, backward,
data loading), ``idle_s`` the time it spent blocked on communication (strategies wrap such waits in
``self.accounting.idle(...)``), ``comm_s`` the seconds collectives took (on any thread), bytes from the
transport's meter.

Precision and clipping (what a real run needs from every strategy): ``precision`` (``"fp32"``, ``"bf16"``,
``"fp16"``; :mod:`~quietsync.strategies.parts.precision`) runs the forward under :meth:`autocast` and, for fp16,
scales each loss and drops a round whose gradient overflowed on every worker; ``max_grad_norm`` clips the
gradient a strategy commits by that gradient's global norm (:mod:`~quietsync.strategies.parts.clipping`). Both
are the strategy's, not the loop's, because only the strategy holds the gradient it commits (averaged, sharded,
or on its communication thread); every front door (the CLI, a plain loop, Accelerate, the Trainer) sets them
here. Which gradient each strategy clips is listed in ``docs/contract.md``.

Ending a run: :meth:`finish` is the one call that ends training, the same for every strategy — a collective
every worker makes once, after its last :meth:`step`, before the final evaluation or export. Local methods
sync their last partial round, overlapped methods drain the round in flight; afterwards ``self.model`` holds
the committed parameters on every worker. :meth:`close` only releases resources (it runs on failure paths too,
where a collective could wait on a dead peer), so it never communicates to finish a run.

Checkpoints: :meth:`state_dict` records the worker's :meth:`position` (committed steps and the strategy's
stage counters); :meth:`load_state_dict` compares it across workers and refuses, on every worker, a
checkpoint whose files were saved at different positions. Take checkpoints at the same position on every
worker — right after ``step()`` returned True on all of them, as the trainer does. Strategies whose state
has a world-size-independent form (``reshard_refusal is None``: every strategy but cdp) also offer
:meth:`logical_state_dict`/:meth:`load_logical_state_dict` (see
:mod:`~quietsync.strategies.checkpoint.logical`), which the trainer writes through
``torch.distributed.checkpoint`` so a job can resume on another number of workers.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from abc import ABCMeta, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, TypeVar

import torch

from ..events import label
from ..flat import normalize_param_groups
from ..transport import Transport
from .checkpoint.logical import Reader, ReshardError, SavedTensors, open_round_problem
from .checkpoint.positions import check_positions_agree
from .config import StrategyConfig, config_from_dict
from .declaration import Declaration
from .parts.accounting import StepAccounting, StepMetrics
from .parts.buffers import ModuleBuffers
from .parts.clipping import GradientCheck, check_max_grad_norm, prepare_gradient
from .parts.part import Part
from .parts.precision import LossScaler, Precision, check_model_dtype, parse_precision

LRSchedule = Callable[[int], float]
"""``f(committed_steps) -> multiplier`` of each parameter group's base learning rate."""

P = TypeVar("P", bound="Part | Strategy")

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
"""``loss_fn(model, batch) -> scalar loss`` of one micro-batch (see :meth:`Strategy.forward_backward`)."""


class _Constructed(ABCMeta):
    """Ends set-up once a strategy's constructor has returned: its step accounting restarts, so set-up traffic
    (the initial broadcast, FSDP2's first gathers) and time count toward no step."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        strategy = super().__call__(*args, **kwargs)
        # only now: the parts that prepare the gradient are held by the subclass's constructor
        problem = strategy._unprepared_knobs()
        if problem:
            # release what the constructor opened (an owned transport, background work) before refusing
            strategy.close()
            raise ValueError(problem)
        strategy.accounting.reset()
        return strategy


class Strategy(metaclass=_Constructed):
    """Base class of every strategy (see the module docstring for the contract).

    Args:
        model: the model, already on its device. Strategies may move its parameters into flat buffers
            (``p.data`` becomes a view), so do not call ``model.to`` afterwards.
        optimizer: a ``torch.optim.Optimizer`` subclass (or a factory ``f(param_groups, **kwargs)``).
        param_groups: torch-style parameter groups of ``model``'s parameters (e.g. a no-weight-decay group);
            default: one group of all trainable parameters.
        transport: the transport to communicate through; default ``Transport()`` from the environment.
        config: this strategy's config dataclass (or a dict of its fields); default: its defaults.
        lr_schedule: ``f(committed_steps) -> lr multiplier``, applied before every optimizer step.
        precision: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"`` (or a
            :class:`~quietsync.strategies.parts.precision.Precision` with other loss-scaling constants): the
            forward runs under :meth:`autocast`; fp16 adds dynamic loss scaling with a skip decision every worker
            shares. The model's trainable parameters must be fp32 for bf16/fp16 (they stay the master weights).
        max_grad_norm: clip the gradient each step commits to this global L2 norm (None: no clipping); the
            pre-clip norm is reported in ``last_step_metrics().extra["grad_norm"]``.
        **optimizer_kwargs: passed to ``optimizer`` (``lr``, ``weight_decay``, ...).

    Raises:
        TypeError / ValueError: on a bad argument, at construction, naming it.
    """

    name: ClassVar[str] = ""
    config_cls: ClassVar[type[StrategyConfig]] = StrategyConfig
    declaration: ClassVar[Declaration] = Declaration()
    """What the rest of the house must know of it (set by ``@register(..., facts=...)``)."""
    resumable: ClassVar[bool] = True
    """Whether :meth:`state_dict` works between committed steps of a running job (the trainer's
    ``--save-every``/``--resume``); a strategy that keeps micro-batches in flight across steps sets False."""

    reshard_refusal: ClassVar[str | None] = "its state has no world-size-independent form yet"
    """Why a checkpoint of this strategy cannot be loaded on another number of workers; ``None`` where it can
    (the strategy implements :meth:`_logical_state`, :meth:`_logical_targets` and :meth:`_load_logical`; which
    node counts it accepts, :meth:`reshard_problem` says)."""

    discards_rounds: ClassVar[bool] = False
    """Whether the open round can be dropped before it commits (:meth:`discard_round`, the trainer's
    ``--on-nonfinite skip``): strategies whose step commits a round of local micro-batches they hold (their
    round part reports :attr:`~quietsync.strategies.parts.part.Part.round_full`)."""

    local_rounds: ClassVar[bool] = False
    """Whether a round may commit without communicating across the workers: local methods (localsgd, diloco —
    hierarchical included, whose inner ddp/zero1 talks inside a node only), whose workers meet only at their
    syncs. Set for the whole strategy, not per round (a sync round also counts): a caller that would add a
    collective of its own to every round — the trainer's non-finite agreement under ``--on-nonfinite stop`` —
    checks the round on each worker instead, so that no cross-node round trip is added to every inner step."""

    @property
    def meeting_period(self) -> int:
        """Committed steps between the steps at which a caller may add a collective of its own across all workers
        without adding a barrier the strategy does not have (the trainer's agreement on ``--max-tokens`` and
        ``--max-time-s``): 1 where every round is collective; a local method's sync period H (its workers meet at
        its syncs, at least one of which falls in every H steps)."""
        return 1

    owns_schedule: ClassVar[bool] = False
    """Whether the strategy schedules forward and backward itself (it overrides :meth:`forward_backward`, and
    :meth:`backward` with a loss computed outside is refused): Cyclic DP runs different micro-batches at
    different stages at once."""

    finish_policy: ClassVar[str] = (
        "nothing is in flight: every committed step is in the model; micro-batches fed since the last committed "
        "step (an open accumulation round) are not applied"
    )
    """What :meth:`finish` does for this strategy, in one sentence (docs and ``--help`` quote it)."""

    buffer_sync: ClassVar[str] = "commit"
    """How the model's running statistics (BatchNorm-style buffers the forward updates; see
    :mod:`~quietsync.strategies.parts.buffers`) stay equal across replicas: ``commit`` — averaged at every
    committed step; ``local`` — the strategy averages them at its own parameter syncs (localsgd, diloco); ``ddp``
    — torch DDP broadcasts rank 0's before every forward; ``refuse`` — a model that has them is refused (cdp).
    Persistent buffers are broadcast from rank 0 at construction in every case (``ddp``: by torch DDP)."""

    lockstep: ClassVar[bool] = True
    """Whether every worker reaches each step after the same number of micro-batches, so that a loop may stop,
    or communicate (a data loader broadcasting batches, a metrics gather), between any two micro-batches. False
    where workers drift apart: acco/dpu/wp, whose workers each end a stage when *they* see the job done. Feed
    those from each worker's own data, with no collective between micro-batches, and stop on a committed step
    (or on ``steps + steps_in_flight``) or after a number of micro-batches; :meth:`finish` brings drifted workers
    level. A config may also make the workers step unevenly (adaptive inner steps): :meth:`steps_together` asks
    both."""
    loop_collectives: bool = False
    """Whether the loop that drives this strategy runs collectives of its own between steps, set by the front
    door that knows (``QuietTrainer``: the HF Trainer gathers token counts before each step and the loss at its
    logging steps). A strategy whose workers are not in ``lockstep`` must then never wait inside :meth:`step` for
    a job that a peer submits only in a later step: that peer may be waiting in the loop's collective for this
    worker (acco turns its straggler rule off)."""
    fp16_refusal: ClassVar[str | None] = None
    """Why this strategy cannot train with ``precision="fp16"`` (dynamic loss scaling needs one skip decision
    that every worker takes before anything of the round commits); None where it can."""

    prepares_gradient: ClassVar[bool] = False
    """Whether the strategy unscales (fp16) and clips (``max_grad_norm``) the gradient it commits itself (it calls
    :meth:`_prepare_commit`, or its jobs ``prepare_gradient``). A strategy that neither does so nor holds a part
    that does (the ``Replicated`` substrate) is refused ``max_grad_norm`` and ``precision="fp16"`` at construction,
    so neither knob is ever silently ignored."""

    optimizer: torch.optim.Optimizer | None
    """The torch optimizer that steps this worker's parameters or shard (the user's class, built by the
    strategy); the adapters show its ``param_groups``. Every strategy sets it in its constructor."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        param_groups: list[dict[str, Any]] | None = None,
        transport: Transport | None = None,
        config: StrategyConfig | dict[str, Any] | None = None,
        lr_schedule: LRSchedule | None = None,
        precision: str | Precision = "fp32",
        max_grad_norm: float | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.precision = parse_precision(precision)
        """The mixed-precision policy (``self.precision.name``: fp32, bf16 or fp16)."""
        if self.precision.loss_scaling and self.fp16_problem():
            raise ValueError(self.fp16_problem())
        check_model_dtype(model, self.precision)
        self._max_grad_norm = check_max_grad_norm(max_grad_norm)
        if not callable(optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer class or factory, got {optimizer!r}")
        if lr_schedule is not None and not callable(lr_schedule):
            raise TypeError("lr_schedule must be a callable f(step) -> multiplier")
        if isinstance(config, dict):
            config = config_from_dict(self.config_cls, config)
        if config is None:
            config = self.config_cls()
        if not isinstance(config, self.config_cls):
            raise TypeError(f"config must be a {self.config_cls.__name__}, got {type(config).__name__}")
        # its own copy: --adapt re-picks knobs in it during the run, the caller's (the flags as given) stays as given
        self.config = copy.copy(config)
        self.module = model
        self.optimizer_factory = optimizer
        self.optimizer_kwargs = dict(optimizer_kwargs)
        self.param_groups = self._check_groups(model, param_groups)
        self._owns_transport = transport is None
        self.transport = transport if transport is not None else Transport()
        self.lr_schedule = lr_schedule
        self.base_lr = float(self.param_groups[0].get("lr", self.optimizer_kwargs.get("lr", 0.0)))
        """The first group's lr before any schedule (optimizers share and rescale the group dicts later)."""
        self.steps = 0
        """Committed optimizer steps."""
        self.micro_batches = 0
        """Micro-batches this worker has computed in total."""
        self.accounting = StepAccounting(self.transport)
        """Time and bytes of the current step (see :mod:`~quietsync.strategies.parts.accounting`)."""
        self.optimizer = None
        self._parts: dict[str, Part] = {}
        self._closed = False
        self._finished = False
        self._last_metrics: StepMetrics | None = None
        # under buffer_sync "ddp", torch DDP broadcasts the buffers itself
        self.buffers = self.hold("buffers", ModuleBuffers(model, self.transport, broadcast=self.buffer_sync != "ddp"))
        """The model's buffers across replicas (running statistics averaged per :attr:`buffer_sync`)."""
        if self.buffer_sync == "refuse" and self.buffers.running:
            raise ValueError(
                f"strategy {self.name} cannot keep the module buffer {self.buffers.names[0]!r} (running statistics "
                "the forward updates) equal across replicas: use a model without them (e.g. GroupNorm or LayerNorm, "
                "or track_running_stats=False)"
            )
        self.scaler: LossScaler | None = None
        """fp16's dynamic loss scale (a held part), None otherwise (or where an inner strategy scales)."""
        if self.precision.loss_scaling and self._scales_own_loss():
            self.scaler = self.hold("loss_scale", LossScaler(self.precision))

    # ------------------------------------------------------------------ the contract
    @property
    def model(self) -> torch.nn.Module:
        """The module to call forward on (a wrapper, for strategies that need one)."""
        return self.module

    @property
    def max_grad_norm(self) -> float | None:
        """Clip the committed gradient to this global norm (None: off); settable between steps."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        value = check_max_grad_norm(value)
        if value is not None and not self._prepares_gradient():
            raise ValueError(self._unprepared("max_grad_norm"))
        self._max_grad_norm = value

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision's autocast on the strategy's device (a do-nothing context for fp32).
        :meth:`forward_backward` runs ``loss_fn`` inside it; a loop that calls the model itself and hands the loss
        to :meth:`backward` wraps its forward in it (Accelerate and the Trainer use their own, the same)."""
        return self.precision.autocast(self.transport.device.type)

    @property
    def world_size(self) -> int:
        return self.transport.topology.world_size

    @property
    def rank(self) -> int:
        return self.transport.topology.rank

    def forward_backward(self, batch: Any, loss_fn: LossFn) -> torch.Tensor | None:
        """Run one micro-batch: ``loss = loss_fn(self.model, batch)``, then :meth:`backward`.

        This is the call a trainer makes per micro-batch. The default is the ordinary forward-then-backward;
        a strategy that must schedule forward and backward itself (Cyclic DP runs different micro-batches at
        different stages at once) overrides it. Returns the detached loss of the micro-batch(es) whose
        backward completed in this call, or None when none did (a strategy filling its pipeline).
        """
        self._check_training()
        with label("quietsync/forward"), self.autocast():
            loss = loss_fn(self.model, batch)
        self.backward(loss)
        return loss.detach()

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate one micro-batch's loss and accumulate its gradient locally."""
        self._check_training()
        if self.owns_schedule:
            raise RuntimeError(
                f"strategy {self.name} schedules forward and backward itself: feed each micro-batch "
                "with forward_backward(batch, loss_fn), not backward(loss)"
            )
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("loss must be a scalar tensor")
        if self.scaler is not None:
            loss = self.scaler.scale_loss(loss)
        with label("quietsync/backward"):
            self._backward(loss)
        self.accounting.micro_batch_done()
        self.micro_batches += 1

    def step(self) -> bool:
        """Called after every :meth:`backward`; returns True when a committed optimizer step happened."""
        self._check_training()
        # Main-thread time since the last strategy call (e.g. a simulated slow worker's sleep) is compute.
        self.accounting.lap()
        with label("quietsync/step"):
            committed = self._step()
        # restart the clock: the strategy booked its time inside _step itself (add_compute, idle)
        self.accounting.mark = time.perf_counter()
        return committed

    @property
    def round_closes(self) -> bool | None:
        """Whether the next :meth:`step` commits (the open round is full), for strategies that know it before
        stepping (those holding a round part with ``full``, or an inner strategy that does: ddp, zero1, demo,
        flexdemo, localsgd, diloco); ``None`` where a commit is decided inside the step or the schedule (acco,
        dpu, wp, cdp)."""
        if not self.discards_rounds:
            return None
        for part in self._parts.values():
            if part.round_full is not None:
                return part.round_full
        raise RuntimeError(f"{type(self).__name__}.discards_rounds is set but it holds no round part")

    @property
    def steps_in_flight(self) -> int:
        """Committed steps :meth:`finish` would add if called now: 1 while an update is being computed that
        finish applies (dpu and wp after their first overlapped stage, acco during its stage 2), else 0. A loop
        with a step budget stops once ``steps + steps_in_flight`` reaches it, so that after finish the model
        holds exactly the budget (the trainer's ``--max-steps`` does)."""
        return 0

    def settle(self) -> None:
        """Wait for every exchange the strategy runs in the background (streaming DiLoCo's fragment in flight);
        what it computes is applied when it was due, as without the wait. Under ``--fault-tolerance torchft`` a
        replica alone settles before its quorum ticks, so no two threads commit at once."""
        for part in self._parts.values():
            part.quiesce()

    @property
    def finished(self) -> bool:
        """Whether :meth:`finish` ran (training calls are refused from then on)."""
        return self._finished

    def finish(self, sync: bool = True) -> int:
        """End training cleanly, the same call for every strategy; returns the committed steps it added.

        A collective: every worker calls it once, after its last :meth:`step` — the loop stops on the same
        committed step everywhere, or after the same number of micro-batches — and before the final evaluation,
        export or :meth:`close`. What it does is the strategy's :attr:`finish_policy`:

        * local methods (``localsgd``, ``diloco``): the last partial round — local steps since the last sync —
          is synced once more, so the committed and exported model holds every step; ``sync=False`` skips that
          sync and resets every worker's model to the last agreed parameters instead (those steps are dropped);
        * overlapped methods (``acco``, ``dpu``, ``wp``): the round in flight is drained — an update already
          computing is waited for and committed (one more step, see :attr:`steps_in_flight`), gradients that
          would only enter a later update are dropped;
        * ``cdp``: micro-batches in flight are dropped;
        * the others: nothing is in flight.

        Afterwards ``self.model`` holds the committed parameters on every worker (``committed_params()`` shows
        the same values), :meth:`forward_backward`, :meth:`backward`, :meth:`step` and :meth:`discard_round`
        raise, and evaluation, :meth:`state_dict` and :meth:`close` work. Calling it again does nothing.
        ``sync`` only matters to the local methods.
        """
        self._check_open()
        if self._finished:
            return 0
        if not isinstance(sync, bool):
            raise TypeError(f"sync must be a bool, got {sync!r}")
        try:
            return self._drain("quietsync/finish", lambda: self._finish(sync))
        finally:
            self._finished = True

    def level(self) -> int:
        """Bring the workers level with nothing in flight, and go on training; returns the committed steps it added.

        For a front door that saves or evaluates between two steps (``QuietTrainer``'s checkpoints and
        evaluations). Workers in :attr:`lockstep` are level after every step: nothing to do. Workers that drift
        apart may be a stage apart, each waiting on a job the other has not submitted yet, so a checkpoint's or an
        evaluation's collectives would interleave with those jobs; this runs the strategy's :meth:`_level` (a
        worker a stage behind ends that stage and the round in flight is committed, as :meth:`finish` does, without
        ending the run), and training goes on from a refilled pipeline, as after a resume. A collective: every worker
        calls it at the same point of the loop, which must have declared :attr:`loop_collectives` (a worker
        waiting inside a step for a peer already in here would wait forever).

        Raises:
            RuntimeError: a strategy not in lockstep whose :attr:`loop_collectives` is False.
        """
        self._check_training()
        if self.steps_together(self.config):
            return 0
        if not self.loop_collectives:
            raise RuntimeError(
                f"level() is a collective between two steps: set loop_collectives = True on the {self.name} strategy "
                "before training (QuietOptimizer(loop_collectives=True)), so that no worker waits inside a step for a "
                "peer already in level()"
            )
        return self._drain("quietsync/level", self._level)

    def _drain(self, name: str, end: Callable[[], None]) -> int:
        """``end()`` outside the main thread's compute accounting, labelled ``name``; the steps it added."""
        before = self.steps
        self.accounting.lap()
        try:
            with label(name):
                end()
        finally:
            self.accounting.mark = time.perf_counter()
        return self.steps - before

    def discard_round(self) -> None:
        """Drop the open round on this worker as if its micro-batches had never been fed: gradients zeroed in
        place, round counters reset; nothing is committed and the lr schedule does not advance. Every worker
        must call it for the same round (the trainer's ``--on-nonfinite skip`` agrees first). Their compute
        time and bytes count toward the next committed step's metrics."""
        self._check_training()
        if self.round_closes is None:
            raise NotImplementedError(
                f"{type(self).__name__} cannot discard a round (its commits are decided inside the step)"
            )
        with torch.no_grad():
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.zero_()  # in place: DDP's gradient buckets view p.grad
        for part in self._parts.values():
            part.discard()
        self._discard()

    @contextmanager
    def waiting(self, name: str) -> Iterator[None]:
        """Account the enclosed main-thread time as idle: blocked on communication the caller issues outside
        the strategy (the trainer's agreement on non-finite values); it counts toward the next committed step.
        """
        self._check_open()
        self.accounting.lap()
        try:
            with self.accounting.idle(name):
                yield
        finally:
            self.accounting.mark = time.perf_counter()

    def last_step_metrics(self) -> StepMetrics | None:
        """Metrics of the latest committed step (None before the first)."""
        return self._last_metrics

    @contextmanager
    def committed_params(self) -> Iterator[torch.nn.Module]:
        """Within this context ``self.model`` holds the committed parameters θ (not an estimate)."""
        yield self.model

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the enclosed main-thread time (evaluation, checkpointing, logging) out of ``compute_s``.

        Background communication keeps running; only the accounting of the main thread pauses.
        """
        self._check_open()
        self.accounting.lap()
        try:
            yield
        finally:
            self.accounting.mark = time.perf_counter()

    def parameters_overwritten(self) -> None:
        """The model's parameters were overwritten from outside the strategy (an outer loop running this one
        as its inner strategy, e.g. DiLoCo's merge): a strategy that keeps its own copy of them re-reads it
        here."""

    def current_lr(self) -> float:
        """The lr the next committed step uses for the first parameter group."""
        return self.base_lr * self._lr_scale(self.steps)

    def position(self) -> dict[str, int]:
        """Where this worker is in the algorithm: committed steps plus the strategy's own stage counters.

        Workers of one job must save checkpoints at the same position (e.g. right after ``step()`` returned
        True on all of them); :meth:`load_state_dict` checks that across workers.
        """
        return {"steps": self.steps, **self._from_parts(lambda part: part.position()), **self._position()}

    def memory_report(self) -> dict[str, int]:
        """Bytes of every buffer this worker holds for the strategy (parameters, gradients, optimizer state,
        communication buffers), one entry each."""
        return {**self._from_parts(lambda part: part.memory_report()), **self._memory()}

    def summary(self) -> dict[str, str]:
        """Lines the run's summary shows about what the strategy did (label: value), from its held parts: e.g.
        adaptive inner steps, each worker's inner steps. The same on every worker (from agreed numbers)."""
        return self._from_parts(lambda part: part.summary())

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume this worker exactly (model, optimizer shard, pending buffers).

        Held parts save first, in reverse order of holding (a part holding background work quiesces it before
        the parts it builds on are read), then the strategy's own :meth:`_state`.
        """
        parts = {name: self._parts[name].state_dict() for name in reversed(self._parts)}
        return {
            "strategy": self.name,
            "world_size": self.world_size,
            "steps": self.steps,
            "micro_batches": self.micro_batches,
            "position": self.position(),
            "config": dataclasses.asdict(self.config),
            "parts": parts,
            "state": self._state(),
        }

    def load_state_dict(self, state: dict[str, Any], *, check_positions: bool = True) -> None:
        """Resume from :meth:`state_dict`. Every worker of the job must call it (it checks, with one
        collective over ``world``, that all workers saved at the same :meth:`position`); a rejected checkpoint
        raises on every worker, never hangs the others. ``check_positions=False`` skips that collective (one
        replica taking a live peer's state under torchft: the peer's position is the quorum's)."""
        problem = None
        if state.get("strategy") != self.name:
            problem = f"checkpoint is for strategy {state.get('strategy')!r}, not {self.name!r}"
        elif state.get("world_size") != self.world_size:
            problem = (f"checkpoint was saved with world size {state.get('world_size')}, "
                       f"this run has {self.world_size}")
        elif set(state.get("position", {})) != set(self.position()):
            problem = (f"checkpoint position {state.get('position')} does not have this strategy's counters "
                       f"{sorted(self.position())}")
        position = state.get("position", {}) if problem is None else {}
        # this worker joins the all-gather even with a problem of its own, so its peers raise instead of hanging
        if check_positions:
            check_positions_agree(self.transport, self.position(), position, problem)
        elif problem:
            raise ValueError(problem)
        self.steps = int(state["steps"])
        self.micro_batches = int(state["micro_batches"])
        for name, part in self._parts.items():
            if isinstance(part, _HeldStrategy):  # an inner strategy checks (or not) as its outer one does
                part.strategy.load_state_dict(state["parts"].get(name, {}), check_positions=check_positions)
            else:
                part.load_state_dict(state["parts"].get(name, {}))
        self._load_state(state["state"])

    def logical_state_dict(self) -> dict[str, torch.Tensor]:
        """This worker's part of the world-size-independent state (see
        :mod:`~quietsync.strategies.checkpoint.logical`): tensors (some DTensors) by logical name, for
        ``torch.distributed.checkpoint.save`` on every worker.

        Raises :class:`~quietsync.strategies.checkpoint.logical.ReshardError` where the strategy cannot be
        resharded (:attr:`reshard_refusal`) or a round is open (save right after ``step()`` returned True).
        """
        self._check_reshardable()
        problem = open_round_problem(self.name, self._open_round())
        if problem:
            raise ReshardError(problem)
        return {"steps": torch.tensor(self.steps, dtype=torch.int64), **self._logical_state()}

    def load_logical_state_dict(self, saved: SavedTensors, read: Reader) -> None:
        """Resume from a logical checkpoint of any world size. ``saved`` lists its tensors (``{key: (shape,
        dtype)}``); ``read(targets)`` fills tensors laid out for this worker (a collective: every worker of
        the job calls this). The open round starts empty; ``micro_batches`` (a per-worker count) is left to
        the caller."""
        self._check_reshardable()
        targets = {"steps": torch.zeros((), dtype=torch.int64), **self._logical_targets(saved)}
        missing = sorted(k for k in targets if k not in saved)
        if missing:
            raise ReshardError(
                f"the checkpoint lacks {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                f"(was it written by strategy {self.name} on this model?)"
            )
        read(targets)
        self.steps = int(targets["steps"])
        self._load_logical(targets)

    @classmethod
    def reshard_problem(cls, saved_nodes: int | None, nodes: int | None) -> str | None:
        """Why a checkpoint this strategy wrote on ``saved_nodes`` nodes cannot be loaded on ``nodes`` nodes
        and any number of workers (None: it can; None for either count: unknown, not checked). By default
        :attr:`reshard_refusal`; a strategy whose state is tied to the node count adds that (``flexdemo``)."""
        return cls.reshard_refusal

    def rejoin(self) -> None:
        """Make this strategy a returning replica's, right after it loaded a live peer's :meth:`state_dict` at a
        round boundary (``--fault-tolerance torchft``'s heal): what it owes the others starts empty and what
        drifts between syncs starts from the agreed state, as its checkpoint's :data:`join rule
        <quietsync.strategies.checkpoint.replicas.JoinRule>` has a joining worker do. By default nothing: the
        peer's state is this replica's exactly (every replica holds the same)."""

    @classmethod
    def steps_together(cls, config: StrategyConfig) -> bool:
        """Whether the workers of this strategy with ``config`` reach each step together, so that a loop may stop or
        communicate between any two steps: :attr:`lockstep`, and a config that calls :meth:`step` as often on every
        worker (``StrategyConfig.uneven_steps`` None; adaptive inner steps give a slow worker fewer)."""
        return cls.lockstep and config.uneven_steps() is None

    @classmethod
    def fp16_problem(cls) -> str | None:
        """Why this strategy refuses ``precision fp16`` (one line, from :attr:`fp16_refusal`), or None."""
        if not cls.fp16_refusal:
            return None
        return f"precision fp16 is not supported by strategy {cls.name}: {cls.fp16_refusal}; use bf16 or fp32"

    def close(self) -> None:
        """Stop background work and release this strategy's resources; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._close()
            for part in reversed(list(self._parts.values())):
                part.close()
        finally:
            if self._owns_transport:
                self.transport.close()

    def __enter__(self) -> Strategy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ for subclasses
    def _backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward: by default handed to the first held part that takes losses (the round part
        or substrate that accumulates the round's gradient), else plain autograd. A strategy that must do more
        around it (DDP's sync flag, FSDP2's reshard decision) overrides it."""
        for part in self._parts.values():
            if part.backward(loss):
                return
        loss.backward()

    @abstractmethod
    def _step(self) -> bool: ...

    def _finish(self, sync: bool) -> None:
        """What :meth:`finish` does for this strategy (see :attr:`finish_policy`); the default: nothing."""

    def _level(self) -> None:
        """What :meth:`level` does for a strategy not in lockstep; the default: what :meth:`finish` does (it must
        then leave a state that training goes on from)."""
        self._finish(True)

    def _scales_own_loss(self) -> bool:
        """Whether this strategy holds the fp16 loss scale itself (False where an inner strategy it runs does)."""
        return True

    def _prepare_commit(self, grads: list[torch.Tensor], *, norm_group: str | None = None,
                        shared: bool = False) -> dict[str, Any] | None:
        """The round's gradient, about to be committed, made ready on the main thread: unscaled (fp16), its
        global norm measured, clipped (``max_grad_norm``) — see :mod:`~quietsync.strategies.parts.clipping`.

        ``grads`` is this worker's part of the gradient the optimizer will use; ``norm_group`` the group it is
        sharded over (None: whole here); ``shared``: whether the gradient is already equal on every worker of
        ``world`` (or its norm is after the ``norm_group`` sum), so an fp16 overflow needs no flag all-reduce.
        Returns the step's extras (``grad_norm``, fp16's ``loss_scale`` and ``overflow_skips``), ``{}`` with
        neither knob set (nothing runs), or **None** when fp16 found an overflow: the caller drops the round
        (:meth:`discard_round`) — every worker gets None for the same round.
        """
        if self.scaler is None and self._max_grad_norm is None:
            return {}
        scale = None if self.scaler is None else self.scaler.scale
        # the norm's all-reduce (and fp16's flag) block the main thread
        with self.accounting.idle("grad_norm"):
            check = prepare_gradient(
                grads, max_norm=self._max_grad_norm, scale=scale, transport=self.transport,
                norm_group=norm_group, agree_group=None if shared else "world")
        return self._gradient_extras(check, scale)

    def _prepares_gradient(self) -> bool:
        return self.prepares_gradient or any(p.prepares_gradient for p in self._parts.values())

    def _unprepared(self, knob: str) -> str:
        return (f"strategy {self.name or type(self).__name__} does not unscale or clip the gradient it commits, so "
                f"{knob} would be ignored: it is refused (a strategy keeps it by calling _prepare_commit and setting "
                "prepares_gradient = True, or by holding the Replicated substrate)")

    def _unprepared_knobs(self) -> str | None:
        """Why this constructed strategy cannot keep its ``max_grad_norm`` / fp16 (None: it can, or neither is
        set)."""
        if self._prepares_gradient():
            return None
        if self._max_grad_norm is not None:
            return self._unprepared("max_grad_norm")
        if self.scaler is not None:
            return self._unprepared('precision="fp16"')
        return None

    def _gradient_extras(self, check: GradientCheck, scale: float | None) -> dict[str, Any] | None:
        """Record a :class:`GradientCheck` of the round's gradient (main thread): the loss scale follows it;
        None when the round overflowed under fp16 (drop it), else the step's extras."""
        if self.scaler is not None:
            self.scaler.update(check.finite)
            if not check.finite:
                return None
        extra: dict[str, Any] = {"grad_norm": check.norm}
        if self._max_grad_norm is not None:
            extra["clipped"] = check.clipped
        if self.scaler is not None:
            extra["loss_scale"] = scale
            extra["overflow_skips"] = self.scaler.take_skipped()
        return extra

    def _discard(self) -> None:
        """Strategy-specific clean-up after :meth:`discard_round` (extra gradient buffers, sync flags)."""

    def _from_parts(self, method: Callable[[Part], dict[str, Any]]) -> dict[str, Any]:
        """The merged dicts ``method(part)`` of the held parts, in holding order."""
        merged: dict[str, Any] = {}
        for part in self._parts.values():
            merged.update(method(part))
        return merged

    def hold(self, name: str, part: P) -> P:
        """Hold ``part`` (a :class:`~quietsync.strategies.parts.part.Part`, or another strategy run inside
        this one): it is checkpointed under ``name``, its position counters join :meth:`position`, its buffers
        :meth:`memory_report`, its open round is dropped by :meth:`discard_round`, and it is closed with the
        strategy. Returns it."""
        if name in self._parts:
            raise ValueError(f"part {name!r} is held twice")
        if isinstance(part, Strategy):
            self._parts[name] = _HeldStrategy(part)
        elif isinstance(part, Part):
            self._parts[name] = part
        else:
            raise TypeError(f"part {name!r} must be a Part or a Strategy, got {type(part).__name__}")
        return part

    def _state(self) -> dict[str, Any]:
        return {}

    def _load_state(self, state: dict[str, Any]) -> None:
        pass

    def _check_reshardable(self) -> None:
        if self.reshard_refusal is not None:
            raise ReshardError(f"strategy {self.name} cannot be resharded: {self.reshard_refusal}")

    def _logical_state(self) -> dict[str, torch.Tensor]:
        """The world-size-independent tensors beyond ``steps`` (strategies with ``reshard_refusal = None``): by
        default the held parts' (a substrate's logical form), merged."""
        return self._from_parts(lambda part: part.logical_state())

    def _logical_targets(self, saved: SavedTensors) -> dict[str, torch.Tensor]:
        """Tensors in this worker's layout to read :meth:`_logical_state` of any world size into (by default the
        held parts')."""
        return self._from_parts(lambda part: part.logical_targets(saved))

    def _load_logical(self, filled: dict[str, torch.Tensor]) -> None:
        """Take the state :meth:`_logical_targets` was filled with (by default, each held part its own)."""
        for part in self._parts.values():
            part.load_logical(filled)

    def _open_round(self) -> dict[str, int]:
        """Counters of work fed but not yet part of a committed step (all 0 at a step boundary, where a logical
        checkpoint may be written). Default: every :meth:`position` counter but ``steps``; a strategy whose
        position counts pipeline stages or fragments in flight (which a logical checkpoint holds) says which
        counters are an open round."""
        return {k: v for k, v in self.position().items() if k != "steps"}

    def _position(self) -> dict[str, int]:
        """The strategy's own position counters beyond its parts' (e.g. ACCO's stage)."""
        return {}

    def _memory(self) -> dict[str, int]:
        return {}

    def _close(self) -> None:
        pass

    def _lr_scale(self, step: int) -> float:
        return 1.0 if self.lr_schedule is None else float(self.lr_schedule(step))

    def _commit(self, extra: dict[str, Any] | None = None, micro_batches: int | None = None) -> StepMetrics:
        """Record a committed step: bump the counter and close this step's accounting (after averaging the running
        statistics, under ``buffer_sync = "commit"``)."""
        if self.buffer_sync == "commit":
            self.buffers.sync(getattr(self, "group", None))  # its own group where it has one (zero1 in a node)
        self.steps += 1
        # steps was just bumped: the step committed ran at the schedule's lr for steps - 1
        self._last_metrics = self.accounting.close_step(
            self.steps, self.base_lr * self._lr_scale(self.steps - 1), extra, micro_batches)
        return self._last_metrics

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")

    def _check_training(self) -> None:
        self._check_open()
        if self._finished:
            raise RuntimeError(f"{type(self).__name__} has finished (finish() ends training); build a new strategy "
                               "to train further")

    @staticmethod
    def _check_groups(
        model: torch.nn.Module, param_groups: list[dict[str, Any]] | None
    ) -> list[dict[str, Any]]:
        if param_groups is None:
            return [{"params": [p for p in model.parameters() if p.requires_grad]}]
        if isinstance(param_groups, (str, bytes, dict)) or not hasattr(param_groups, "__iter__"):
            raise TypeError(f"param_groups must be a list of parameter groups (dicts with 'params') or of "
                            f"parameters, got {type(param_groups).__name__}")
        try:
            groups = normalize_param_groups(param_groups)
        except (TypeError, ValueError) as e:
            raise type(e)(f"param_groups: {e}") from None
        owned = {id(p) for p in model.parameters()}
        for i, g in enumerate(groups):
            for p in g["params"]:
                if id(p) not in owned:
                    raise ValueError(f"param_groups[{i}] holds a tensor that is not a parameter of model")
        return groups


class _HeldStrategy(Part):
    """A strategy run inside another (hierarchical DiLoCo's inner ddp/zero1), held like any part."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    def state_dict(self) -> dict[str, Any]:
        return self.strategy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.strategy.load_state_dict(state)

    def position(self) -> dict[str, int]:
        return self.strategy.position()

    def memory_report(self) -> dict[str, int]:
        return self.strategy.memory_report()

    def summary(self) -> dict[str, str]:
        return self.strategy.summary()

    @property
    def round_full(self) -> bool | None:
        return self.strategy.round_closes

    def discard(self) -> None:
        if self.strategy.round_closes is not None:  # None: it cannot drop a round (discard_round raises)
            self.strategy.discard_round()

    def close(self) -> None:
        self.strategy.close()
