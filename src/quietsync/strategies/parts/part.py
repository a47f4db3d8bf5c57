"""The part protocol: what a component a strategy holds may offer, declared once.

A strategy *holds* its parts (:meth:`~quietsync.strategies.base.Strategy.hold`) rather than inheriting them.
The base strategy then treats every held part alike: it checkpoints it under its name (and, for a strategy that
reshards, merges its logical state), merges its position counters into the strategy's
:meth:`~quietsync.strategies.base.Strategy.position`, adds its buffers to
:meth:`~quietsync.strategies.base.Strategy.memory_report`, hands it each micro-batch's loss if it takes losses,
forgets its open round when a round is discarded, and closes it with the strategy. :class:`Part` declares those
methods with do-nothing defaults, so a part overrides only what it has; nothing is looked up by name.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch


class Part:
    """Base class of everything a strategy holds (see the module docstring); every method is optional."""

    prepares_gradient: ClassVar[bool] = False
    """Whether the part unscales (fp16) and clips (``max_grad_norm``) the gradient its strategy commits (the
    ``Replicated`` substrate does), so the strategy keeps both knobs without doing it itself."""

    def backward(self, loss: torch.Tensor) -> bool:
        """Take one micro-batch's (scaled) loss, for the part that accumulates the round's gradient; returns whether
        it took it (the base strategy's default backward hands the loss to the first part that does)."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep of this part (empty: nothing)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` returned."""

    def position(self) -> dict[str, int]:
        """Counters that place the part in the algorithm (checked equal across workers on resume)."""
        return {}

    def memory_report(self) -> dict[str, int]:
        """Bytes of each buffer the part holds."""
        return {}

    def summary(self) -> dict[str, str]:
        """Lines the run's summary shows about what the part did (label: value; empty: none)."""
        return {}

    @property
    def round_full(self) -> bool | None:
        """For the part that counts the open round: whether the next step commits; None for other parts."""
        return None

    def logical_state(self) -> dict[str, torch.Tensor]:
        """The part's world-size-independent tensors, by logical name (strategies that reshard merge them)."""
        return {}

    def logical_targets(self, saved: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Tensors laid out for this worker to read :meth:`logical_state` of any world size into (``saved``: the
        checkpoint's ``{key: (shape, dtype)}``)."""
        return {}

    def load_logical(self, filled: dict[str, torch.Tensor]) -> None:
        """Take the state :meth:`logical_targets` was filled with."""

    def discard(self) -> None:
        """Forget the open round's contribution (``Strategy.discard_round``)."""

    def quiesce(self) -> None:
        """Wait for the part's background exchange in flight, if any (its result stays due as before)."""

    def close(self) -> None:
        """Stop background work and release resources (called once, in reverse order of holding)."""
