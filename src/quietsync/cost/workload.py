"""What is trained, as the cost model sees it: the parameters' shapes and how strategies cut them.

A :class:`Workload` holds no tensors, only shapes: the trainable parameters in the order strategies take them
(parameter groups, then order within a group), the FSDP units (each element of an ``nn.ModuleList`` — a
transformer's blocks — and the root with the rest), the stages CDP cuts the model into, the parameter dtype
and the tokens of one micro-batch. Strategies' transfer sizes are functions of these (a flat buffer padded
to the group size, a dim-0 shard of each parameter, a DCT block layout, a fragment of the parameters).

Two ways to get one: :meth:`Workload.from_model` reads a real ``torch.nn.Module`` (a preset, a Hugging Face
folder, your own model), and :meth:`Workload.transformer` describes a GPT-style model by its width, depth and
vocabulary without building it (for ``--what-if`` at sizes that do not fit here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from ..models.stages import partition, sequential_view
from ..models.units import blocks, layer_units

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Workload:
    """The parameters' shapes and the micro-batch, for the cost model (see the module docstring)."""

    name: str
    """What it describes (``tiny``, ``1B transformer``...)."""
    shapes: tuple[Shape, ...]
    """Trainable parameters in the order strategies take them (parameter groups in order)."""
    group_sizes: tuple[int, ...]
    """How many of :attr:`shapes` each parameter group holds, in order."""
    module_order: tuple[int, ...]
    """Indices into :attr:`shapes` in ``model.parameters()`` order (DDP's buckets, FSDP's units follow it)."""
    units: tuple[tuple[int, ...], ...]
    """FSDP units: indices into :attr:`shapes` of each unit's parameters (the root, holding the rest, last)."""
    tokens_per_micro_batch: int
    """Tokens of one micro-batch (sequences × sequence length)."""
    dtype_bytes: int = 4
    """Bytes per parameter element (fp32: 4)."""
    stage_numels: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """CDP: parameter elements of each stage, by number of stages."""
    layers: tuple[tuple[int, ...], ...] = ()
    """Layers (a layer's weight and bias together) as Streaming DiLoCo's strided fragments take them: indices
    into :attr:`shapes` (:func:`quietsync.models.units.layer_units`); empty: one per tensor."""
    flops_per_token: float = 0.0
    """Training FLOPs per token (forward + backward), for compute derived from FLOP/s; 6 × parameters when
    unknown."""
    vocab: int | None = None
    """Tokens the model predicts over (a language model's embedding rows); None when unknown. The planner bounds its
    default loss curve by ``ln(vocab)``, the loss of an untrained model's uniform guess."""

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ValueError("a workload needs at least one trainable parameter")
        if sum(self.group_sizes) != len(self.shapes):
            raise ValueError(f"group_sizes {self.group_sizes} do not add up to {len(self.shapes)} parameters")
        if sorted(self.module_order) != list(range(len(self.shapes))):
            raise ValueError("module_order must be a permutation of the parameter indices")

    # ------------------------------------------------------------------ sizes
    @cached_property
    def numels(self) -> tuple[int, ...]:
        """Elements of each parameter (computed once: the cost model reads it per parameter, per candidate)."""
        return tuple(math.prod(s) if s else 1 for s in self.shapes)

    @cached_property
    def params(self) -> int:
        """Trainable parameter elements."""
        return sum(self.numels)

    @property
    def param_bytes(self) -> int:
        """Bytes of the parameters."""
        return self.params * self.dtype_bytes

    @property
    def tensors(self) -> int:
        """Number of parameter tensors."""
        return len(self.shapes)

    def padded(self, n: int) -> int:
        """Elements of the flat buffer padded to a multiple of ``n`` (ZeRO-1, ACCO, DPU, WP)."""
        return -(-self.params // n) * n

    def groups(self) -> list[list[int]]:
        """Parameter indices of each group."""
        out, at = [], 0
        for k in self.group_sizes:
            out.append(list(range(at, at + k)))
            at += k
        return out

    def training_flops(self) -> float:
        """FLOPs of forward + backward of one micro-batch."""
        per_token = self.flops_per_token or 6.0 * self.params
        return per_token * self.tokens_per_micro_batch

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_model(cls, model: torch.nn.Module, *, tokens_per_micro_batch: int,
                   param_groups: list[dict[str, Any]] | None = None, name: str = "model",
                   stages: Sequence[int] = (), vocab: int | None = None) -> Workload:
        """Read a model's trainable parameters (as a strategy built with ``param_groups`` sees them).

        Args:
            model: the model (not modified).
            tokens_per_micro_batch: sequences × sequence length of one micro-batch.
            param_groups: the torch parameter groups the strategy gets (default: one group, as
                ``make_strategy`` without ``param_groups``).
            name: for reports.
            stages: CDP stage counts to cut the model for (each a valid ``stages`` of ``cdp``).
            vocab: a language model's vocabulary (None: unknown).
        """
        if param_groups is None:
            param_groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        ordered: list[torch.nn.Parameter] = []
        sizes = []
        for g in param_groups:
            ps = [p for p in g["params"] if p.requires_grad]
            ordered += ps
            sizes.append(len(ps))
        index = {id(p): i for i, p in enumerate(ordered)}
        module_order = [index[id(p)] for p in model.parameters() if id(p) in index]
        if len(module_order) != len(ordered):
            raise ValueError("param_groups hold tensors that are not parameters of the model")
        units = _fsdp_units(model, index)
        dtypes = {p.dtype for p in ordered}
        if len(dtypes) != 1:
            raise ValueError(f"the model's trainable parameters have mixed dtypes {sorted(map(str, dtypes))}")
        stage_numels = {n: _stage_numels(model, n) for n in stages}
        layers = tuple(tuple(u) for u in layer_units(model, ordered))
        return cls(name=name, shapes=tuple(tuple(p.shape) for p in ordered), group_sizes=tuple(sizes),
                   module_order=tuple(module_order), units=units, tokens_per_micro_batch=tokens_per_micro_batch,
                   dtype_bytes=ordered[0].element_size(), stage_numels=stage_numels, layers=layers, vocab=vocab)

    @classmethod
    def transformer(cls, *, hidden: int, layers: int, vocab: int, seq_len: int, micro_batch_size: int,
                    positions: int | None = None, name: str | None = None, dtype_bytes: int = 4,
                    stages: Sequence[int] = ()) -> Workload:
        """A GPT-style decoder (GPT-Neo's parameter shapes: tied embeddings, learned positions, 4× MLP) of
        ``layers`` blocks of width ``hidden``, described without building it.

        Parameter groups as the trainer makes them: matrices with weight decay, then norms, biases and
        embeddings. FLOPs per token: 6 × parameters + 12 × layers × hidden × sequence length (attention)."""
        for what, v in (("hidden", hidden), ("layers", layers), ("vocab", vocab), ("seq_len", seq_len),
                        ("micro_batch_size", micro_batch_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{what} must be an integer >= 1, got {v!r}")
        d, positions = hidden, positions or seq_len
        module: list[tuple[str, Shape]] = [("wte", (vocab, d)), ("wpe", (positions, d))]
        units_named: list[list[str]] = []
        for i in range(layers):
            block = [(f"h{i}.ln_1.w", (d,)), (f"h{i}.ln_1.b", (d,)), (f"h{i}.q", (d, d)), (f"h{i}.k", (d, d)),
                     (f"h{i}.v", (d, d)), (f"h{i}.o", (d, d)), (f"h{i}.o.b", (d,)), (f"h{i}.ln_2.w", (d,)),
                     (f"h{i}.ln_2.b", (d,)), (f"h{i}.fc", (4 * d, d)), (f"h{i}.fc.b", (4 * d,)),
                     (f"h{i}.proj", (d, 4 * d)), (f"h{i}.proj.b", (d,))]
            module += block
            units_named.append([n for n, _ in block])
        module += [("ln_f.w", (d,)), ("ln_f.b", (d,))]
        decay = [n for n, s in module if len(s) >= 2 and n not in ("wte", "wpe")]
        no_decay = [n for n, s in module if n not in decay]
        order = decay + no_decay
        idx = {n: i for i, n in enumerate(order)}
        shape_of = dict(module)
        in_blocks = {n for u in units_named for n in u}
        units = tuple(tuple(idx[n] for n in u) for u in units_named) + (
            tuple(idx[n] for n, _ in module if n not in in_blocks),)
        params = sum(math.prod(shape_of[n]) for n in order)
        flops = 6.0 * params + 12.0 * layers * d * seq_len
        # strided fragments' layers: wte, wpe, the blocks, ln_f (as layer_units finds them in GPT-Neo)
        layer_list = ((idx["wte"],), (idx["wpe"],), *(tuple(sorted(idx[n] for n in u)) for u in units_named),
                      tuple(sorted((idx["ln_f.w"], idx["ln_f.b"]))))
        w = cls(name=name or f"transformer d={hidden} L={layers} V={vocab}", shapes=tuple(shape_of[n] for n in order),
                group_sizes=(len(decay), len(no_decay)), module_order=tuple(idx[n] for n, _ in module),
                units=units, tokens_per_micro_batch=seq_len * micro_batch_size, dtype_bytes=dtype_bytes,
                flops_per_token=flops, layers=layer_list, vocab=vocab)
        if stages:
            # in module order: CDP's stages are consecutive pieces of the forward
            w = w.with_stages({n: _balanced_stages([math.prod(shape_of[n]) for n, _ in module], n) for n in stages})
        return w

    def with_stages(self, stage_numels: dict[int, tuple[int, ...]]) -> Workload:
        """A copy with CDP stage sizes for more stage counts."""
        from dataclasses import replace

        return replace(self, stage_numels={**self.stage_numels, **stage_numels})


def _fsdp_units(model: torch.nn.Module, index: dict[int, int]) -> tuple[tuple[int, ...], ...]:
    """FSDP units as FSDP2's substrate makes them (:func:`~quietsync.models.units.blocks`): every element of an
    outermost ``nn.ModuleList`` that holds parameters, then the root with the rest."""
    units, seen = [], set()
    for unit in blocks(model):
        ids = tuple(index[id(p)] for p in unit.parameters() if id(p) in index and id(p) not in seen)
        # a parameter shared by two units (tied) stays with the first
        seen.update(id(p) for p in unit.parameters())
        if ids:
            units.append(ids)
    rest = tuple(index[id(p)] for p in model.parameters() if id(p) in index and id(p) not in seen)
    return tuple(units) + ((rest,) if rest else ())


def _stage_numels(model: torch.nn.Module, n: int) -> tuple[int, ...]:
    """Trainable elements each of ``n`` CDP stages owns (cut by parameter count, as ``cdp`` does by default)."""
    plan = partition(sequential_view(model), n, "params")
    return tuple(sum(p.numel() for p in ps if p.requires_grad) for ps in plan.owned)


def _balanced_stages(sizes: Sequence[int], n: int) -> tuple[int, ...]:
    """Consecutive pieces of ``sizes`` cut into ``n`` stages of about equal total (for described models)."""
    if n > len(sizes):
        raise ValueError(f"stages must be <= the {len(sizes)} parameters, got {n}")
    total = sum(sizes)
    out, acc, k = [], 0, 1
    for i, s in enumerate(sizes):
        acc += s
        left = len(sizes) - i - 1
        # or cut now: each stage still to come needs at least one parameter
        if k < n and (acc >= k * total / n or left == n - k):
            out.append(acc - sum(out))
            k += 1
    out.append(total - sum(out))
    return tuple(out)
