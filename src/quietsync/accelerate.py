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
  ``Strategy.backward``; the ``Strategy.step()`` that the contract wants after every backward is owed and runs
  in ``clip_grad_norm_``, ``optimizer.step()`` or the next backward (whichever comes first, so a clip in
  between applies to the step that commits) — the strategy sees every micro-batch and commits when *it*
  decides. The strategy divides by its
  micro-batch count itself (the contract's gradient convention), which replaces Accelerate's division by
  ``gradient_accumulation_steps``.
* **Accumulation.** A strategy with an ``accumulation`` knob (ddp, zero1, demo, flexdemo, ...) gets
  ``accumulation = gradient_accumulation_steps``, so it commits exactly when ``accelerator.sync_gradients``
  is True. Strategies that decide their own accumulation (acco, dpu, wp) require
  ``gradient_accumulation_steps=1``; ``optimizer.step()`` then reports ``step_was_skipped`` on the calls
  with no commit, and Accelerate's scheduler wrapper steps only on committed steps.
* **Topology** comes from the environment the launcher set (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_*);
  the transport reuses the default process group Accelerate already initialised.

* **Precision and clipping are the strategy's.** ``mixed_precision="bf16"|"fp16"`` becomes the strategy's
  ``precision`` (autocast of the forward — added by quietsync where Accelerate does not, e.g. fp16 on CPU —, fp32
  master weights, and for fp16 the strategy's loss scaling whose skip decision every worker shares, in place of
  Accelerate's ``GradScaler``). ``accelerator.clip_grad_norm_(model.parameters(), max_norm)`` clips the gradient
  the strategy commits (``docs/contract.md`` says which, per strategy) and returns its pre-clip norm: the
  strategy's step owed by ``accelerator.backward`` runs inside it (or in ``optimizer.step()``).

Not supported (clear errors): ``clip_grad_value_``, fp8, DeepSpeed/FSDP/Megatron/XLA, several models or
optimizers in one ``prepare``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import torch

from .quiet_optimizer import QuietOptimizer, strategy_kwargs_from_optimizer
from .strategies import StrategyConfig
from .strategies.registry import get as get_strategy
from .topology import Topology
from .transport import Transport, default_backend

__all__ = ["QuietAccelerator", "QuietOptimizer", "strategy_kwargs_from_optimizer"]


def _accelerate() -> Any:
    try:
        import accelerate
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("quietsync.accelerate needs 🤗 Accelerate: pip install accelerate") from exc
    return accelerate


_Accelerator: Any = _accelerate().Accelerator

_PRECISION = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
"""Accelerate's ``mixed_precision`` → the strategy's ``precision``."""


def _autocast_forward(module: torch.nn.Module, strategy: Any) -> None:
    """Run ``module``'s forward under the strategy's autocast (what Accelerate's ``prepare_model`` does where it
    autocasts itself)."""
    forward = module.forward

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with strategy.autocast():
            return forward(*args, **kwargs)

    module.forward = autocast_forward  # type: ignore[method-assign]


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
        ValueError: unknown strategy (listing the choices), fp8 mixed precision, an Accelerate mode that
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
        if str(self.mixed_precision) not in _PRECISION:
            raise ValueError(f"mixed_precision={self.mixed_precision!r} is not supported with quietsync strategies; "
                             f"use one of {', '.join(_PRECISION)}")
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
            precision = _PRECISION[str(self.mixed_precision)]
            quiet = QuietOptimizer(
                model, args[oi], self.quiet_strategy, config=self.quiet_config,
                accumulation=self.gradient_accumulation_steps, transport=self.quiet_transport,
                precision=precision,
            )
            if precision != "fp32" and not self.native_amp:  # Accelerate does not autocast here (fp16 on CPU)
                _autocast_forward(quiet.model, quiet.strategy)
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
        """The micro-batch's undivided loss goes to the strategy's backward (its ``Strategy.step()`` is owed: see
        :class:`QuietOptimizer`)."""
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
        """Clip the gradient the strategy commits to ``max_norm`` and return its pre-clip global norm (see
        :meth:`QuietOptimizer.clip_grad_norm_`); ``parameters`` must be the prepared model's (the strategy
        clips all of them, by the norm of the gradient it commits)."""
        if self.quiet_optimizer is None:
            raise RuntimeError("call accelerator.prepare(model, optimizer, ...) before accelerator.clip_grad_norm_")
        return self.quiet_optimizer.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        raise NotImplementedError(
            "clip_grad_value_ is not supported with quietsync strategies (they clip the committed gradient by "
            "its norm: use clip_grad_norm_)"
        )

    def end_training(self) -> None:
        """Close the strategy (background threads, process groups), then Accelerate's own end of training."""
        if self.quiet_optimizer is not None:
            self.quiet_optimizer.close()
        super().end_training()
