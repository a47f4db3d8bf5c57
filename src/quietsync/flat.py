"""Flat buffers: the model's parameters and gradients as one contiguous, padded 1-D tensor each.

Sharded strategies (ZeRO-1, ACCO, DPU, WP, FlexDeMo) move whole buffers, not parameter lists: one
reduce-scatter of the gradient buffer, one all-gather of the parameter buffer. :class:`FlatParams` moves
every trainable parameter into one buffer (``p.data`` becomes a view, so the model, user references and
``state_dict`` keep working), pads it to a multiple of the shard count so every worker owns an equal
contiguous **shard**, and keeps the original parameter groups so per-group options (weight decay, lr)
survive sharding: a group's part of a shard is the intersection of the group's range with the shard.

Gradient buffers are separate tensors of the same layout; :meth:`FlatParams.attach_grads` points every
``p.grad`` at a view of one, so autograd accumulates micro-batches straight into it (strategies that overlap
swap between two). Gradients share the parameters' dtype (autograd requires it); a different
communication dtype is a cast at reduction time (:class:`DTypePolicy`).

Move the model to its device *before* flattening: ``model.to(...)`` afterwards would replace the views.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(value: str | torch.dtype, what: str) -> torch.dtype:
    """``"bf16"`` / ``torch.bfloat16`` → ``torch.bfloat16``, with an error naming ``what``."""
    if isinstance(value, torch.dtype):
        if value in DTYPES.values():
            return value
    elif value in DTYPES:
        return DTYPES[value]
    raise ValueError(f"{what} must be one of float32, bfloat16, float16, got {value!r}")


@dataclass(frozen=True)
class DTypePolicy:
    """Which dtype each copy of the parameters and gradients is kept in."""

    param_dtype: torch.dtype | None = None
    """Working parameters (what forward/backward see); ``None`` keeps the model's dtype."""
    reduce_dtype: torch.dtype = torch.float32
    """Gradients on the wire and in the reduced shard."""
    master_dtype: torch.dtype = torch.float32
    """The optimizer's master copy of this worker's shard."""


@dataclass(frozen=True)
class GroupLayout:
    """Where one parameter group lives in the flat buffer."""

    start: int
    """First element of the group."""
    end: int
    """One past the last element (padding excluded)."""
    options: dict[str, Any]
    """The group's optimizer options (everything but ``params``)."""


