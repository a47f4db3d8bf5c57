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
    optimizer.finish()                          # the last round synced or drained, on every process
    with optimizer.committed_params():
        evaluate(model)
    accelerator.end_training()                  # finishes (if not done yet) and closes the strategy

A strategy that schedules forward and backward itself (``cdp``) cannot take a loss computed outside it; feed it
— or any strategy — the micro-batch and a loss function instead of the two lines ``loss = ...`` and
``accelerator.backward(loss)``::

        with accelerator.accumulate(model):
            loss = accelerator.forward_backward(batch, lambda model, batch: model(**batch).loss)  # None: filling
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

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
* **The end of training.** ``optimizer.finish()`` (or ``accelerator.end_training()``, which calls it) ends the
  run on every process: ``localsgd``/``diloco`` sync their last partial round — as Accelerate's own ``LocalSGD``
  averages when its context exits — and ``acco``/``dpu``/``wp`` drain the round in flight.
* **Workers that drift apart** (``Strategy.lockstep`` False: ``acco``/``dpu``/``wp``, whose workers each end
  a stage when *they* see the job done) may stop while a peer still needs a batch, so nothing may communicate
  between micro-batches: data loaders are prepared without dispatching (each process reads its own batches;
  ``dispatch_batches=True`` is refused at construction), and the loop must not call collectives (``gather``,
  ``reduce``, ``wait_for_everyone``) before ``finish()``: the accelerator refuses them in one line until then.
  Stop the loop on ``optimizer.steps + optimizer.steps_in_flight``, after a number of micro-batches or at the end
  of the data: ``finish()`` then brings every worker level.
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

from .quiet_optimizer import QuietOptimizer, optimizer_file, strategy_kwargs_from_optimizer
from .strategies import StrategyConfig
from .strategies.base import LossFn
from .strategies.registry import get as get_strategy
from .strategies.registry import strategy_config as resolve_config
from .topology import Topology
from .transport import Transport, default_backend

__all__ = ["QuietAccelerator", "QuietOptimizer", "strategy_kwargs_from_optimizer"]


