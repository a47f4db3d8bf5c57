"""A ``torch.optim.Optimizer`` in front of a quietsync strategy: what the 🤗 Accelerate and HF Trainer adapters
hand the user's loop.

The user's own optimizer is a *specification*: :func:`strategy_kwargs_from_optimizer` reads its class, options
and parameter groups, the strategy builds (and possibly shards) the real optimizer, and :class:`QuietOptimizer`
keeps the specification's ``param_groups`` as its own so any LR scheduler steers the lr the strategy applies.
``docs/accelerate.md`` describes how the adapters use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .strategies import StepMetrics, Strategy, StrategyConfig, make_strategy
from .strategies.base import LossFn
from .strategies.registry import strategy_config
from .transport import Transport

__all__ = ["QuietOptimizer", "optimizer_file", "strategy_kwargs_from_optimizer"]


def _same(a: Any, b: Any) -> bool:
    """``a == b`` for option values (floats, tuples, bools, tensors), False when not comparable."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - tensors with several elements, exotic values
        return a is b


def strategy_kwargs_from_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The ``make_strategy`` arguments that rebuild ``optimizer``: its class, options and parameter groups.

    Options equal to the class's own defaults are left out (as a user would write the call), so a strategy
    that swaps the optimizer for its own (``demo``'s DeMo-SGD) receives only what the user chose. The
    learning rate is each group's *base* lr: ``initial_lr`` when a scheduler already set it, else ``lr``.

    Returns:
        ``{"optimizer": cls, "param_groups": [...], **optimizer_kwargs}``.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    cls = type(optimizer)
    try:
        sig = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        sig = {}
    kwargs: dict[str, Any] = {}
    for key, value in optimizer.defaults.items():
        param = sig.get(key)
        if param is None:  # a defaults key the constructor does not take could not be passed back to it
            continue
        if key != "lr" and param.default is not inspect.Parameter.empty and _same(value, param.default):
            continue
        kwargs[key] = value
    groups = []
    for g in optimizer.param_groups:
        group: dict[str, Any] = {"params": list(g["params"])}
        for key, value in g.items():
            if key in ("params", "initial_lr", "lr"):
                continue
            if key in optimizer.defaults and not _same(value, optimizer.defaults[key]):
                group[key] = value
        group["lr"] = float(g.get("initial_lr", g["lr"]))
        groups.append(group)
    return {"optimizer": cls, "param_groups": groups, **kwargs}


def loop_collectives_problem(config: StrategyConfig) -> str | None:
    """Why a loop that runs collectives of its own at every step (``loop_collectives``: the HF Trainer's gathers)
    cannot drive a strategy of ``config`` (one line), or None. Workers that call ``step()`` a different number of
    times between syncs (``StrategyConfig.uneven_steps``) would pair those collectives up wrong, and wait forever."""
    uneven = config.uneven_steps()
    if uneven is None:
        return None
    return (f"{uneven}, so a loop that runs collectives of its own at every step (the HF Trainer's gathers) cannot "
            "drive it: each worker would reach them a different number of times; train it with quietsync train, "
            "or from a loop with no collective between syncs")


class QuietOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` front for a quietsync strategy (what ``QuietAccelerator.prepare`` returns).

    Args:
        model: the model, already on its device (the strategy may move its parameters into flat buffers).
        optimizer: the optimizer *specification*: a ``torch.optim.Optimizer`` over ``model``'s parameters.
            Its class, options and groups build the strategy's optimizer; its ``param_groups`` stay the ones
            schedulers and users see and edit. It is never stepped itself.
        strategy: a registered strategy name (``quietsync.strategies.available()``).
        config: the strategy's config dataclass or a dict of its fields.
        accumulation: micro-batches per step (Accelerate's ``gradient_accumulation_steps``); written into
            the config's ``accumulation`` field when the strategy has one; must be 1 otherwise.
        transport: the transport; default ``Transport()`` from the launcher's environment (reusing an
            initialised default process group).
        precision: the strategy's ``precision`` (``"fp32"``, ``"bf16"``, ``"fp16"``; Accelerate's
            ``mixed_precision``, the Trainer's ``bf16``/``fp16``).
        max_grad_norm: the strategy's ``max_grad_norm`` (None: no clipping; :meth:`clip_grad_norm_` sets it too).
        loop_collectives: whether the training loop runs collectives of its own between steps (the HF Trainer's
            gathers; ``Strategy.loop_collectives``): a strategy whose workers drift apart then never waits inside
            a step for a peer.

    Behaviour:
        * :meth:`forward_backward` runs one micro-batch through the strategy's per-micro-batch contract,
          ``Strategy.forward_backward(batch, loss_fn)``; its ``Strategy.step()`` is owed, as after
          :meth:`backward`. Every strategy takes it, and it is the only way in for a strategy that schedules
          forward and backward itself (``cdp``).
        * :meth:`backward` runs one micro-batch's backward through the strategy (refused, in one line naming
          :meth:`forward_backward`, by a strategy that owns its schedule); the ``Strategy.step()`` that must
          follow it is *owed* and paid by :meth:`clip_grad_norm_`, :meth:`step` or the next :meth:`backward` /
          :meth:`forward_backward`, whichever comes first — so a clip requested between backward and step
          (Accelerate's and the Trainer's order) applies to the step that commits.
        * :meth:`step` pays the owed ``Strategy.step()`` and records whether the strategy committed since the
          previous call (``step_was_skipped`` is True when it did not, which Accelerate's scheduler wrapper and
          the HF Trainer honour).
        * :meth:`clip_grad_norm_` sets the strategy's ``max_grad_norm`` and returns the pre-clip global norm of
          the gradient the strategy committed (NaN when nothing committed).
        * :meth:`finish` ends training (``Strategy.finish``: local methods sync their last partial round,
          overlapped methods drain theirs); the adapters call it at the end of training.
        * :meth:`zero_grad` is a no-op: the strategy owns and resets the gradients.
        * The lr the strategy applies at a committed step is the lr in ``param_groups`` at that moment
          (schedulers must scale every group by the same factor — all torch and transformers schedulers do).

    Raises:
        ValueError: unknown strategy (the message lists the choices), accumulation that the strategy cannot
            honour, a zero base learning rate, or parameters that are not ``model``'s.
    """

    _is_accelerate_prepared = True
    """Tells ``Accelerator.prepare`` not to wrap this object in an ``AcceleratedOptimizer``."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        strategy: str,
        *,
        config: StrategyConfig | dict[str, Any] | None = None,
        accumulation: int = 1,
        transport: Transport | None = None,
        precision: str = "fp32",
        max_grad_norm: float | None = None,
        loop_collectives: bool = False,
    ) -> None:
        # torch.optim.Optimizer.__init__ is not called on purpose: param_groups/defaults/state are the
        # specification's and the strategy's (properties below). These are what torch's hooks expect.
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(optimizer, QuietOptimizer):
            raise TypeError("optimizer is already a QuietOptimizer; pass the plain torch optimizer")
        if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
            raise ValueError(f"accumulation must be an integer >= 1, got {accumulation!r}")
        # the choices listed for an unknown name, a misspelt field named with its close match
        config = strategy_config(strategy, config)
        fields = {f.name for f in dataclasses.fields(config)}
        if "accumulation" in fields:
            if accumulation != 1 and config.accumulation not in (1, accumulation):
                raise ValueError(
                    f"gradient_accumulation_steps={accumulation} conflicts with the {strategy} config's "
                    f"accumulation={config.accumulation}; set one of them"
                )
            if accumulation != 1:
                config = config.replace(accumulation=accumulation)
        elif accumulation != 1:
            raise ValueError(
                f"strategy {strategy!r} decides its own accumulation (see its config: "
                f"{', '.join(sorted(fields))}); use gradient_accumulation_steps=1, got {accumulation}"
            )
        problem = loop_collectives_problem(config) if loop_collectives else None
        if problem:
            raise ValueError(problem)
        self.optimizer = optimizer
        """The specification optimizer (its ``param_groups`` are this object's)."""
        spec = strategy_kwargs_from_optimizer(optimizer)
        self._base_lrs = [float(g["lr"]) for g in spec["param_groups"]]
        if self._base_lrs[0] == 0.0:
            raise ValueError("the learning rate of parameter group 0 is 0: schedules are applied as a multiple of it")
        self._scales: dict[int, float] = {}
        self._scale_lock = threading.Lock()
        self._released = 0  # the lr of every step index below this is final (see _lr_scale)
        self._loop_thread = threading.get_ident()  # the thread of the training loop (the last to call in)
        self._release = threading.Condition(self._scale_lock)
        self.strategy: Strategy = make_strategy(
            strategy, model, spec.pop("optimizer"), config=config, transport=transport,
            lr_schedule=self._lr_scale, precision=precision, max_grad_norm=max_grad_norm, **spec,
        )
        """The quietsync strategy doing the work."""
        self.strategy.loop_collectives = bool(loop_collectives)
        self._committed_since_step = False
        self._was_skipped = False
        self._owed = False  # a backward whose Strategy.step() has not run yet
        self._last_norm = float("nan")  # pre-clip norm of the step committed by the last paid step()

    # ------------------------------------------------------------------ torch.optim.Optimizer surface
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The specification's parameter groups: edit ``lr`` here (or let a scheduler do it)."""
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The state of the optimizer the strategy runs (on sharded strategies: this worker's shard)."""
        inner = self.strategy.optimizer
        return inner.state if isinstance(inner, torch.optim.Optimizer) else {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("a strategy's parameters are fixed at construction; build a new QuietOptimizer")

    @property
    def owns_schedule(self) -> bool:
        """Whether the strategy schedules forward and backward itself (``cdp``): feed it with
        :meth:`forward_backward`; :meth:`backward` is refused."""
        return self.strategy.owns_schedule

    def forward_backward(self, batch: Any, loss_fn: LossFn) -> torch.Tensor | None:
        """One micro-batch: ``Strategy.forward_backward(batch, loss_fn)``; its ``Strategy.step()`` is owed (see
        the class doc).

        ``loss_fn(model, batch)`` returns the micro-batch's own (undivided) loss and calls ``model`` once (the
        module it receives; ``cdp`` runs it one stage at a time). Returns the detached loss of the micro-batch(es)
        whose backward completed in this call, None while a pipeline fills (``cdp``).
        """
        self._enter()
        loss = self.strategy.forward_backward(batch, loss_fn)
        self._owed = True
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch: ``Strategy.backward(loss)``; its ``Strategy.step()`` is owed (see the class doc).

        ``loss`` is the micro-batch's own (undivided) loss: the strategy divides by its micro-batch count (and
        scales it, under fp16).

        Raises:
            RuntimeError: the strategy schedules forward and backward itself (use :meth:`forward_backward`).
        """
        if self.strategy.owns_schedule:
            raise RuntimeError(
                f"strategy {self.strategy.name} schedules forward and backward itself, so it cannot take a loss "
                "computed outside: feed each micro-batch with forward_backward(batch, loss_fn) instead of "
                "computing the loss and calling backward(loss)"
            )
        self._enter()
        self.strategy.backward(loss)
        self._owed = True

    def _enter(self) -> None:
        """The loop feeds a micro-batch: its scheduler has stepped for every step committed so far, so their lrs
        are final (released *before* paying an owed step: a background job that step starts must wait for the
        scheduler's next step); a step paid only now was never followed by ``step()`` and its scheduler step, so
        nothing more will come before the next call: released too."""
        self._release_lrs()
        if self.pay_step():
            self._release_lrs()

    def pay_step(self) -> bool:
        """Run the ``Strategy.step()`` owed for the last backward, if any; True when it committed a step."""
        if not self._owed:
            return False
        self._owed = False  # cleared first, so a step that raised is not retried by a later call, close() included
        committed = self.strategy.step()
        if committed:
            self._committed_since_step = True
            self._last_norm = float(self.strategy.last_step_metrics().extra.get("grad_norm", float("nan")))
        return committed

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradient the strategy commits to ``max_norm`` (its global L2 norm, as the strategy defines
        it: ``docs/contract.md``); from now on every committed step is clipped. Pays the owed step and returns
        the pre-clip norm of the gradient it committed, as ``torch.nn.utils.clip_grad_norm_`` returns it (NaN
        when no step committed here). ``max_norm=inf`` measures without clipping."""
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type must be 2 (quietsync strategies clip by the L2 norm), got {norm_type!r}")
        self.strategy.max_grad_norm = float(max_norm)
        self._last_norm = float("nan")  # a call that commits nothing returns NaN, not the previous step's norm
        self.pay_step()
        return torch.tensor(self._last_norm)

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Close an optimizer step of the user's loop: pay the owed ``Strategy.step()`` and record whether the
        strategy committed since the previous call."""
        if closure is not None:
            raise ValueError("closures are not supported: the strategy decides when the optimizer runs")
        self.pay_step()
        self._was_skipped = not self._committed_since_step
        self._committed_since_step = False
        # A scheduler built on the specification tracks *its* step calls (torch warns otherwise).
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: the strategy owns the gradient buffers and resets them after each committed step."""

    @property
    def step_was_skipped(self) -> bool:
        """True when no committed step happened between the last two :meth:`step` calls."""
        return self._was_skipped

    def state_dict(self) -> dict[str, Any]:
        """This worker's full state: the strategy's (sharded strategies: this rank's shard) + group options.

        Save it **per rank** (e.g. ``torch.save(opt.state_dict(), f"opt_{rank}.pt")``).
        """
        return {
            "quietsync": self.strategy.state_dict(),
            "rank": self.strategy.rank,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "base_lrs": list(self._base_lrs),
            "pending_commit": self._committed_since_step,
            "owed_step": self._owed,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` saved by the same rank of a run with the same strategy and world size."""
        if not isinstance(state_dict, dict) or "quietsync" not in state_dict:
            raise ValueError("state_dict was not saved by a QuietOptimizer (no 'quietsync' entry)")
        if state_dict.get("rank") != self.strategy.rank:
            raise ValueError(f"state_dict was saved by rank {state_dict.get('rank')}, "
                             f"this is rank {self.strategy.rank}")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(groups)} parameter groups, this optimizer {len(self.param_groups)}")
        self.strategy.load_state_dict(state_dict["quietsync"])
        for g, saved in zip(self.param_groups, groups):
            g.update(saved)
        self._base_lrs = [float(x) for x in state_dict["base_lrs"]]
        self._committed_since_step = bool(state_dict.get("pending_commit", False))
        self._owed = bool(state_dict.get("owed_step", False))  # saved between a backward and its step
        with self._scale_lock:
            self._scales.clear()  # the factors cached before the load belong to another point of the schedule
            self._released = self.strategy.steps  # the next step's lr waits for the loop's next call, as after a commit

    def __repr__(self) -> str:
        return f"QuietOptimizer(strategy={self.strategy.name!r}, optimizer={type(self.optimizer).__name__})"

    # ------------------------------------------------------------------ quietsync surface
    @property
    def model(self) -> torch.nn.Module:
        """The module to call forward on (the strategy's wrapper, e.g. ``ddp``'s metered DDP)."""
        return self.strategy.model

    @property
    def steps(self) -> int:
        """Committed optimizer steps."""
        return self.strategy.steps

    @property
    def steps_in_flight(self) -> int:
        """Committed steps :meth:`finish` would add now (``Strategy.steps_in_flight``): a loop with a step budget
        stops once ``steps + steps_in_flight`` reaches it."""
        return self.strategy.steps_in_flight

    def last_step_metrics(self) -> StepMetrics | None:
        """Metrics of the latest committed step (bytes sent/received, compute/idle seconds, lr, ...)."""
        return self.strategy.last_step_metrics()

    @contextlib.contextmanager
    def committed_params(self) -> Iterator[torch.nn.Module]:
        """Within this context the model holds the committed parameters (for evaluation and saving)."""
        with self.strategy.committed_params() as model:
            yield model

    def finish(self, sync: bool = True) -> int:
        """End training on every worker (``Strategy.finish``): local methods sync their last partial round
        (``sync=False`` skips it), overlapped methods drain the round in flight; returns the steps it committed.
        Call it on every process after the last step, before evaluating or saving the final model; the
        adapters' end of training (``QuietAccelerator.end_training``, the end of ``QuietTrainer.train``) does.
        Calling it again does nothing."""
        if self.strategy.finished:
            return 0
        self._release_lrs(everything=True)
        added = int(self.pay_step())  # the step owed for the last micro-batch, then the strategy's end
        added += self.strategy.finish(sync)
        if added:
            self._committed_since_step = True
        return added

    def level(self) -> int:
        """Bring the workers level with nothing in flight and go on training (``Strategy.level``: a no-op for a
        strategy in lockstep); returns the steps it committed. Call it on every process at the same point, before
        saving or evaluating between two steps; ``QuietTrainer`` does at its checkpoints and evaluations."""
        if self.strategy.finished:
            return 0
        self._release_lrs()
        added = int(self.pay_step())
        # The drain can wait on an update submitted inside it (dpu/wp: the step after the one a worker catching up
        # commits), whose lr only the loop's next call would release: it takes the lr the groups hold now, as the
        # last update of finish() does. Nothing is in flight afterwards, so the gate may close again.
        with self._release:
            gate, self._released = self._released, math.inf
            self._release.notify_all()
        try:
            added += self.strategy.level()
        finally:
            with self._release:
                self._released = gate
        if added:
            self._committed_since_step = True
        return added

    def close(self) -> None:
        """Stop the strategy's background work and release its process groups; safe to call twice. It does not
        finish the run (see :meth:`finish`): it also runs on failure paths, where peers may be gone."""
        self._release_lrs(everything=True)
        if not self.strategy._closed and not self.strategy.finished:
            self.pay_step()
        self.strategy.close()

    def _lr_scale(self, step: int) -> float:
        """The strategy's ``lr_schedule``: the lr of the groups over their base lr, fixed per step index.

        The lr of step index ``k`` is what the groups hold once the loop has stepped its scheduler after each of
        the first ``k`` committed steps, i.e. from the loop's next call into this optimizer on. A job running in
        the background (dpu, wp, acco: submitted right when the previous step committed) asks for it before the
        loop had that chance: it waits for that call (:meth:`_release_lrs`), so the lr does not depend on which
        thread is faster; a later index (wp's prediction of the next step) gets the newest lr, not kept. The
        loop's own thread never waits (it is the one that releases): it fixes the lr it reads first.
        """
        with self._release:
            if step in self._scales:
                return self._scales[step]
            if threading.get_ident() != self._loop_thread:
                if step > self.strategy.steps:
                    return self._scale_now()
                while step >= self._released:
                    self._release.wait()
            scale = self._scale_now()
            self._scales[step] = scale
            for old in [s for s in self._scales if s < step - 4]:  # only recent indices: the cache must not grow
                del self._scales[old]
            return scale

    def _scale_now(self) -> float:
        groups = self.param_groups
        scale = float(groups[0]["lr"]) / self._base_lrs[0]
        for i, (g, base) in enumerate(zip(groups, self._base_lrs)):
            # a tolerance: a scheduler computes each group's lr in floating point on its own
            if not math.isclose(float(g["lr"]), base * scale, rel_tol=1e-6, abs_tol=1e-12):
                raise ValueError(
                    f"parameter group {i} has lr {g['lr']} but group 0's schedule factor {scale} gives "
                    f"{base * scale}: quietsync strategies scale every group's lr by one factor"
                )
        return scale

    def _release_lrs(self, everything: bool = False) -> None:
        """The loop called in again (or ends): the lr of every step index up to the committed steps is final."""
        with self._release:
            self._loop_thread = threading.get_ident()
            # max: never lowered, so what was released stays released (inf once finishing or closing)
            self._released = math.inf if everything else max(self._released, self.strategy.steps + 1)
            self._release.notify_all()


def optimizer_file(rank: int | str, world: int | str) -> str:
    """The name of one rank's :meth:`QuietOptimizer.state_dict` in a checkpoint folder (``QuietTrainer``'s
    checkpoints, ``QuietAccelerator.save_state``): every rank writes its own."""
    return f"quietsync-optimizer-rank{rank}-of-{world}.pt"
