"""Error feedback: a residual any sender holds, so what compression drops is sent later instead of lost.

With a compressor ``C`` (a :class:`~.chain.Chain` or a single link) and a residual ``e`` (zeros at first),
every :meth:`ErrorFeedback.compress` of a flat tensor ``x`` does

    a = β·e + x          (the accumulated value; β = ``decay``, 1 for plain error feedback)
    q = C(a)             (the payload that travels)
    e ← a − decode(q)    (what did not travel)

so ``decode(q) + e = a``: transmitted + residual = accumulated. In floating point ``e`` is one rounded
subtraction; it is exact -- and the identity holds bit for bit -- whenever ``decode(q)`` is ``a`` itself or 0
(top-k selection) or lies within a factor 2 of ``a`` (Sterbenz: nearest rounding on a grid that contains 0
and whose gaps are at most the smaller neighbour, i.e. ``fp4``, ``fp4_e3m0``, ``int4``). Grids without 0
(``int2``) and stochastic rounding can send a level far from a tiny ``a``; there ``e`` is within half an ulp
of ``decode(q)`` of exact.

With ``decay`` < 1 this is SparseLoCo's accumulator (Sarfi et al. 2025): ``e ← β·e + Δ`` replaces DiLoCo's
outer momentum.
"""

from __future__ import annotations

from typing import Any

import torch

from ...validate import check_float, check_int
from .chain import Compressor

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """The residual of one flat tensor of ``numel`` elements and its compressor (module docstring).

    Args:
        compressor: what compresses the accumulated value.
        numel: elements of the flat tensors compressed.
        decay: β, the factor on the residual before ``x`` is added (1: plain error feedback).
        device: where the residual lives.
    """

    def __init__(self, compressor: Compressor, numel: int, decay: float = 1.0,
                 device: torch.device | str = "cpu") -> None:
        check_int("numel", numel, 0)
        check_float("decay", decay, 0, 1)
        self.compressor = compressor
        self.numel = numel
        self.decay = float(decay)
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device)

    def payload_bytes(self) -> int:
        return self.compressor.payload_bytes(self.numel)

    def compress(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(payload, sent)``: the payload of ``β·e + x`` and what it decodes to; ``e`` keeps the rest."""
        flat = x.detach().reshape(-1)
        if flat.numel() != self.numel:
            raise ValueError(f"x has {flat.numel()} elements, this residual {self.numel}")
        acc = self.residual  # in place: the buffer holds a, then e after the subtraction
        if self.decay != 1.0:
            acc.mul_(self.decay)
        acc.add_(flat.to(acc.device, torch.float32))
        payload = self.compressor.encode(acc)
        # decoded from the payload itself: e is what the receivers did not get, quantization error included
        sent = self.compressor.decode(payload, self.numel)
        acc.sub_(sent)
        return payload, sent

    def state_dict(self) -> dict[str, Any]:
        # a copy: compress() changes the residual in place
        return {"residual": self.residual.clone(), "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["residual"].numel() != self.numel:
            raise ValueError(f"checkpoint residual has {state['residual'].numel()} elements, this one {self.numel}")
        self.residual.copy_(state["residual"])
        self.compressor.load_state_dict(state["compressor"])

    def memory_report(self) -> dict[str, int]:
        return {"residual": self.residual.numel() * self.residual.element_size(), **self.compressor.memory_report()}
