"""The strategy contract: what every quietsync strategy offers a training loop.

A **strategy** decides how and when gradients or parameters cross the network and when the optimizer
runs. The user loop stays an ordinary PyTorch loop::

    strategy = quietsync.make_strategy("zero1", model, torch.optim.AdamW, lr=6e-4, weight_decay=0.1)
    for batch in loader:
        strategy.forward_backward(batch, loss_fn)  # one micro-batch: loss_fn(strategy.model, batch), backward
        if strategy.step():                        # a committed optimizer step happened
            log(strategy.last_step_metrics())
    with strategy.committed_params():      # evaluation and checkpoints see the real parameters
        evaluate(strategy.model)
    strategy.close()

Gradient convention: the gradient a step applies is the **sum over micro-batches of the per-micro-batch
loss gradients, divided by the global micro-batch count**, so workers that contributed more weigh more.

Subclasses implement :meth:`_backward`, :meth:`_step`, and optionally :meth:`_state`/:meth:`_load_state`,
:meth:`committed_params` and :meth:`_close`. Time and bytes are accounted here: ``compute_s`` is the main
thread's time between strategy calls plus inside ``backward`` (forward, backward, data loading), ``idle_s``
the time it spent blocked on communication (subclasses wrap such waits in :meth:`_idle`), ``comm_s`` the
seconds collectives took (on any thread), bytes from the transport's meter.
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, ClassVar

import torch

from ..events import diff_snapshots
from ..flat import normalize_param_groups
from ..transport import Transport

LRSchedule = Callable[[int], float]
"""``f(committed_steps) -> multiplier`` of each parameter group's base learning rate."""

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
"""``loss_fn(model, batch) -> scalar loss`` of one micro-batch (see :meth:`Strategy.forward_backward`)."""


