"""Any quietsync strategy from a 🤗 ``transformers.Trainer`` run: :class:`QuietTrainer`.

::

    trainer = QuietTrainer(model=model, args=TrainingArguments(..., bf16=True),
                           train_dataset=ds, strategy="zero1")        # was Trainer(model=..., args=..., ...)
    trainer.train()

Why a ``Trainer`` subclass and not a ``TrainerCallback`` + ``optimizers=(opt, sched)``: callbacks only
observe (``on_step_end`` etc. cannot replace the backward), and an optimizer object alone cannot stop the
Trainer from routing every micro-batch through ``accelerator.backward`` of a model Accelerate has wrapped
in DDP. The strategy must see each micro-batch's backward and must be the only thing communicating, so the
subclass overrides the two hooks the Trainer documents for exactly this ("subclass and override"):

* :meth:`create_optimizer` — builds the optimizer the Trainer would (``args.optim``, weight-decay groups,
  or the one passed in ``optimizers=``) and turns it into a :class:`~quietsync.quiet_optimizer.QuietOptimizer`.
  Its ``param_groups`` are that optimizer's, so the Trainer's scheduler (or yours) sets the lr the strategy
  applies; its ``step_was_skipped`` tells the Trainer not to step the scheduler when the strategy did not
  commit. It also hands the Trainer the strategy's forward module in a thin wrapper, so the Trainer treats
  the model as already wrapped and does not ask Accelerate for DDP.
* :meth:`training_step` — the micro-batch and a loss function (the Trainer's own ``compute_loss``, under the
  strategy's autocast) go to the strategy's per-micro-batch contract, ``Strategy.forward_backward``, so every
  strategy works, ``cdp`` (which schedules forward and backward itself) included. The micro-batch's own mean
  loss is what the strategy back-propagates (it divides by its micro-batch count, replacing the Trainer's
  division by ``gradient_accumulation_steps``); the ``Strategy.step()`` owed for it runs in
  :meth:`_clip_grad_norm` or the Trainer's ``optimizer.step()``.

The end of training: once the Trainer decides to stop (``max_steps`` reached, or a callback's
``should_training_stop``), before its last save and evaluation, the strategy finishes
(``QuietOptimizer.finish``: ``localsgd``/``diloco`` sync their last partial round, ``acco``/``dpu``/``wp``
drain theirs), so what the Trainer saves and evaluates holds every step. The Trainer's ``max_steps`` counts its
own optimizer steps (``gradient_accumulation_steps`` micro-batches each); strategies that decide their own
accumulation (acco, dpu, wp, cdp) commit on some of them (``step_was_skipped`` on the others, and the Trainer's
scheduler then waits), so they end with fewer committed steps than ``max_steps``.

Accumulation: the Trainer's ``gradient_accumulation_steps`` becomes the strategy's ``accumulation`` (ddp,
zero1, demo, ...); strategies that decide their own (acco, dpu, wp) need it to be 1. Evaluation and
``save_model`` run inside ``committed_params()``.

Checkpoints and evaluations during training (``save_strategy``, ``eval_strategy``): before either, the workers
are brought level (``QuietOptimizer.level``). For a strategy in lockstep that is nothing; ``acco``/``dpu``/``wp``,
whose workers may be a stage apart, each waiting on a job the other has not submitted yet, commit the round in
flight (``dpu``/``wp`` with one more update for the stage in progress; ``acco`` ends a stage 1 as its straggler rule
does, so its gradients are committed, and drops a stage 2's gradients at the estimate, as ``finish()`` does) and
refill their pipeline afterwards, as after a resume: a save or an evaluation costs them some overlap, not a hang.
A strategy that keeps micro-batches in flight across steps (``cdp``: ``Strategy.resumable`` False) takes
checkpoints with ``save_only_model=True`` only.

Precision and clipping are the strategy's: ``bf16``/``fp16`` become its ``precision`` (autocast of the forward
in ``training_step`` and evaluation, fp32 master weights; fp16 adds the strategy's loss scaling, whose skip
decision every worker shares), and ``max_grad_norm`` (the Trainer's default 1.0 included; 0 = off) its
``max_grad_norm``: the strategy clips the gradient it commits and the Trainer logs the pre-clip ``grad_norm``.

The Trainer communicates between steps (it gathers the token counts before each step and the loss at its
logging steps), which the strategy is told (``Strategy.loop_collectives``): a worker of ``acco``/``dpu``/``wp``
never waits inside a step for a peer that may be waiting in one of those gathers (``acco``'s straggler rule is
off). A stage cap (``max_accumulation``) still waits, safely: the per-step gather (``average_tokens_across_devices``,
the default, with labels in the batch) keeps the workers within one step of each other, and a peer then has
submitted the job waited for by the time it reaches the step where the cap is hit.

Resuming (``trainer.train(resume_from_checkpoint=...)``): the strategy's state is per rank (a shard, a decoupled
momentum, an outer optimizer), so every rank saves its own ``QuietOptimizer.state_dict()`` into the checkpoint
(``quietsync-optimizer-rank{R}-of-{W}.pt``, where the Trainer would write one ``optimizer.pt`` from rank 0) and loads
it back on resume, with the same number of processes; the Trainer restores the model, scheduler, RNG and data
position as usual.

Not supported: DeepSpeed/FSDP; resuming on another number of processes.
"""

