"""The replicator interface: what a decoupled strategy sends across the replicate group.

A replicator (DeToNATION's word) takes the local decoupled momentum ``delta`` of all parameters
of a step -- one flat fp32 buffer laid out by a :class:`Segments` -- and

1. **extracts** a small part ``q`` of it (:meth:`Replicator.extract`, pure tensor math),
2. removes what was sent from the residual: ``delta <- delta - decode(q)`` (error feedback; the
   decoded ``q`` is what actually travels, transfer-dtype rounding included),
3. **exchanges** ``q`` with the replicate group in one collective through the
   :class:`~quietsync.transport.Transport` and returns the decoded average (:meth:`exchange`).

``compression`` means the same for every replicator: bytes one worker puts into the collective
per step divided by the bytes of the full (fp32) gradient. Replicators are therefore compared at
equal bandwidth, as in paper 001. In a replicate group of one worker there is nobody to talk to,
so every replicator hands the whole ``delta`` back (the paper's degenerate case: the base
optimizer on the local gradient).

**The momentum's domain.** A decoupled optimizer keeps its momentum where its replicator wants it
(:attr:`Replicator.momentum_domain`): ``spatial`` (the momentum as the parameters lay it out; ``random``,
``striding``, ``full``, ``none``) or ``dct:<chunk>`` (``dct``: the DCT-II coefficients of every block, so a
step needs one forward transform of the gradient and one inverse of the averaged update, and error feedback
just zeroes what was sent). The optimizer goes through DeMo's steps one by one:
:meth:`Replicator.accumulate` (the momentum, ``delta <- beta * delta + s * g``), :meth:`Replicator.extract_momentum`
(the extract, error feedback included) and :meth:`Replicator.exchange_momentum` (the collective and the decoded
average); :meth:`Replicator.replicate_momentum` is the two last in one call, and :meth:`Replicator.replicate` the
spatial entry point for callers that hold a spatial residual. The exchange may return a :class:`SparseUpdate`
(zero except at a few positions) that an optimizer applies without a dense temporary.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...transport import Collectives, across_replicas
from ...validate import check_choice, check_float, check_int
from ..codecs import TRANSFER_DTYPES
from ..codecs import transfer_dtype as _transfer_dtype
from ..codecs.lowbit import LOWBIT_FORMATS, BlockQuantizer

__all__ = ["Segments", "Message", "Replicator", "SparseUpdate", "signed"]


class Segments:
    """Shapes of the tensors concatenated (in order) into one flat buffer."""

    def __init__(self, shapes: Sequence[Sequence[int]]) -> None:
        self.shapes: tuple[tuple[int, ...], ...] = tuple(tuple(int(d) for d in s) for s in shapes)
        self.sizes: tuple[int, ...] = tuple(math.prod(s) for s in self.shapes)
        self.numel: int = sum(self.sizes)

    # by shapes: equal Segments share a replicator's cached layouts and workspaces
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Segments) and other.shapes == self.shapes

    def __hash__(self) -> int:
        return hash(self.shapes)

    def __repr__(self) -> str:
        return f"Segments({len(self.shapes)} tensors, {self.numel} elements)"


@dataclass
class Message:
    """What one worker sends in one step.

    Attributes:
        payload: the tensor that goes into the collective (values, or packed values+indices); for a ``local``
            message, the update itself.
        sent: dense flat buffer of what ``payload`` decodes to (a spatial replicator's error feedback), or None.
        meta: whatever the replicator needs to decode the exchanged payload (indices, specs).
        local: nothing is exchanged (a replicate group of one, or ``none``): ``payload`` is the update.
    """

    payload: torch.Tensor
    sent: torch.Tensor | None = None
    meta: Any = None
    local: bool = False


@dataclass
class SparseUpdate:
    """An averaged update that is zero except at ``indices``.

    Attributes:
        indices: ``int64`` flat positions into the segments' buffer, ascending and distinct.
        values: the update there (same length).
        numel: length of the dense update.
    """

    indices: torch.Tensor
    values: torch.Tensor
    numel: int

    def dense(self) -> torch.Tensor:
        """The dense flat update (zeros elsewhere)."""
        out = self.values.new_zeros(self.numel)
        out.index_copy_(0, self.indices, self.values)
        return out

    def split(self, sizes: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(local positions, values)`` of consecutive pieces of ``sizes`` elements (e.g. one per parameter)."""
        starts = torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.long, device=self.indices.device)
        # indices ascend: each piece's are one contiguous run, its bounds found by binary search
        bounds = torch.searchsorted(self.indices, starts).tolist()
        return [(self.indices[a:b] - int(starts[i]), self.values[a:b])
                for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]


