"""Any quietsync strategy inside an ordinary 🤗 Accelerate training script.

Two objects, one changed line in the user's script::

    from quietsync.accelerate import QuietAccelerator
    accelerator = QuietAccelerator(strategy="zero1", gradient_accumulation_steps=2)   # was Accelerator(...)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)                         # unchanged
    scheduler = get_linear_schedule_with_warmup(optimizer, 10, 100)                     # unchanged
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
    with optimizer.committed_params():
        evaluate(model)
    accelerator.end_training()

How the pieces map (see ``docs/accelerate.md``):

* **The optimizer you build is a specification.** ``prepare`` reads its class, its defaults and its
  parameter groups and hands them to the strategy, which builds (and possibly shards) the real optimizer.
  What ``prepare`` returns is a :class:`QuietOptimizer`: a ``torch.optim.Optimizer`` whose
  ``param_groups`` *are* the specification's (the same dicts), so any LR scheduler — built before or after
  ``prepare`` — steers the learning rate the strategy applies.
* **No Accelerate DDP.** quietsync strategies do their own communication, so :class:`QuietAccelerator`
  prepares the model the way Accelerate prepares an evaluation model (device placement, autocast,
  ``torch.compile``; never ``DistributedDataParallel``) and returns the module the strategy wants forward
  called on (``ddp`` returns its own metered DDP wrapper).
* **backward is the strategy's.** ``accelerator.backward(loss)`` gives the *undivided* micro-batch loss to
  ``Strategy.backward`` and then calls ``Strategy.step()`` — the contract's "step after every backward" —
  so the strategy sees every micro-batch and commits when *it* decides. The strategy divides by its
  micro-batch count itself (the contract's gradient convention), which replaces Accelerate's division by
  ``gradient_accumulation_steps``.
* **Accumulation.** A strategy with an ``accumulation`` knob (ddp, zero1, demo, flexdemo, ...) gets
  ``accumulation = gradient_accumulation_steps``, so it commits exactly when ``accelerator.sync_gradients``
  is True. Strategies that decide their own accumulation (acco, dpu, wp) require
  ``gradient_accumulation_steps=1``; ``optimizer.step()`` then reports ``step_was_skipped`` on the calls
  with no commit, and Accelerate's scheduler wrapper steps only on committed steps.
* **Topology** comes from the environment the launcher set (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_*);
  the transport reuses the default process group Accelerate already initialised.

Not supported (clear errors): fp16 loss scaling (bf16 autocast works), gradient clipping through the
accelerator, DeepSpeed/FSDP/Megatron/XLA, several models or optimizers in one ``prepare``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .strategies import StepMetrics, Strategy, StrategyConfig, make_strategy
from .strategies.registry import get as get_strategy
from .topology import Topology
from .transport import Transport, default_backend

__all__ = ["QuietAccelerator", "QuietOptimizer", "strategy_kwargs_from_optimizer"]


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
        if param is None:
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

    Behaviour:
        * :meth:`backward` runs one micro-batch's backward through the strategy and then ``Strategy.step()``.
        * :meth:`step` commits nothing itself; it records whether the strategy committed since the previous
          call (``step_was_skipped`` is True when it did not, which Accelerate's scheduler wrapper and the
          HF Trainer honour).
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
        _, config_cls = get_strategy(strategy)  # ValueError listing the choices
        if isinstance(config, dict):
            config = config_cls(**config)
        if config is None:
            config = config_cls()
        if not isinstance(config, config_cls):
            raise TypeError(f"config must be a {config_cls.__name__} or a dict, got {type(config).__name__}")
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
        self.optimizer = optimizer
        """The specification optimizer (its ``param_groups`` are this object's)."""
        spec = strategy_kwargs_from_optimizer(optimizer)
        self._base_lrs = [float(g["lr"]) for g in spec["param_groups"]]
        if self._base_lrs[0] == 0.0:
            raise ValueError("the learning rate of parameter group 0 is 0: schedules are applied as a multiple of it")
        self._scales: dict[int, float] = {}
        self._scale_lock = threading.Lock()
        self.strategy: Strategy = make_strategy(
            strategy, model, spec.pop("optimizer"), config=config, transport=transport,
            lr_schedule=self._lr_scale, **spec,
        )
        """The quietsync strategy doing the work."""
        self._committed_since_step = False
        self._was_skipped = False

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
        inner = getattr(self.strategy, "optimizer", None)
        return inner.state if isinstance(inner, torch.optim.Optimizer) else {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("a strategy's parameters are fixed at construction; build a new QuietOptimizer")

    def backward(self, loss: torch.Tensor) -> bool:
        """One micro-batch: ``Strategy.backward(loss)`` then ``Strategy.step()``; True when a step committed.

        ``loss`` is the micro-batch's own (undivided) loss: the strategy divides by its micro-batch count.
        """
        self.strategy.backward(loss)
        committed = self.strategy.step()
        if committed:
            self._committed_since_step = True
        return committed

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Close an optimizer step of the user's loop; the strategy already committed (or not) in backward."""
        if closure is not None:
            raise ValueError("closures are not supported: the strategy decides when the optimizer runs")
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
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` saved by the same rank of a run with the same strategy and world size."""
        if not isinstance(state_dict, dict) or "quietsync" not in state_dict:
            raise ValueError("state_dict was not saved by a QuietOptimizer (no 'quietsync' entry)")
        if state_dict.get("rank") != self.strategy.rank:
            raise ValueError(f"state_dict was saved by rank {state_dict.get('rank')}, this is rank {self.strategy.rank}")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(groups)} parameter groups, this optimizer {len(self.param_groups)}")
        self.strategy.load_state_dict(state_dict["quietsync"])
        for g, saved in zip(self.param_groups, groups):
            g.update(saved)
        self._base_lrs = [float(x) for x in state_dict["base_lrs"]]
        self._committed_since_step = bool(state_dict.get("pending_commit", False))
        with self._scale_lock:
            self._scales.clear()

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

    def last_step_metrics(self) -> StepMetrics | None:
        """Metrics of the latest committed step (bytes sent/received, compute/idle seconds, lr, ...)."""
        return self.strategy.last_step_metrics()

    @contextlib.contextmanager
    def committed_params(self) -> Iterator[torch.nn.Module]:
        """Within this context the model holds the committed parameters (for evaluation and saving)."""
        with self.strategy.committed_params() as model:
            yield model

    def close(self) -> None:
        """Stop the strategy's background work and release its process groups; safe to call twice."""
        self.strategy.close()

    def _lr_scale(self, step: int) -> float:
        """The strategy's ``lr_schedule``: the current lr of the groups over their base lr, fixed per step."""
        with self._scale_lock:
            if step in self._scales:
                return self._scales[step]
            groups = self.param_groups
            scale = float(groups[0]["lr"]) / self._base_lrs[0]
            for i, (g, base) in enumerate(zip(groups, self._base_lrs)):
                if not math.isclose(float(g["lr"]), base * scale, rel_tol=1e-6, abs_tol=1e-12):
                    raise ValueError(
                        f"parameter group {i} has lr {g['lr']} but group 0's schedule factor {scale} gives "
                        f"{base * scale}: quietsync strategies scale every group's lr by one factor"
                    )
            self._scales[step] = scale
            for old in [s for s in self._scales if s < step - 4]:
                del self._scales[old]
            return scale


def _accelerate() -> Any:
    try:
        import accelerate
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("quietsync.accelerate needs 🤗 Accelerate: pip install accelerate") from exc
    return accelerate


_Accelerator: Any = _accelerate().Accelerator


class QuietAccelerator(_Accelerator):  # type: ignore[misc, valid-type]
    """``accelerate.Accelerator`` whose ``prepare`` puts a quietsync strategy in place of DDP.

    Args:
        strategy: a registered strategy name (``quietsync.strategies.available()``).
        strategy_config: that strategy's config dataclass or a dict of its fields.
        transport: the transport (default: from the launcher's environment).
        *args, **kwargs: ``accelerate.Accelerator``'s arguments (``gradient_accumulation_steps``,
            ``mixed_precision="bf16"``, ...). On a machine without CUDA, a multi-process launch defaults to
            ``cpu=True`` (Accelerate's MULTI_CPU mode over gloo), so ``accelerate launch --multi_gpu`` works
            unchanged there.

    After ``prepare``, :attr:`quiet_optimizer` is the :class:`QuietOptimizer` (also what ``prepare``
    returned for the optimizer).

    Raises:
        ValueError: unknown strategy (listing the choices), fp16 mixed precision, an Accelerate mode that
            brings its own parallelism (DeepSpeed, FSDP, Megatron-LM, XLA), or a world size that differs from
            the launcher's environment.
    """

    def __init__(self, *args: Any, strategy: str, strategy_config: StrategyConfig | dict[str, Any] | None = None,
                 transport: Transport | None = None, **kwargs: Any) -> None:
        get_strategy(strategy)  # fail before any process group work
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and default_backend(Topology.from_env()) == "gloo":
            # Without a GPU each (or with QUIETSYNC_BACKEND=gloo), Accelerate treats a multi-process launch as N
            # independent single processes unless told cpu=True; quietsync's workers must form one world, so
            # ask for MULTI_CPU (gloo).
            kwargs.setdefault("cpu", True)
        super().__init__(*args, **kwargs)
        from accelerate.utils import DistributedType

        allowed = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}
        if self.distributed_type not in allowed:
            raise ValueError(
                f"quietsync strategies replace Accelerate's data parallelism; {self.distributed_type} is not "
                "supported (use a plain multi-CPU/multi-GPU launch)"
            )
        if self.mixed_precision == "fp16":
            raise ValueError("mixed_precision='fp16' (loss scaling) is not supported with quietsync; use 'bf16' or 'no'")
        env_world = int(os.environ.get("WORLD_SIZE", "1"))
        if self.num_processes != env_world:
            raise ValueError(
                f"Accelerate runs {self.num_processes} processes but WORLD_SIZE is {env_world}: launch with "
                "`accelerate launch --multi_gpu --num_processes N` (or torchrun)"
            )
        self.quiet_strategy = strategy
        """The strategy name ``prepare`` builds."""
        self.quiet_config = strategy_config
        self.quiet_transport = transport
        self.quiet_optimizer: QuietOptimizer | None = None
        """The :class:`QuietOptimizer` built by ``prepare`` (None before)."""

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Like ``Accelerator.prepare``; the one model and its optimizer become a quietsync strategy.

        The model comes back as the module to call forward on, the optimizer as a :class:`QuietOptimizer`;
        data loaders and schedulers are prepared by Accelerate as usual (in the same call or a later one).

        Raises:
            ValueError: the model and its optimizer are not passed together, or several of either are passed,
                or ``prepare`` built a strategy already.
        """
        if device_placement is not None and len(device_placement) != len(args):
            raise ValueError(f"device_placement must have {len(args)} entries, one per object")
        places = list(device_placement) if device_placement is not None else [None] * len(args)
        models = [i for i, a in enumerate(args) if isinstance(a, torch.nn.Module)]
        optims = [i for i, a in enumerate(args)
                  if isinstance(a, torch.optim.Optimizer) and not isinstance(a, QuietOptimizer)]
        out: list[Any] = list(args)
        if models or optims:
            if len(models) != 1 or len(optims) != 1:
                raise ValueError(
                    "QuietAccelerator.prepare needs exactly one model and its optimizer in the same call "
                    f"(got {len(models)} model(s) and {len(optims)} optimizer(s))"
                )
            if self.quiet_optimizer is not None:
                raise ValueError("prepare already built a strategy; one QuietAccelerator drives one model")
            mi, oi = models[0], optims[0]
            model = self.prepare_model(args[mi], device_placement=places[mi])
            quiet = QuietOptimizer(
                model, args[oi], self.quiet_strategy, config=self.quiet_config,
                accumulation=self.gradient_accumulation_steps, transport=self.quiet_transport,
            )
            if quiet.strategy.world_size != self.num_processes or quiet.strategy.rank != self.process_index:
                raise ValueError(
                    f"the transport has rank {quiet.strategy.rank}/{quiet.strategy.world_size}, Accelerate "
                    f"{self.process_index}/{self.num_processes}"
                )
            self.quiet_optimizer = quiet
            self._optimizers.append(quiet)
            out[mi], out[oi] = quiet.model, quiet
        rest = [i for i in range(len(args)) if i not in models and i not in optims]
        if rest:
            prepared = super().prepare(*(args[i] for i in rest),
                                       device_placement=None if device_placement is None else [places[i] for i in rest])
            prepared = prepared if isinstance(prepared, tuple) else (prepared,)
            for i, obj in zip(rest, prepared):
                out[i] = obj
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        """Device placement, autocast and compilation as Accelerate does them — never a DDP wrapper."""
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The micro-batch's undivided loss goes to the strategy (backward, then ``Strategy.step()``)."""
        if kwargs:
            raise TypeError(f"backward arguments {sorted(kwargs)} are not supported with quietsync strategies")
        if self.quiet_optimizer is None:
            raise RuntimeError("call accelerator.prepare(model, optimizer, ...) before accelerator.backward")
        self.quiet_optimizer.backward(loss)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """No-op: the strategy decides when gradients cross the network."""
        yield

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        raise NotImplementedError(
            "gradient clipping is not part of the quietsync strategy contract (the strategy commits inside "
            "accelerator.backward, before a clip could run)"
        )

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        raise NotImplementedError("gradient clipping is not part of the quietsync strategy contract")

    def end_training(self) -> None:
        """Close the strategy (background threads, process groups), then Accelerate's own end of training."""
        if self.quiet_optimizer is not None:
            self.quiet_optimizer.close()
        super().end_training()