from __future__ import annotations

import contextlib
import glob
import os
from typing import Any

import torch
from torch import nn

from .quiet_optimizer import QuietOptimizer, loop_collectives_problem, optimizer_file
from .strategies import StrategyConfig
from .strategies.registry import get as get_strategy
from .strategies.registry import strategy_config as resolve_config
from .transport import Transport

try:
    from transformers import Trainer
    from transformers.trainer import SCHEDULER_NAME
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("quietsync.hf_trainer needs 🤗 transformers: pip install transformers") from exc

__all__ = ["QuietModule", "QuietTrainer"]


class QuietModule(nn.Module):
    """What the Trainer holds as its wrapped model: forward goes to the strategy's module.

    ``zero_grad`` is a no-op (the strategy owns the gradient buffers; the Trainer calls ``model.zero_grad()``
    after each step), and the Trainer, seeing a wrapped model, leaves it to us instead of DDP-wrapping it.
    """

    def __init__(self, optimizer: QuietOptimizer) -> None:
        super().__init__()
        self.quiet = optimizer.model
        self._optimizer = optimizer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.quiet(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: the strategy resets its gradients after each committed step."""


class QuietTrainer(Trainer):
    """``transformers.Trainer`` training through a quietsync strategy (see the module docstring).

    Args:
        strategy: a registered strategy name (``quietsync.strategies.available()``).
        strategy_config: that strategy's config dataclass or a dict of its fields.
        transport: the transport (default: from the launcher's environment, reusing the default group).
        *args, **kwargs: ``Trainer``'s arguments.

    Raises:
        ValueError: unknown strategy (listing the choices), a negative ``max_grad_norm``, DeepSpeed or FSDP, a
            strategy that refuses the precision (cdp: fp16).
    """

    def __init__(self, *args: Any, strategy: str, strategy_config: StrategyConfig | dict[str, Any] | None = None,
                 transport: Transport | None = None, **kwargs: Any) -> None:
        get_strategy(strategy)  # an unknown name fails before the Trainer builds anything
        problem = loop_collectives_problem(resolve_config(strategy, strategy_config))  # the Trainer gathers per step
        if problem:
            raise ValueError(problem)
        self.quiet_strategy = strategy
        self.quiet_config = strategy_config
        self.quiet_transport = transport
        super().__init__(*args, **kwargs)
        norm = self.args.max_grad_norm
        if norm is not None and not norm >= 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0: no clipping), got {norm}")
        self.quiet_precision = "fp16" if self.args.fp16 else "bf16" if self.args.bf16 else "fp32"
        """The strategy's ``precision``, from ``args.fp16`` / ``args.bf16``."""
        cls, _ = get_strategy(strategy)
        if self.quiet_precision == "fp16" and cls.fp16_problem():  # the strategy's own line (args.fp16)
            raise ValueError(cls.fp16_problem())
        saves = getattr(self.args.save_strategy, "value", self.args.save_strategy) != "no"
        if not cls.resumable and saves and not self.args.save_only_model:  # Strategy.resumable
            raise ValueError(
                f"strategy {strategy} keeps micro-batches in flight across steps, so a checkpoint taken during "
                "training cannot hold its optimizer state: pass save_only_model=True (the model alone) or "
                "save_strategy='no'"
            )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("quietsync strategies replace data parallelism; DeepSpeed/FSDP are not supported")

    @property
    def quiet_optimizer(self) -> QuietOptimizer | None:
        """The :class:`QuietOptimizer` once training started (None before)."""
        return self.optimizer if isinstance(self.optimizer, QuietOptimizer) else None

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer, handed to the strategy; the Trainer keeps a :class:`QuietOptimizer`."""
        if isinstance(self.optimizer, QuietOptimizer):
            return self.optimizer
        spec = super().create_optimizer(model)
        self.optimizer = QuietOptimizer(
            self.model, spec, self.quiet_strategy, config=self.quiet_config,
            accumulation=self.args.gradient_accumulation_steps, transport=self.quiet_transport,
            # the Trainer's max_grad_norm 0 (no clipping) is the strategy's None
            precision=self.quiet_precision, max_grad_norm=self.args.max_grad_norm or None,
            loop_collectives=True,  # the Trainer gathers token counts before each step and the loss when it logs
        )
        if self.optimizer.strategy.world_size != self.accelerator.num_processes:
            raise ValueError(
                f"the transport sees {self.optimizer.strategy.world_size} workers, Accelerate "
                f"{self.accelerator.num_processes}: launch with torchrun or accelerate launch"
            )
        # A model the Trainer considers wrapped is not passed through accelerator.prepare (no DDP).
        self.model_wrapped = QuietModule(self.optimizer)
        # ... and one Accelerate holds is not prepared by an evaluation either: its model.to(accelerator.device) --
        # "cpu:0" on several CPU processes -- would copy the parameters out of the strategy's buffers
        if self.model not in self.accelerator._models:
            self.accelerator._models.append(self.model)
        return self.optimizer

    def training_step(self, model: nn.Module, inputs: dict[str, torch.Tensor | Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """One micro-batch through the strategy (``forward_backward`` with ``compute_loss`` as the loss
        function); returns the loss scaled for the Trainer's logging (NaN while ``cdp``'s pipeline fills, which
        the Trainer's ``logging_nan_inf_filter`` skips)."""
        quiet = self.quiet_optimizer
        if quiet is None:
            raise RuntimeError("QuietTrainer.training_step before create_optimizer")
        quiet.model.train()
        inputs = self._prepare_inputs(inputs)

        def loss_fn(module: Any, batch: dict[str, Any]) -> torch.Tensor:
            # Without num_items_in_batch the model returns the micro-batch's mean loss: the strategy's gradient
            # convention (sum of micro-batch gradients / global micro-batch count) does the rest.
            with self.compute_loss_context_manager():
                return self.compute_loss(module, batch)

        loss = quiet.forward_backward(inputs, loss_fn)
        if loss is None:
            return torch.tensor(float("nan"), device=self.args.device)
        # the Trainer adds up the returns of its accumulation steps to log one step's loss
        return loss.detach() / self.current_gradient_accumulation_steps

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> Any:
        # Called after every Trainer step, after the callbacks decided whether training stops: finish the
        # strategy before the Trainer's last save and evaluation see the model.
        if self.control.should_training_stop:
            self.finish()
        elif self.control.should_save or self.control.should_evaluate:
            quiet = self.quiet_optimizer
            if quiet is not None and not quiet.strategy.finished:
                # acco/dpu/wp workers may be a stage apart, each waiting on a job the other has not submitted: the
                # save's and evaluation's collectives would interleave with those jobs (a hang)
                quiet.level()
        return super()._maybe_log_save_evaluate(*args, **kwargs)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; the strategy is finished at the end (every process), if it was not yet."""
        out = super().train(*args, **kwargs)
        self.finish()
        return out

    def finish(self, sync: bool = True) -> int:
        """``QuietOptimizer.finish`` (the last round synced or drained); nothing before training or once done."""
        quiet = self.quiet_optimizer
        if quiet is None or quiet.strategy.finished:
            return 0
        return quiet.finish(sync)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank saves its own strategy state (the Trainer's one ``optimizer.pt`` would hold rank 0's); rank 0
        the scheduler, as the Trainer does."""
        quiet = self.quiet_optimizer
        if quiet is None:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        os.makedirs(output_dir, exist_ok=True)
        torch.save(quiet.state_dict(), os.path.join(output_dir, optimizer_file(self.args.process_index,
                                                                               self.args.world_size)))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """This rank's strategy state and the scheduler from ``checkpoint`` (nothing there, as the Trainer does when
        a checkpoint holds the model alone).

        Raises:
            ValueError: the checkpoint was saved by another number of processes.
        """
        quiet = self.quiet_optimizer
        if checkpoint is None or quiet is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        rank, world = self.args.process_index, self.args.world_size
        path = os.path.join(checkpoint, optimizer_file(rank, world))
        if not os.path.isfile(path):
            others = sorted(glob.glob(os.path.join(checkpoint, optimizer_file("*", "*"))))
            if others:
                raise ValueError(f"{checkpoint} holds the quietsync optimizer state of another number of processes "
                                 f"({os.path.basename(others[0])}, ...), this run has {world}: resume with as many")
            return
        quiet.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))  # this run's own file
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, map_location="cpu", weights_only=True))

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> contextlib.AbstractContextManager:
        """The strategy's autocast (``bf16``/``fp16``) around the forward of training and evaluation: the
        Trainer leaves autocast to Accelerate's model preparation, which a quietsync model skips."""
        quiet = self.quiet_optimizer
        return quiet.strategy.autocast() if quiet is not None else contextlib.nullcontext()

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        """The strategy clips the gradient it commits (to ``max_grad_norm``): pay the step the last backward
        owes and return the committed gradient's pre-clip norm (NaN when no step committed)."""
        quiet = self.quiet_optimizer
        assert quiet is not None
        return quiet.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        """The pre-clip norm of the committed gradient, as a float (None when it was not measured: no clipping)."""
        if grad_norm is None:
            return None
        value = float(grad_norm)
        return None if value != value else value  # NaN: no step committed here

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """``Trainer.evaluate`` on the committed parameters."""
        with self._committed():
            return super().evaluate(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model`` of the committed parameters."""
        with self._committed():
            super().save_model(output_dir, _internal_call=_internal_call)

    @contextlib.contextmanager
    def _committed(self) -> Any:
        quiet = self.quiet_optimizer
        if quiet is None:
            yield
        else:
            with quiet.committed_params():
                yield
