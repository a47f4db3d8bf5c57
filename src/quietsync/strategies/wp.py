"""``wp``: Weight Prediction (ACCO-wp; papers 000/003, eq. WP).

Like DPU, the communication worker applies the previous round's gradients while the main thread computes,
but the main thread computes at a *prediction* of the next parameters instead of the stale ones::

    gᵢ⁽ᵗ⁺¹⁾ = Σₖ ∇F(θ̃⁽ᵗ⁾, ξᵢₖ)   ‖   θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, ḡ⁽ᵗ⁾),   θ̃⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁺¹⁾, ḡ⁽ᵗ⁾)

The prediction is a second optimizer step with the same gradient, taken on a scratch copy of the shard
state: it never commits optimizer state (moments, step counter). The first overlapped round computes at
θ (the paper's ``Est(•)`` is free there). ``sync_warmup_steps`` blocking steps may come first, as for DPU.

The model holds θ̃, not θ, between committed steps: ``committed_params()`` all-gathers θ from the master
shards (a snapshot of the shard is kept so that it works while the next update is in flight), so every
worker must enter it at the same committed step (the trainer does, right after ``step()`` returned True).
"""

from __future__ import annotations

from dataclasses import dataclass

from .dpu import DelayedBase, DPUConfig
from .registry import register


@dataclass
class WPConfig(DPUConfig):
    """Knobs of ``wp`` (same as ``dpu``)."""


@register("wp", WPConfig)
class WP(DelayedBase):
    """Weight prediction; see the module docstring."""

    config: WPConfig
    predict = True
    uses_estimate = True
    keeps_snapshot = True