@dataclasses.dataclass
class StepMetrics:
    """What one committed step cost on this worker."""

    step: int
    """Committed steps so far, this one included."""
    micro_batches: int
    """Micro-batches this worker computed for this step."""
    compute_s: float
    """Main-thread seconds spent computing (forward, backward, data, optimizer on the main thread)."""
    comm_s: float
    """Seconds this worker's collectives took (on any thread, emulated link time included)."""
    idle_s: float
    """Main-thread seconds spent blocked on communication."""
    bytes_sent: int
    """Bytes this worker sent during the step (all groups)."""
    bytes_recv: int
    """Bytes this worker received during the step (all groups)."""
    bytes_by_group: dict[str, dict[str, int]]
    """``{group: {"sent": ..., "recv": ...}}``."""
    lr: float = 0.0
    """Learning rate of the first parameter group at this step."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Strategy-specific numbers (e.g. ACCO's micro-batches per worker)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class StrategyConfig:
    """Base class of strategy configs (each strategy subclasses it with its own knobs)."""

    def replace(self, **changes: Any) -> StrategyConfig:
        return dataclasses.replace(self, **changes)


class Strategy(ABC):
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
        **optimizer_kwargs: passed to ``optimizer`` (``lr``, ``weight_decay``, ...).

    Raises:
        TypeError / ValueError: on a bad argument, at construction, naming it.
    """

    name: ClassVar[str] = ""
    config_cls: ClassVar[type[StrategyConfig]] = StrategyConfig

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        param_groups: list[dict[str, Any]] | None = None,
        transport: Transport | None = None,
        config: StrategyConfig | dict[str, Any] | None = None,
        lr_schedule: LRSchedule | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer class or factory, got {optimizer!r}")
        if lr_schedule is not None and not callable(lr_schedule):
            raise TypeError("lr_schedule must be a callable f(step) -> multiplier")
        if isinstance(config, dict):
            config = self.config_cls(**config)
        if config is None:
            config = self.config_cls()
        if not isinstance(config, self.config_cls):
            raise TypeError(f"config must be a {self.config_cls.__name__}, got {type(config).__name__}")
        self.config = config
        self.module = model
        self.optimizer_factory = optimizer
        self.optimizer_kwargs = dict(optimizer_kwargs)
        self.param_groups = self._check_groups(model, param_groups)
        self._owns_transport = transport is None
        self.transport = transport if transport is not None else Transport()
        self.lr_schedule = lr_schedule
        self.steps = 0
        """Committed optimizer steps."""
        self.micro_batches = 0
        """Micro-batches this worker has computed in total."""
        self._closed = False
        self._last_metrics: StepMetrics | None = None
        self._reset_step_accounting()

    # ------------------------------------------------------------------ the contract
    @property
    def model(self) -> torch.nn.Module:
        """The module to call forward on (a wrapper, for strategies that need one)."""
        return self.module

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
        loss = loss_fn(self.model, batch)
        self.backward(loss)
        return loss.detach()

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate one micro-batch's loss and accumulate its gradient locally."""
        self._check_open()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("loss must be a scalar tensor")
        self._backward(loss)
        now = time.perf_counter()
        self._compute_s += now - self._t_mark
        self.transport.recorder.add("compute", "micro_batch", self._t_mark, now)
        self._t_mark = now
        self.micro_batches += 1
        self._step_micro_batches += 1

    def step(self) -> bool:
        """Called after every :meth:`backward`; returns True when a committed optimizer step happened."""
        self._check_open()
        # Main-thread time since the last strategy call (e.g. a simulated slow worker's sleep) is compute.
        now = time.perf_counter()
        self._compute_s += now - self._t_mark
        self._t_mark = now
        committed = self._step()
        self._t_mark = time.perf_counter()
        return committed

    def last_step_metrics(self) -> StepMetrics | None:
        """Metrics of the latest committed step (None before the first)."""
        return self._last_metrics

    @contextmanager
    def committed_params(self) -> Iterator[torch.nn.Module]:
        """Within this context ``self.model`` holds the committed parameters θ (not an estimate)."""
        with nullcontext():
            yield self.model

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the enclosed main-thread time (evaluation, checkpointing, logging) out of ``compute_s``.

        Background communication keeps running; only the accounting of the main thread pauses.
        """
        self._check_open()
        now = time.perf_counter()
        self._compute_s += now - self._t_mark
        try:
            yield
        finally:
            self._t_mark = time.perf_counter()

    def current_lr(self) -> float:
        """The lr the next committed step uses for the first parameter group."""
        base = self.param_groups[0].get("lr", self.optimizer_kwargs.get("lr", 0.0))
        return float(base) * self._lr_scale(self.steps)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume this worker exactly (model, optimizer shard, pending buffers)."""
        return {
            "strategy": self.name,
            "world_size": self.world_size,
            "steps": self.steps,
            "micro_batches": self.micro_batches,
            "config": dataclasses.asdict(self.config),
            "state": self._state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("strategy") != self.name:
            raise ValueError(f"checkpoint is for strategy {state.get('strategy')!r}, not {self.name!r}")
        if state.get("world_size") != self.world_size:
            raise ValueError(
                f"checkpoint was saved with world size {state.get('world_size')}, this run has {self.world_size}"
            )
        self.steps = int(state["steps"])
        self.micro_batches = int(state["micro_batches"])
        self._load_state(state["state"])

    def close(self) -> None:
        """Stop background work and release this strategy's resources; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._close()
        finally:
            if self._owns_transport:
                self.transport.close()

    def __enter__(self) -> Strategy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ for subclasses
    @abstractmethod
    def _backward(self, loss: torch.Tensor) -> None: ...

    @abstractmethod
    def _step(self) -> bool: ...

    def _state(self) -> dict[str, Any]:
        return {}

    def _load_state(self, state: dict[str, Any]) -> None:
        pass

    def _close(self) -> None:
        pass

    def _lr_scale(self, step: int) -> float:
        return 1.0 if self.lr_schedule is None else float(self.lr_schedule(step))

    @contextmanager
    def _idle(self, name: str = "wait") -> Iterator[None]:
        """Account the enclosed time as the main thread blocked on communication."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self._idle_s += t1 - t0
            self._excluded_s += t1 - t0
            self.transport.recorder.add("idle", name, t0, t1)

    def _add_compute(self, seconds: float) -> None:
        """Count main-thread work done inside :meth:`step` (e.g. a local optimizer step) as compute."""
        self._compute_s += seconds

    def _commit(self, extra: dict[str, Any] | None = None, micro_batches: int | None = None) -> StepMetrics:
        """Record a committed step: bump the counter and close this step's accounting."""
        self.steps += 1
        snap = self.transport.meter.snapshot()
        delta = diff_snapshots(snap, self._meter_mark)
        by_group = {g: {"sent": int(v["sent"]), "recv": int(v["recv"])} for g, v in delta.items()}
        self._last_metrics = StepMetrics(
            step=self.steps,
            micro_batches=self._step_micro_batches if micro_batches is None else micro_batches,
            compute_s=self._compute_s,
            comm_s=float(sum(v.get("seconds", 0.0) for v in delta.values())),
            idle_s=self._idle_s,
            bytes_sent=sum(v["sent"] for v in by_group.values()),
            bytes_recv=sum(v["recv"] for v in by_group.values()),
            bytes_by_group=by_group,
            lr=float(self.param_groups[0].get("lr", self.optimizer_kwargs.get("lr", 0.0)))
            * self._lr_scale(self.steps - 1),
            extra=dict(extra or {}),
        )
        self._reset_step_accounting(snap)
        return self._last_metrics

    def _reset_step_accounting(self, snap: dict[str, dict[str, float]] | None = None) -> None:
        self._meter_mark = snap if snap is not None else self.transport.meter.snapshot()
        self._compute_s = 0.0
        self._idle_s = 0.0
        self._excluded_s = 0.0
        self._step_micro_batches = 0
        self._t_mark = time.perf_counter()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")

    @staticmethod
    def _check_groups(model: torch.nn.Module, param_groups: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        if param_groups is None:
            return [{"params": [p for p in model.parameters() if p.requires_grad]}]
        groups = normalize_param_groups(param_groups)
        owned = {id(p) for p in model.parameters()}
        for i, g in enumerate(groups):
            for p in g["params"]:
                if id(p) not in owned:
                    raise ValueError(f"param_groups[{i}] holds a tensor that is not a parameter of model")
        return groups
