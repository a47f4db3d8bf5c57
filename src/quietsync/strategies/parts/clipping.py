"""The gradient a strategy commits, made ready: unscaled (fp16), its global norm measured, clipped.

Every strategy calls :func:`prepare_gradient` on the gradient it is about to commit — the gradient the
optimizer will use, after whatever averaging the strategy does — when clipping (``max_grad_norm``) or fp16 loss
scaling is on (with neither, nothing runs and nothing is communicated). It

1. divides the gradient by the loss scale of the round that produced it (fp16);
2. measures its global L2 norm ``‖g‖ = sqrt(Σ g²)``: where the gradient is sharded over a group (ZeRO-1's
   flat shard, FSDP2's dim-0 shards), each worker sums the squares of its shard and **one scalar all-reduce**
   through the transport (metered, ``all_reduce/grad_norm``) adds the shards' sums;
3. decides whether it is finite, the same way on every worker: a sum that went through the all-reduce is the
   same number everywhere (a non-finite element makes it non-finite); a gradient every worker holds whole and
   equal (DDP's averaged one) needs nothing; a gradient that differs between workers (a local method's) needs
   one more scalar all-reduce of a flag over ``world`` (``all_reduce/found_inf``), fp16 only;
4. clips it: ``g ← g · max_grad_norm / (‖g‖ + 1e-6)`` when that factor is below 1 — the rule of
   ``torch.nn.utils.clip_grad_norm_`` (its ``1e-6`` included), which the tests use as the oracle.

The pre-clip norm is reported in the committed step's ``StepMetrics.extra["grad_norm"]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...transport import Transport

CLIP_EPS = 1e-6
"""``torch.nn.utils.clip_grad_norm_``'s: the factor is ``max_norm / (norm + 1e-6)``."""


def check_max_grad_norm(value: object) -> float | None:
    """``max_grad_norm`` is None (no clipping), a number > 0, or ``inf`` (measure the norm, clip nothing);
    returned as a float."""
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0  # NaN fails too
    if not ok:
        raise ValueError(f"max_grad_norm must be a number > 0 (inf: measure the norm without clipping) or None "
                         f"(no clipping), got {value!r}")
    return float(value)


@dataclass
class GradientCheck:
    """What :func:`prepare_gradient` found."""

    norm: float
    """Global L2 norm of the (unscaled) gradient before clipping (NaN when not measured)."""
    finite: bool
    """Whether every element is finite — the same answer on every worker when fp16 asked for agreement."""
    clipped: bool
    """Whether the gradient was scaled down."""


def sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """``Σ g²`` over ``grads`` as an fp32 scalar (per tensor through ``torch.linalg.vector_norm``)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), dtype=torch.float32) for g in grads])
    return norms.square().sum()


def prepare_gradient(
    grads: list[torch.Tensor],
    *,
    max_norm: float | None,
    scale: float | None,
    transport: Transport,
    norm_group: str | None = None,
    agree_group: str | None = None,
) -> GradientCheck:
    """Unscale, measure, agree and clip ``grads`` in place (see the module docstring).

    Args:
        grads: the tensors of the gradient about to be committed (this worker's shard of it, if sharded).
        max_norm: clip to this global norm (None: measure only when asked to check finiteness).
        scale: the loss scale the gradient carries (fp16), or None.
        transport: the transport of the collectives.
        norm_group: the group over which ``grads`` are shards of one gradient (their squares are summed over
            it); None when this worker holds the whole gradient.
        agree_group: fp16 only: the group over which the finite decision must be made common with a flag
            all-reduce (None: already common — the same on every worker by construction, or via the norm's
            all-reduce when it equals ``norm_group``).
    """
    grads = [g for g in grads if g is not None]  # a parameter without a gradient adds nothing and is not scaled
    if scale is not None and scale != 1.0:
        torch._foreach_mul_(grads, 1.0 / scale)
    sumsq = sum_of_squares(grads)
    if grads:
        sumsq = sumsq.to(grads[0].device)
    if norm_group is not None and transport.group_size(norm_group) > 1:
        transport.all_reduce(sumsq, norm_group, op="sum", name="all_reduce/grad_norm")
    norm = math.sqrt(float(sumsq)) if float(sumsq) >= 0 else float("nan")
    finite = math.isfinite(norm)
    if scale is not None and agree_group is not None and agree_group != norm_group \
            and transport.group_size(agree_group) > 1:
        # max of the flags: an overflow on any worker drops the round on every worker
        flag = torch.tensor([0.0 if finite else 1.0], device=sumsq.device)
        transport.all_reduce(flag, agree_group, op="max", name="all_reduce/found_inf")
        finite = float(flag) == 0.0
    clipped = False
    # no factor from a non-finite norm (it would be 0 or NaN): such a gradient stays as it is
    if finite and max_norm is not None:
        coef = max_norm / (norm + CLIP_EPS)
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
            clipped = True
    return GradientCheck(norm=norm, finite=finite, clipped=clipped)