class FlatParams:
    """Trainable parameters moved into one contiguous, padded buffer.

    Args:
        params: parameters or torch-style parameter groups (dicts with ``params``); parameters that do not
            require gradients are left alone.
        pad_to: the buffer's length is rounded up to a multiple of this (the shard count).
        policy: dtypes (see :class:`DTypePolicy`).
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], pad_to: int = 1,
                 policy: DTypePolicy | None = None) -> None:
        if pad_to < 1:
            raise ValueError(f"pad_to must be >= 1, got {pad_to}")
        self.policy = policy or DTypePolicy()
        groups = normalize_param_groups(params)
        seen: set[int] = set()
        self.params: list[torch.nn.Parameter] = []
        self.offsets: list[int] = []
        self.groups: list[GroupLayout] = []
        offset = 0
        for g in groups:
            start = offset
            for p in g["params"]:
                if id(p) in seen:
                    raise ValueError("a parameter appears twice in the parameter groups")
                seen.add(id(p))
                if not p.requires_grad:
                    continue
                self.params.append(p)
                self.offsets.append(offset)
                offset += p.numel()
            self.groups.append(GroupLayout(start, offset, {k: v for k, v in g.items() if k != "params"}))
        if not self.params:
            raise ValueError("params must contain at least one parameter that requires grad")
        devices = {p.device for p in self.params}
        if len(devices) != 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        dtypes = {p.dtype for p in self.params}
        dtype = self.policy.param_dtype
        if dtype is None:
            if len(dtypes) != 1:
                raise ValueError(f"parameters have mixed dtypes {dtypes}; set DTypePolicy.param_dtype")
            dtype = dtypes.pop()
        self.device = devices.pop()
        self.dtype = dtype
        self.numel = offset
        self.pad_to = pad_to
        self.padded_numel = -(-offset // pad_to) * pad_to  # rounded up, so every shard has the same length
        # zeros, so the padding tail adds nothing to sums and norms taken over whole shards
        self.data = torch.zeros(self.padded_numel, dtype=dtype, device=self.device)
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                n = p.numel()
                self.data[off : off + n].copy_(p.data.reshape(-1))
                p.data = self.data[off : off + n].view(p.shape)

    # ------------------------------------------------------------------ gradients
    def new_grad_buffer(self) -> torch.Tensor:
        """A zeroed gradient buffer of this layout (parameters' dtype)."""
        return torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)

    def attach_grads(self, buffer: torch.Tensor) -> None:
        """Point every ``p.grad`` at its view of ``buffer``; autograd then accumulates into it in place."""
        if buffer.numel() != self.padded_numel or buffer.dtype != self.dtype:
            raise ValueError("gradient buffer does not match the flat layout")
        for p, off in zip(self.params, self.offsets):
            p.grad = buffer[off : off + p.numel()].view(p.shape)

    def grads_attached_to(self, buffer: torch.Tensor) -> bool:
        """Whether ``p.grad`` still views ``buffer`` (``zero_grad(set_to_none=True)`` breaks it).

        A cheap check of the first and last parameter, meant to run once per micro-batch.
        """
        base, size = buffer.data_ptr(), buffer.element_size()
        ends = {0, len(self.params) - 1}
        return all(self.params[i].grad is not None
                   and self.params[i].grad.data_ptr() == base + self.offsets[i] * size for i in ends)

    def require_grads_attached(self, buffer: torch.Tensor) -> None:
        """Raise if the user replaced the ``p.grad`` views of ``buffer`` (the strategy owns the gradients)."""
        if not self.grads_attached_to(buffer):
            raise RuntimeError(
                "parameter .grad tensors were replaced (e.g. by zero_grad(set_to_none=True)); the strategy "
                "owns the gradients — do not zero them yourself"
            )

    # ------------------------------------------------------------------ shards
    def shard_bounds(self, index: int, count: int) -> tuple[int, int]:
        """``[lo, hi)`` of shard ``index`` of ``count`` equal shards."""
        if count < 1 or self.padded_numel % count != 0:
            raise ValueError(f"the buffer is padded to {self.pad_to}, which {count} shards do not divide")
        if not 0 <= index < count:
            raise ValueError(f"shard index must be in [0, {count}), got {index}")
        size = self.padded_numel // count
        return index * size, (index + 1) * size

    def shard(self, buffer: torch.Tensor, index: int, count: int) -> torch.Tensor:
        """The contiguous view of ``buffer`` that shard ``index`` owns."""
        lo, hi = self.shard_bounds(index, count)
        return buffer[lo:hi]

    def group_slices(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Each group's part of ``[lo, hi)``, relative to ``lo`` (empty where a group misses the shard)."""
        out = []
        for g in self.groups:
            a, b = max(g.start, lo), min(g.end, hi)
            out.append((a - lo, b - lo) if b > a else (0, 0))
        return out


def normalize_param_groups(params: Iterable[torch.Tensor] | Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Torch-style parameter groups as a list of dicts with a list under ``params``."""
    if isinstance(params, torch.Tensor):  # a tensor iterates over its rows, so list() below would accept it
        raise TypeError("params must be an iterable of tensors or of dicts, not a tensor")
    items: Sequence[Any] = list(params)  # a generator (model.parameters()) is read once; the checks iterate twice
    if not items:
        raise ValueError("params is empty")
    if all(isinstance(i, dict) for i in items):
        groups = []
        for i, g in enumerate(items):
            if "params" not in g:
                raise ValueError(f"parameter group {i} has no 'params' key")
            ps = g["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)  # torch accepts a lone tensor as "params"
            groups.append({**g, "params": ps})
        return groups
    if all(isinstance(i, torch.Tensor) for i in items):
        return [{"params": list(items)}]
    raise TypeError("params must be all tensors or all dicts")


def nbytes(tensor: torch.Tensor | None) -> int:
    """Bytes a tensor's elements take (0 for None): the unit of every ``memory_report``."""
    return 0 if tensor is None else tensor.numel() * tensor.element_size()
