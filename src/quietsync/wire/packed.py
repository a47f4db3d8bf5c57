"""A tensor sent packed (an :class:`~quietsync.wire.exchange.Exchange`): low-bit codes (optionally of a top-k
selection), all-gathered, decoded and averaged in fp32 — DiLoCo's low-bit and SparseLoCo pseudo-gradients.

Low-bit payloads cannot be summed on the wire (every worker has its own block scales), so every worker puts
its packed payload (:mod:`quietsync.wire.compression`: scales + codes, and positions after a top-k) into one
all-gather and averages the decoded values locally, accumulating in fp32 as Streaming DiLoCo does with its
4-bit outer gradients. The meter counts the packed bytes: ``(n − 1)·payload`` sent per worker and sync.

With error feedback (:class:`~quietsync.wire.compression.ErrorFeedback`) the worker compresses ``a = β·e + Δ`` and
keeps ``e ← a − decode(payload)``: SparseLoCo's accumulator with ``β < 1``, plain error feedback with ``β = 1``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..transport import Transport, across_replicas
from .compression import Cast, Chain, ErrorFeedback, Quantize, TopK

LOWBIT_PSEUDO_GRAD_DTYPES = ("fp4", "fp4_e3m0", "int4", "int2")
"""Pseudo-gradient dtypes sent as packed low-bit codes."""


def values_codec(dtype: str, block: int, rounding: str, seed: int) -> Cast | Quantize:
    """What values travel as: a float cast (``fp32``, ``bf16``) or a low-bit block quantizer."""
    if dtype in LOWBIT_PSEUDO_GRAD_DTYPES:
        return Quantize(dtype, block=block, rounding=rounding, seed=seed)
    return Cast(dtype)


class PackedExchange:
    """Packs, all-gathers and averages the pseudo-gradient of one fragment (module docstring).

    Args:
        chain: the compression chain (its payload is what travels).
        numel: elements of the fragment.
        transport / group: where the all-gather runs.
        error_feedback: keep a residual; ``decay``: its β (1: plain error feedback).
        name: the ``comm`` span's name.
    """

    def __init__(self, chain: Chain, numel: int, transport: Transport, group: str, *, error_feedback: bool,
                 decay: float = 1.0, device: torch.device | str = "cpu", name: str = "outer") -> None:
        self.chain = chain
        self.numel = numel
        self.transport, self.group = transport, group
        self.name = name
        self.feedback = ErrorFeedback(chain, numel, decay=decay, device=device) if error_feedback else None

    @property
    def residual(self) -> torch.Tensor | None:
        """This worker's error-feedback residual (None without error feedback)."""
        return None if self.feedback is None else self.feedback.residual

    def payload_bytes(self) -> int:
        """Bytes this worker puts into the all-gather of one sync."""
        return self.chain.payload_bytes(self.numel)

    def average(self, delta: torch.Tensor) -> torch.Tensor:
        """Mean over the group of every worker's decoded payload (fp32, ``numel``)."""
        # encoded outside the unit below: a re-run among the survivors must not move the residual twice
        payload = self.feedback.compress(delta)[0] if self.feedback is not None else self.chain.encode(delta)

        def gather_and_average() -> torch.Tensor:  # one unit across replicas (re-run if one dies during it)
            n = self.transport.group_size(self.group)
            gathered = torch.empty(n * payload.numel(), dtype=torch.uint8, device=payload.device)
            self.transport.all_gather(gathered, payload, self.group, name=self.name)
            # one worker's payload decoded at a time into the fp32 sum: memory for two fp32 copies of the fragment,
            # not one per worker (32 replicas of a 1B model would hold 128 GB of decoded payloads at once)
            total = torch.zeros(self.numel, dtype=torch.float32, device=payload.device)
            for row in gathered.view(n, -1):
                total.add_(self.chain.decode(row, self.numel))
            return total.div_(n)

        return across_replicas(self.transport, gather_and_average)

    def memory_report(self) -> dict[str, int]:
        n = self.transport.group_size(self.group)
        # the gathered payloads, the fp32 sum and one decoded payload
        report = {"packed_buffers": n * self.payload_bytes() + 2 * self.numel * 4}
        if self.feedback is not None:
            report["pseudo_grad_residual"] = self.feedback.residual.numel() * 4
        return report

    def state_dict(self) -> dict[str, Any]:
        if self.feedback is not None:
            return {"feedback": self.feedback.state_dict()}  # holds the chain's state too (its compressor)
        return {"chain": self.chain.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if ("feedback" in state) != (self.feedback is not None):
            raise ValueError("checkpoint pseudo-gradient error feedback does not match this run's")
        if self.feedback is not None:
            self.feedback.load_state_dict(state["feedback"])
        else:
            self.chain.load_state_dict(state["chain"])


def packed_chain(*, dtype: str, sizes: list[int], sparseloco: bool, block: int, rounding: str, density: float,
                 chunk: int, seed: int) -> Chain:
    """The compression chain of one fragment of tensors of ``sizes`` elements.

    SparseLoCo (``sparseloco``): chunk-wise top-k of every tensor (``chunk`` elements, at most the largest tensor;
    ``density``), the kept values in ``dtype`` with one scale per chunk (block = k). Otherwise the whole
    fragment in ``dtype`` with a scale per ``block`` elements.
    """
    if sparseloco:
        select = TopK(chunk=min(chunk, max(sizes)), density=density, sizes=sizes)
        return Chain(select=select, quantize=values_codec(dtype, select.k, rounding, seed))
    return Chain(quantize=values_codec(dtype, block, rounding, seed))


def packed_exchange(*, dtype: str, sizes: list[int], transport: Transport, group: str, sparseloco: bool,
                    block: int, rounding: str, error_feedback: bool, decay: float, density: float, chunk: int,
                    seed: int, device: torch.device | str, name: str) -> PackedExchange:
    """The :class:`PackedExchange` of one fragment (:func:`packed_chain`); SparseLoCo always keeps an error
    feedback residual decayed by ``decay``, the low-bit dtypes one (β = 1) with ``error_feedback``."""
    chain = packed_chain(dtype=dtype, sizes=sizes, sparseloco=sparseloco, block=block, rounding=rounding,
                         density=density, chunk=chunk, seed=seed)
    return PackedExchange(chain, sum(sizes), transport, group, error_feedback=error_feedback or sparseloco,
                          decay=decay if sparseloco else 1.0, device=device, name=name)