def _own_storage(models: list[torch.nn.Module], weights: list[dict[str, Any]], folder: str) -> None:
    """A ``save_state`` pre-hook: every tensor of the state dicts about to be saved gets storage of its own."""
    for state in weights:
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.detach().clone()


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
        strategy_cls, _ = get_strategy(strategy)  # fail before any process group work
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
        if not strategy_cls.steps_together(resolve_config(strategy, strategy_config)):
            # Its workers drift apart (Strategy.steps_together): one may stop while a peer still needs a batch -- and a
            # dispatching DataLoader broadcasts every batch from process 0.
            if self.dataloader_config.dispatch_batches:
                raise ValueError(
                    f"strategy {strategy}'s workers do not feed micro-batches in lockstep, which a DataLoader "
                    "dispatching batches from process 0 (a broadcast per batch) would deadlock: leave "
                    "dispatch_batches unset or False"
                )
            self.dataloader_config.dispatch_batches = False  # not None: Accelerate would then dispatch IterableDatasets
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
            # registered so prepare_scheduler pairs a scheduler built on the specification with it (it matches on
            # .optimizer) and skips the scheduler's step when step_was_skipped
            self._optimizers.append(quiet)
            out[mi], out[oi] = quiet.model, quiet
        rest = [i for i in range(len(args)) if i not in models and i not in optims]
        if rest:
            prepared = super().prepare(*(args[i] for i in rest),
                                       device_placement=None if device_placement is None else [places[i] for i in rest])
            prepared = prepared if isinstance(prepared, tuple) else (prepared,)  # one object comes back bare
            for i, obj in zip(rest, prepared):
                out[i] = obj
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        """Device placement, autocast and compilation as Accelerate does them — never a DDP wrapper."""
        # evaluation_mode=True is Accelerate's path that skips the DDP wrapper; the caller's value is ignored
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The micro-batch's undivided loss goes to the strategy's backward (its ``Strategy.step()`` is owed: see
        :class:`QuietOptimizer`).

        Raises:
            RuntimeError: the strategy schedules forward and backward itself (``cdp``): use
                :meth:`forward_backward`.
        """
        if kwargs:
            raise TypeError(f"backward arguments {sorted(kwargs)} are not supported with quietsync strategies")
        quiet = self._quiet("backward")
        if quiet.owns_schedule:
            raise RuntimeError(
                f"strategy {quiet.strategy.name} schedules forward and backward itself, so accelerator.backward(loss) "
                "cannot feed it: replace `loss = model(**batch).loss; accelerator.backward(loss)` with "
                "`loss = accelerator.forward_backward(batch, lambda model, batch: model(**batch).loss)`"
            )
        quiet.backward(loss)

    def forward_backward(self, batch: Any, loss_fn: LossFn) -> torch.Tensor | None:
        """One micro-batch through the strategy's per-micro-batch contract: ``loss_fn(model, batch)`` (the
        micro-batch's own loss; it must call ``model`` once) and backward; the ``Strategy.step()`` is owed, as
        after :meth:`backward`.

        Every strategy takes it; a strategy that schedules forward and backward itself (``cdp``) takes only
        this. Use it inside ``accelerator.accumulate(model)`` in place of computing the loss and calling
        :meth:`backward`; ``optimizer.step()`` and the scheduler follow as usual. Returns the detached loss of
        the micro-batch(es) whose backward completed in this call, or None while ``cdp``'s pipeline fills.
        """
        return self._quiet("forward_backward").forward_backward(batch, loss_fn)

    def gather(self, tensor: Any) -> Any:
        """``Accelerator.gather``; refused while a strategy whose workers drift apart trains (see :meth:`_meet`)."""
        self._meet("gather")
        return super().gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """``Accelerator.gather_for_metrics``; refused while a strategy whose workers drift apart trains."""
        self._meet("gather_for_metrics")
        return super().gather_for_metrics(input_data, use_gather_object=use_gather_object)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """``Accelerator.reduce``; refused while a strategy whose workers drift apart trains."""
        self._meet("reduce")
        return super().reduce(tensor, reduction=reduction, scale=scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """``Accelerator.pad_across_processes``; refused while a strategy whose workers drift apart trains."""
        self._meet("pad_across_processes")
        return super().pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def wait_for_everyone(self) -> None:
        """``Accelerator.wait_for_everyone``; refused while a strategy whose workers drift apart trains."""
        self._meet("wait_for_everyone")
        super().wait_for_everyone()

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """``Accelerator.save_state``, with every rank writing its own strategy state (a shard, a decoupled
        momentum, an outer optimizer: ``quietsync-optimizer-rank{R}-of-{W}.pt``) where Accelerate would write one
        optimizer file from the main process; it returns once every process has written its files. Every process
        calls it; refused while a strategy whose workers drift apart trains (see :meth:`_meet`). Returns the
        folder."""
        quiet = self.quiet_optimizer
        if quiet is None:
            return super().save_state(output_dir, safe_serialization, **kwargs)
        self._meet("save_state")
        state = quiet.state_dict()  # first: a strategy that cannot checkpoint now (cdp mid-run) refuses unwritten
        # the parameters view the strategy's flat buffers, whose shared storage safetensors refuses: save copies
        handle = self.register_save_state_pre_hook(_own_storage)
        try:
            with self._without(quiet):
                location = super().save_state(output_dir, safe_serialization, **kwargs)
        finally:
            handle.remove()
        os.makedirs(location, exist_ok=True)
        torch.save(state, os.path.join(location, optimizer_file(self.process_index, self.num_processes)))
        # Accelerate writes the model and schedulers from the main process and does not wait for it: a rank that
        # loads right after (no collective between: a local method's inner steps) found scheduler.bin missing
        super().wait_for_everyone()
        return location

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        """``Accelerator.load_state``, with every rank loading its own strategy state (see :meth:`save_state`).

        Raises:
            ValueError: the folder holds no strategy state for this rank and number of processes.
        """
        quiet = self.quiet_optimizer
        if quiet is None:
            super().load_state(input_dir, load_kwargs, **kwargs)
            return
        self._meet("load_state")
        where: list[str] = []  # the folder Accelerate resolved (the latest checkpoint under automatic naming)
        handle = self.register_load_state_pre_hook(lambda models, folder: where.append(folder))
        try:
            # the model too: its parameters are part of the strategy's state, and safetensors refuses to load into
            # tensors that share the strategy's flat buffers
            with self._without(quiet, model=True):
                super().load_state(input_dir, load_kwargs, **kwargs)
        finally:
            handle.remove()
        path = os.path.join(where[0], optimizer_file(self.process_index, self.num_processes))
        if not os.path.isfile(path):
            raise ValueError(f"{where[0]} holds no quietsync optimizer state for rank {self.process_index} of "
                             f"{self.num_processes} ({os.path.basename(path)}): save it with "
                             "QuietAccelerator.save_state on as many processes")
        quiet.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))  # this run's own file

    @contextlib.contextmanager
    def _without(self, quiet: QuietOptimizer, model: bool = False) -> Iterator[None]:
        """Accelerate's own checkpointing without the strategy's optimizer (saved per rank instead) and, with
        ``model``, without its model (whose parameters the strategy's state holds)."""
        optimizers, models = self._optimizers, self._models
        self._optimizers = [o for o in optimizers if o is not quiet]
        if model:
            self._models = [m for m in models if m is not quiet.model and m is not quiet.strategy.module]
        try:
            yield
        finally:
            self._optimizers, self._models = optimizers, models

    def _meet(self, call: str) -> None:
        """Refuse a collective of the loop's between micro-batches of a strategy whose workers are not in lockstep
        (``Strategy.steps_together``), in one line on every process that calls it: a peer a stage ahead may be waiting
        inside its step for this worker, or may have stopped already, and the collective would never complete."""
        quiet = self.quiet_optimizer
        if quiet is None or quiet.strategy.finished or quiet.strategy.steps_together(quiet.strategy.config):
            return
        raise RuntimeError(
            f"accelerator.{call} while strategy {quiet.strategy.name} trains: its workers do not reach a step "
            "together, so a collective between micro-batches can wait forever; call it after optimizer.finish() "
            "(or accelerator.end_training()), or log each process's own values"
        )

    def _quiet(self, call: str) -> QuietOptimizer:
        if self.quiet_optimizer is None:
            raise RuntimeError(f"call accelerator.prepare(model, optimizer, ...) before accelerator.{call}")
        return self.quiet_optimizer

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
        """Finish the run (``QuietOptimizer.finish``: the last round synced or drained; nothing if it was called
        already), close the strategy (background threads, process groups), then Accelerate's own end of
        training. Every process calls it."""
        if self.quiet_optimizer is not None:
            try:
                self.quiet_optimizer.finish()
            finally:  # close even when finishing fails: threads and process groups must still be released
                self.quiet_optimizer.close()
        super().end_training()
