"""Mixed precision of a strategy (a policy and a part): autocast of the forward, dynamic loss scaling for fp16.

One policy per strategy, the ``precision`` argument of every strategy (``make_strategy(..., precision="bf16")``,
``quietsync train --precision bf16``):

* ``fp32`` — nothing changes (the default; the strategies' numerics are exactly those of earlier releases);
* ``bf16`` — the forward (``Strategy.forward_backward``'s ``loss_fn``, or whatever runs inside
  ``Strategy.autocast()``) runs under ``torch.autocast(device, torch.bfloat16)``; the backward follows the
  forward's dtypes; parameters, gradients, master weights and optimizer state stay fp32;
* ``fp16`` — the same with ``torch.float16``, plus **dynamic loss scaling** (:class:`LossScaler`): each
  micro-batch's loss is multiplied by the scale ``S`` before its backward, the strategy divides the gradient it
  is about to commit by ``S``, and when that gradient holds an infinity or a NaN (on any worker: the decision is
  shared, see :mod:`~quietsync.strategies.parts.clipping`) the round is dropped on every worker and ``S`` halves;
  after ``growth_interval`` committed steps in a row ``S`` doubles. The constants are torch's ``GradScaler``'s.

What autocast changes is compute only: a strategy never stores parameters in bf16/fp16 because of it (the model's
parameters must be fp32 for ``bf16``/``fp16``). The dtypes of the wire (``reduce_dtype``, ``transfer_dtype``,
``pseudo_grad_dtype``) are separate knobs of the strategies and combine freely with the precision.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from ...validate import check_choice, check_float, check_int
from .part import Part

PRECISIONS = ("fp32", "bf16", "fp16")
"""Values of ``precision``."""

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
MIN_SCALE = 2.0**-24
"""The loss scale never backs off below this (a scale that keeps halving means a non-finite loss, not an
overflow of the gradient; the trainer's ``--on-nonfinite`` stops such a run)."""


@dataclass(frozen=True)
class Precision:
    """The mixed-precision policy of a strategy (``precision="bf16"`` is ``Precision("bf16")``)."""

    name: str = "fp32"
    """fp32 (no autocast), bf16 (autocast to bfloat16) or fp16 (autocast to float16 + dynamic loss scaling)."""
    init_scale: float = 2.0**16
    """fp16: the first loss scale."""
    growth_factor: float = 2.0
    """fp16: the scale is multiplied by this after ``growth_interval`` committed steps in a row."""
    backoff_factor: float = 0.5
    """fp16: the scale is multiplied by this when a round overflows (and the round is dropped)."""
    growth_interval: int = 2000
    """fp16: committed steps without an overflow before the scale grows."""

    def __post_init__(self) -> None:
        check_choice("precision", self.name, PRECISIONS)
        check_float("init_scale", self.init_scale, 0, low_open=True)
        check_float("growth_factor", self.growth_factor, 1, low_open=True)
        check_float("backoff_factor", self.backoff_factor, 0, 1, low_open=True, high_open=True)
        check_int("growth_interval", self.growth_interval, 1)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype autocast computes in (None for fp32)."""
        return _AUTOCAST.get(self.name)

    @property
    def loss_scaling(self) -> bool:
        """Whether the loss is scaled (fp16)."""
        return self.name == "fp16"

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` on ``device_type`` for bf16/fp16; a do-nothing context for fp32."""
        dtype = self.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=dtype)


def parse_precision(value: str | Precision) -> Precision:
    """``"bf16"`` → ``Precision("bf16")``; a :class:`Precision` as is; an error naming ``precision`` otherwise."""
    if isinstance(value, Precision):
        return value
    if not isinstance(value, str):
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {value!r}")
    return Precision(value)


def check_model_dtype(model: torch.nn.Module, precision: Precision) -> None:
    """bf16/fp16 autocast an fp32 model (fp32 master weights): refuse trainable parameters in another dtype."""
    if precision.autocast_dtype is None:
        return
    for name, p in model.named_parameters():
        # frozen or integer parameters are no master weights: they may keep their dtype
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
            raise ValueError(
                f"precision {precision.name} autocasts an fp32 model (the parameters stay fp32: master weights "
                f"and optimizer state), but parameter {name} is {p.dtype}; load the model in float32"
            )


class LossScaler(Part):
    """Dynamic loss scaling for fp16 (a part): the scale, its growth counter, and the overflows it skipped.

    The strategy multiplies each micro-batch's loss by :attr:`scale` (:meth:`scale_loss`), divides the gradient
    it commits by the scale of the round that produced it, and reports whether that gradient was finite with
    :meth:`update` — the same decision on every worker, so every worker's scale follows the same sequence.
    Checkpointed with the strategy.
    """

    def __init__(self, precision: Precision) -> None:
        if not precision.loss_scaling:
            raise ValueError(f"loss scaling is for precision fp16, got {precision.name}")
        self.precision = precision
        self.scale = float(precision.init_scale)
        """The current loss scale S."""
        self.good_steps = 0
        """Committed steps since the last overflow or growth."""
        self.skipped = 0
        """Rounds dropped for an overflow since the last :meth:`take_skipped`."""
        self.skipped_total = 0
        """Rounds dropped for an overflow in the whole run."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``S · loss`` (what backward runs on)."""
        return loss * self.scale

    def update(self, finite: bool) -> None:
        """After a round's gradient was checked: grow the scale after ``growth_interval`` finite rounds in a
        row, halve it (and count a skipped round) after an overflow."""
        p = self.precision
        if finite:
            self.good_steps += 1
            if self.good_steps >= p.growth_interval:
                grown = self.scale * p.growth_factor
                if math.isfinite(grown):  # a scale grown to inf would make every loss non-finite
                    self.scale = grown
                self.good_steps = 0
        else:
            self.scale = max(self.scale * p.backoff_factor, MIN_SCALE)
            self.good_steps = 0
            self.skipped += 1
            self.skipped_total += 1

    def take_skipped(self) -> int:
        """Rounds dropped since the last call (reported with the next committed step)."""
        n, self.skipped = self.skipped, 0
        return n

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped,
                "skipped_total": self.skipped_total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:  # a checkpoint written without fp16
            return
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped = int(state["skipped"])
        self.skipped_total = int(state["skipped_total"])
