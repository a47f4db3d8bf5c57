"""Any quietsync strategy from a 🤗 ``transformers.Trainer`` run: :class:`QuietTrainer`.

::

    trainer = QuietTrainer(model=model, args=TrainingArguments(..., max_grad_norm=0.0),
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
* :meth:`training_step` — forward through the strategy's module, the micro-batch's own mean loss to
  ``Strategy.backward`` + ``Strategy.step()`` (the strategy divides by its micro-batch count, replacing
  the Trainer's division by ``gradient_accumulation_steps``).

Accumulation: the Trainer's ``gradient_accumulation_steps`` becomes the strategy's ``accumulation`` (ddp,
zero1, demo, ...); strategies that decide their own (acco, dpu, wp) need it to be 1. Evaluation and
``save_model`` run inside ``committed_params()``.

Not supported: gradient clipping (``max_grad_norm`` must be 0 — the strategy commits inside backward, before
the Trainer would clip), fp16 loss scaling, DeepSpeed/FSDP, resuming the *optimizer* from a Trainer
checkpoint (the strategy state is per rank and the Trainer saves one optimizer file; use
``save_only_model=True`` or save ``trainer.optimizer.state_dict()`` per rank yourself).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from .quiet_optimizer import QuietOptimizer
from .strategies import StrategyConfig
from .strategies.registry import get as get_strategy
from .transport import Transport

try:
    from transformers import Trainer
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
        ValueError: unknown strategy (listing the choices), ``max_grad_norm > 0``, fp16, DeepSpeed or FSDP.
    """

    def __init__(self, *args: Any, strategy: str, strategy_config: StrategyConfig | dict[str, Any] | None = None,
                 transport: Transport | None = None, **kwargs: Any) -> None:
        get_strategy(strategy)
        self.quiet_strategy = strategy
        self.quiet_config = strategy_config
        self.quiet_transport = transport
        super().__init__(*args, **kwargs)
        if self.args.max_grad_norm and self.args.max_grad_norm > 0:
            raise ValueError(
                f"max_grad_norm={self.args.max_grad_norm}: gradient clipping is not supported with quietsync "
                "strategies (they commit inside backward); pass TrainingArguments(max_grad_norm=0.0)"
            )
        if self.args.fp16:
            raise ValueError("fp16 (loss scaling) is not supported with quietsync strategies; use bf16 or fp32")
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
        )
        if self.optimizer.strategy.world_size != self.accelerator.num_processes:
            raise ValueError(
                f"the transport sees {self.optimizer.strategy.world_size} workers, Accelerate "
                f"{self.accelerator.num_processes}: launch with torchrun or accelerate launch"
            )
        # A model the Trainer considers wrapped is not passed through accelerator.prepare (no DDP).
        self.model_wrapped = QuietModule(self.optimizer)
        return self.optimizer

    def training_step(self, model: nn.Module, inputs: dict[str, torch.Tensor | Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """One micro-batch through the strategy; returns the loss scaled for the Trainer's logging."""
        quiet = self.quiet_optimizer
        if quiet is None:
            raise RuntimeError("QuietTrainer.training_step before create_optimizer")
        quiet.model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            # Without num_items_in_batch the model returns the micro-batch's mean loss: the strategy's
            # gradient convention (sum of micro-batch gradients / global micro-batch count) does the rest.
            loss = self.compute_loss(quiet.model, inputs)
        quiet.backward(loss)
        return loss.detach() / self.current_gradient_accumulation_steps

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        # The strategy has already committed (and reset its gradients): a norm here would read 0.
        return grad_norm

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
