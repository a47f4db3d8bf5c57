"""How a fragment's pseudo-gradient is averaged over the sync group, as the outer config says: one
:class:`~quietsync.wire.exchange.Exchange` per fragment (dense fp32/bf16, int8, through a replicator with error
feedback, or packed low-bit codes / SparseLoCo's top-k, :mod:`quietsync.wire`)."""

from __future__ import annotations

import torch

from ...transport import Transport
from ...wire.exchange import Dense, Exchange, Int8, Replicated
from ...wire.packed import LOWBIT_PSEUDO_GRAD_DTYPES, packed_exchange
from ...wire.replicators import Segments, make_replicator
from .adapt_bits import parse_knobs, switched_exchange
from .outer_config import OuterConfig


def fragment_exchange(config: OuterConfig, f: int, segments: Segments, transport: Transport, group: str,
                      device: torch.device) -> Exchange:
    """The exchange of fragment ``f`` (its tensors' ``segments``) over ``group`` (``--adapt`` of the bits: one per
    candidate dtype, :mod:`.adapt_bits`)."""
    if getattr(config, "adapt", False) and "bits" in parse_knobs(config.adapt_knobs):
        return switched_exchange(config, lambda c: _static_exchange(c, f, segments, transport, group, device),
                                 segments.numel, device)
    return _static_exchange(config, f, segments, transport, group, device)


def _static_exchange(config: OuterConfig, f: int, segments: Segments, transport: Transport, group: str,
                     device: torch.device) -> Exchange:
    name = f"outer/fragment{f}"
    dtype = config.pseudo_grad_dtype
    if config.pseudo_grad_replicator != "none":
        replicator = make_replicator(config.pseudo_grad_replicator, compression=config.compression,
                                     transfer_dtype=dtype, transfer_block=config.pseudo_grad_block,
                                     seed=config.seed + f).bind(transport, group)
        return Replicated(replicator, segments, device)
    sparseloco = config.outer == "sparseloco"
    if sparseloco or dtype in LOWBIT_PSEUDO_GRAD_DTYPES:
        rank = transport.group_rank(group)
        return packed_exchange(
            dtype=dtype, sizes=list(segments.sizes), transport=transport, group=group, sparseloco=sparseloco,
            block=config.pseudo_grad_block, rounding=config.pseudo_grad_rounding,
            error_feedback=config.pseudo_grad_error_feedback, decay=config.error_decay, density=config.topk_density,
            chunk=config.topk_chunk, seed=config.seed + 7919 * rank + f, device=device, name=name)
    if dtype == "int8":
        return Int8(segments.numel, transport, group, name)
    return Dense(segments.numel, transport, group, dtype, name)