def signed(update: torch.Tensor | SparseUpdate, sign: bool) -> torch.Tensor | SparseUpdate:
    """``update``'s sign where ``sign`` (a dense update, the caller's own, in place), else ``update``."""
    if not sign:
        return update
    if isinstance(update, SparseUpdate):
        return SparseUpdate(update.indices, update.values.sign(), update.numel)
    return update.sign_()


def _equal_runs(betas: Sequence[float], scales: Sequence[float]) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of consecutive segments sharing ``(beta, scale)``."""
    runs, start = [], 0
    for i in range(1, len(betas) + 1):
        if i == len(betas) or (betas[i], scales[i]) != (betas[start], scales[start]):
            runs.append((start, i))
            start = i
    return runs


class Replicator(ABC):
    """Base class; one subclass per replication scheme.

    Args:
        compression: bytes sent per step / bytes of the full fp32 gradient, in ``(0, 1]``.
        transfer_dtype: what values travel in: ``fp32``, ``bf16``, ``fp16``, or packed low-bit codes ``fp4``,
            ``fp4_e3m0``, ``int4``, ``int2`` (:mod:`quietsync.wire.codecs.lowbit`, a bf16 absmax scale per
            ``transfer_block`` values; the residual keeps what quantization lost). Low-bit payloads cannot be
            summed, so they are all-gathered and averaged after decoding, whatever the replicator's float
            collective.
        transport: the :class:`~quietsync.transport.Transport` (None: a world of one).
        group: the transport group replicated over (``replicate`` for FlexDeMo, ``world`` for DeMo).
        transfer_block: values per scale of a low-bit ``transfer_dtype`` (``dct``: the k values of a block).
    """

    name: ClassVar[str] = ""
    sends_indices: ClassVar[bool] = False
    collective: ClassVar[str] = "all_reduce"
    knobs: ClassVar[tuple[str, ...]] = ("compression", "transfer_dtype", "transport", "group", "transfer_block")
    """The keyword arguments of ``__init__`` that :func:`~quietsync.wire.replicators.make_replicator` passes on;
    a subclass with knobs of its own extends this tuple."""

    def __init__(
        self,
        compression: float = 1 / 32,
        transfer_dtype: str | torch.dtype = "fp32",
        transport: Collectives | None = None,
        group: str = "replicate",
        transfer_block: int = 64,
    ) -> None:
        check_float("compression", compression, 0, 1, low_open=True)
        check_int("transfer_block", transfer_block, 1)
        self.compression = float(compression)
        self.lowbit: BlockQuantizer | None = None
        """The low-bit codec of the values (None: they travel as ``transfer_dtype``)."""
        if isinstance(transfer_dtype, str) and transfer_dtype in LOWBIT_FORMATS:
            self.lowbit = BlockQuantizer(transfer_dtype, block=transfer_block)
            self.transfer_dtype = torch.float32  # what the values decode to
        else:
            if isinstance(transfer_dtype, str):
                check_choice("transfer_dtype", transfer_dtype, (*TRANSFER_DTYPES, *LOWBIT_FORMATS))
            self.transfer_dtype = _transfer_dtype(transfer_dtype)
        self.transfer_block = transfer_block
        self.transport = transport
        self.group = group

    # ------------------------------------------------------------------ wiring
    def bind(self, transport: Collectives | None, group: str) -> Replicator:
        """Attach the transport and group name (strategies do this; plain users pass them to __init__)."""
        self.transport, self.group = transport, group
        return self

    @property
    def group_size(self) -> int:
        return 1 if self.transport is None else int(self.transport.group_size(self.group))

    @property
    def value_bytes(self) -> int:
        return torch.empty((), dtype=self.transfer_dtype).element_size()

    # ------------------------------------------------------------------ values on the wire
    def values_payload_bytes(self, m: int, block: int | None = None) -> int:
        """Bytes of ``m`` values on the wire (low-bit: codes + scales, a scale per ``block`` values)."""
        if self.lowbit is None:
            return m * self.value_bytes
        return self._quantizer(block).payload_bytes(m)

    def values_that_fit(self, budget: float, limit: int) -> int:
        """The most values (1 to ``limit``) whose payload fits ``budget`` bytes."""
        if self.lowbit is None:
            return max(1, min(limit, int(budget // self.value_bytes)))
        per = self.lowbit.bits / 8 + self.lowbit.scale_bytes / self.transfer_block
        # m * per underestimates the payload (a whole last scale, whole bytes): start past it, step down to the fit
        m = max(1, min(limit, int(budget / per) + 1))
        while m > 1 and self.values_payload_bytes(m) > budget:
            m -= 1
        return m

    def _quantizer(self, block: int | None) -> BlockQuantizer:
        assert self.lowbit is not None
        if block is None or block == self.lowbit.block:
            return self.lowbit
        cache = self.__dict__.setdefault("_quantizers", {})
        if block not in cache:
            cache[block] = BlockQuantizer(self.lowbit.format.name, block=block)
        return cache[block]

    def encode_values(self, values: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(payload, sent)``: what travels for flat ``values`` and what it decodes to (``values``' dtype; the
        sender's residual keeps ``values − sent``)."""
        if self.lowbit is None:
            payload = values.to(self.transfer_dtype).contiguous()
            # same dtype: .to() returned values itself, which error feedback changes before the payload travels
            if payload.data_ptr() == values.data_ptr():
                payload = payload.clone()
            # same dtype: sent is the payload itself, so use it before the collective reduces the payload in place
            return payload, payload.to(values.dtype)
        q = self._quantizer(block)
        payload = q.encode(values)
        return payload, q.decode(payload, values.numel()).to(values.dtype)

    def decode_values(self, gathered: torch.Tensor, m: int, block: int | None = None) -> torch.Tensor:
        """Every worker's ``m`` values, ``(workers, m)`` fp32, from their gathered low-bit payloads
        ``(workers, bytes)``."""
        return self._quantizer(block).decode(gathered, m)

    def average_lowbit(self, payload: torch.Tensor, m: int, dtype: torch.dtype, name: str) -> torch.Tensor:
        """All-gather every worker's low-bit payload of ``m`` values; their decoded mean (fp32 sum, ``dtype``)."""
        def gather_and_average() -> torch.Tensor:  # one unit across replicas (re-run if one dies during it)
            n = self.group_size
            gathered = payload.new_empty(n * payload.numel())
            self.transport.all_gather(gathered, payload, self.group, name=name)
            return self.decode_values(gathered.view(n, -1), m).sum(0).div_(n).to(dtype)

        return across_replicas(self.transport, gather_and_average)

    # ------------------------------------------------------------------ the momentum's domain
    @property
    def momentum_domain(self) -> str:
        """Where the optimizer keeps the momentum for this replicator (``spatial`` here)."""
        return "spatial"

    def momentum_numel(self, segments: Segments) -> int:
        """Length of the flat momentum buffer."""
        return segments.numel

    def momentum_views(self, momentum: torch.Tensor, segments: Segments) -> list[torch.Tensor]:
        """One view of ``momentum`` per segment (here: the segment's own shape)."""
        views, at = [], 0
        for shape, n in zip(segments.shapes, segments.sizes):
            views.append(momentum[at : at + n].view(shape))
            at += n
        return views

    def accumulate(self, momentum: torch.Tensor, segments: Segments, grads: Sequence[torch.Tensor],
                   betas: Sequence[float], scales: Sequence[float]) -> None:
        """``delta <- beta * delta + scale * g`` for every segment (``betas``/``scales`` per segment)."""
        views = self.momentum_views(momentum, segments)
        # a _foreach op takes one scalar: segments go in runs sharing (beta, scale)
        for a, b in _equal_runs(betas, scales):
            if betas[a] != 1.0:
                torch._foreach_mul_(views[a:b], betas[a])
            torch._foreach_add_(views[a:b], [g.to(momentum.dtype) for g in grads[a:b]], alpha=scales[a])

    def extract_momentum(self, momentum: torch.Tensor, segments: Segments) -> Message:
        """DeMo's *extract*: pick what travels from ``momentum`` (flat, in this replicator's domain) and remove it
        there (error feedback: ``delta <- delta - decode(q)``, transfer rounding included). Advances any per-step
        counter. In a replicate group of one the whole momentum is the (local) update."""
        if momentum.dim() != 1 or momentum.numel() != self.momentum_numel(segments):
            raise ValueError(f"momentum must be flat with {self.momentum_numel(segments)} elements, got shape "
                             f"{tuple(momentum.shape)}")
        if self.group_size == 1:
            return self._keep_all(momentum, segments)
        msg = self.extract(momentum, segments)
        momentum.sub_(msg.sent)
        return msg

    def exchange_momentum(self, msg: Message, segments: Segments, sign: bool = False) -> torch.Tensor | SparseUpdate:
        """DeMo's *exchange*: the collective, and the decoded average of every worker's ``msg`` -- the update,
        spatial and flat (or a :class:`SparseUpdate`); with ``sign``, its sign (a base rule that applies
        ``sign(Q)`` asks for it here, so a replicator may take it while the update is still in cache)."""
        return signed(msg.payload if msg.local else self.exchange(msg, segments), sign)

    def replicate_momentum(self, momentum: torch.Tensor, segments: Segments) -> torch.Tensor | SparseUpdate:
        """:meth:`extract_momentum` then :meth:`exchange_momentum`: one step on the momentum in this replicator's
        domain; the update is spatial (flat, or a :class:`SparseUpdate`)."""
        return self.exchange_momentum(self.extract_momentum(momentum, segments), segments)

    def _keep_all(self, momentum: torch.Tensor, segments: Segments) -> Message:
        """Nobody to send to: the whole momentum is the update (spatial), and the momentum starts afresh."""
        update = self.momentum_to_spatial(momentum, segments)
        momentum.zero_()
        return Message(update, local=True)

    def momentum_from_spatial(self, delta: torch.Tensor, segments: Segments) -> torch.Tensor:
        """A flat spatial momentum in this replicator's domain (a new tensor)."""
        return delta.clone()

    def momentum_to_spatial(self, momentum: torch.Tensor, segments: Segments) -> torch.Tensor:
        """Inverse of :meth:`momentum_from_spatial` (a new tensor)."""
        return momentum.clone()

    # ------------------------------------------------------------------ the step
    def replicate_update(self, delta: torch.Tensor, segments: Segments) -> torch.Tensor | SparseUpdate:
        """:meth:`replicate`, but the update may come back as a :class:`SparseUpdate` (here: never)."""
        return self.replicate(delta, segments)

    def _alone(self, delta: torch.Tensor, segments: Segments) -> torch.Tensor | None:
        """Check ``delta`` is flat over ``segments``; in a group of one, the whole of it is the update (``delta``
        emptied); else None."""
        if delta.dim() != 1 or delta.numel() != segments.numel:
            raise ValueError(f"delta must be flat with {segments.numel} elements, got shape {tuple(delta.shape)}")
        if self.group_size != 1:
            return None
        update = delta.clone()
        delta.zero_()
        return update

    def replicate(self, delta: torch.Tensor, segments: Segments) -> torch.Tensor:
        """Extract, apply error feedback to ``delta`` in place, exchange; return the averaged update."""
        alone = self._alone(delta, segments)
        if alone is not None:
            return alone
        msg = self.extract(delta, segments)
        delta.sub_(msg.sent)
        return self.exchange(msg, segments)

    @abstractmethod
    def extract(self, delta: torch.Tensor, segments: Segments) -> Message:
        """Pick what travels from ``delta`` (not modified). Advances any per-step counter."""

    @abstractmethod
    def exchange(self, msg: Message, segments: Segments) -> torch.Tensor:
        """Run the collective and decode the average of every worker's message (flat, delta's dtype)."""

    @abstractmethod
    def payload_bytes(self, segments: Segments, dtype: torch.dtype = torch.float32) -> int:
        """Bytes this worker puts into the collective per step (the hand computation tests check)."""

    def achieved_compression(self, segments: Segments, dtype: torch.dtype = torch.float32) -> float:
        """:meth:`payload_bytes` / bytes of the full gradient."""
        full = segments.numel * torch.empty((), dtype=dtype).element_size()
        return self.payload_bytes(segments, dtype) / full if full else 0.0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Counters / seeds needed to resume exactly (empty for stateless replicators)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def __repr__(self) -> str:
        values = self.lowbit.format.name if self.lowbit is not None else self.transfer_dtype
        return f"{type(self).__name__}(compression={self.compression:g}, transfer_dtype={values}, group={self.group!r})"
