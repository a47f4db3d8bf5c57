"""The outer loop's knobs (DiLoCo's, Streaming DiLoCo's, SparseLoCo's): :class:`OuterConfig`, checked once, here.

DiLoCo's own config (:class:`~quietsync.strategies.local.diloco.DiLoCoConfig`) extends it with the inner
training; the outer machinery (:mod:`.outer`), the fragment schedule (:mod:`.fragments`) and the pseudo-gradient's
exchange (:mod:`.exchange`) read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...validate import check_choice, check_float, check_int
from ...wire.codecs.lowbit import ROUNDINGS
from ...wire.packed import LOWBIT_PSEUDO_GRAD_DTYPES
from .adaptive import AdaptiveConfig
from .fragments import FRAGMENT_PATTERNS

PSEUDO_GRAD_DTYPES = ("fp32", "bf16", "int8", *LOWBIT_PSEUDO_GRAD_DTYPES)
PSEUDO_GRAD_REPLICATORS = ("none", "dct", "random", "striding", "full")
OUTER_STEPS = ("sgd", "sparseloco")


@dataclass
class OuterConfig(AdaptiveConfig):
    """The outer loop's knobs (DiLoCo's config extends it with the inner training); checked once, here."""

    sync_every: int = 64
    """H: inner optimizer steps between two syncs of each fragment."""
    outer_lr: float = 0.7
    """Learning rate of the outer SGD on the averaged pseudo-gradient."""
    outer_momentum: float = 0.9
    """Momentum of the outer SGD (0: none)."""
    outer_nesterov: bool = True
    """Nesterov momentum for the outer SGD (takes effect only with outer_momentum > 0)."""
    fragments: int = 1
    """Streaming DiLoCo: split the parameters into this many fragments synced at staggered steps (must divide
    sync_every)."""
    overlap_delay: int = 0
    """tau: inner steps a fragment's outer communication overlaps before it is merged (0: blocking; at most
    sync_every/fragments)."""
    mixing: float = 0.5
    """alpha of the delayed merge theta_local <- alpha*theta_local + (1-alpha)*theta_global (only with
    overlap_delay > 0)."""
    fragment_pattern: Literal["contiguous", "strided"] = "contiguous"
    """How parameters form fragments: contiguous (consecutive tensors balanced by size) or strided (whole
    layers, layer l in fragment l mod fragments, Streaming DiLoCo's pattern)."""
    pseudo_grad_dtype: Literal["auto", "fp32", "bf16", "int8", "fp4", "fp4_e3m0", "int4", "int2"] = "auto"
    """dtype pseudo-gradients travel in: fp32, bf16 (all-reduce), int8 with a per-fragment scale, or packed
    fp4 (E2M1), fp4_e3m0, int4, int2 codes with a bf16 scale per pseudo_grad_block elements (all-gather,
    averaged in fp32); auto: fp32, or int2 with outer sparseloco (the SparseLoCo paper sends 2-bit values)."""
    pseudo_grad_block: int = 64
    """Elements per scale of the low-bit pseudo-gradient dtypes (fp4, fp4_e3m0, int4, int2); with a replicator,
    values per scale."""
    pseudo_grad_rounding: Literal["nearest", "stochastic"] = "nearest"
    """Rounding of the low-bit pseudo-gradient dtypes: nearest, or stochastic (unbiased, seeded per worker)."""
    pseudo_grad_error_feedback: bool = False
    """Keep what low-bit quantization lost and add it to the next sync's pseudo-gradient (low-bit dtypes)."""
    outer: Literal["sgd", "sparseloco"] = "sgd"
    """Outer step: sgd (outer_lr, outer_momentum, Nesterov), or sparseloco (per-worker error feedback decayed
    by error_decay in place of momentum, chunk-wise top-k values in pseudo_grad_dtype, plain step
    theta <- theta - outer_lr * mean)."""
    error_decay: float = 0.95
    """SparseLoCo's beta: e <- beta*e + pseudo-gradient before the top-k (outer sparseloco)."""
    topk_density: float = 1 / 64
    """SparseLoCo: fraction of each chunk sent, in (0, 1] (outer sparseloco)."""
    topk_chunk: int = 4096
    """SparseLoCo: elements per top-k chunk; chunks stay inside each tensor (at most the largest one)."""
    pseudo_grad_replicator: Literal["none", "dct", "random", "striding", "full"] = "none"
    """Compress pseudo-gradients with a quietsync replicator (error feedback in its residual); none: dense
    exchange."""
    compression: float = 1 / 32
    """Replicator bandwidth: bytes sent / bytes of the fp32 pseudo-gradient, in (0, 1] (with
    pseudo_grad_replicator)."""
    seed: int = 0
    """Shared seed of the random replicator's positions."""
    offload_outer: bool = False
    """Keep theta_global and the outer optimizer state on CPU (saves 2 model copies of accelerator memory)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pseudo_grad_dtype == "auto":
            self.pseudo_grad_dtype = "int2" if self.outer == "sparseloco" else "fp32"
        check_int("sync_every", self.sync_every, 1)
        check_float("outer_lr", self.outer_lr, 0, low_open=True)
        check_float("outer_momentum", self.outer_momentum, 0, 1, high_open=True)
        check_int("fragments", self.fragments, 1, self.sync_every)
        if self.sync_every % self.fragments:
            raise ValueError(
                f"fragments must be a divisor of sync_every ({self.sync_every}), got {self.fragments}"
            )
        check_int("overlap_delay", self.overlap_delay, 0, self.sync_every // self.fragments)
        check_float("mixing", self.mixing, 0, 1)
        check_choice("fragment_pattern", self.fragment_pattern, FRAGMENT_PATTERNS)
        check_choice("pseudo_grad_dtype", self.pseudo_grad_dtype, PSEUDO_GRAD_DTYPES)
        check_int("pseudo_grad_block", self.pseudo_grad_block, 1)
        check_choice("pseudo_grad_rounding", self.pseudo_grad_rounding, ROUNDINGS)
        check_choice("pseudo_grad_replicator", self.pseudo_grad_replicator, PSEUDO_GRAD_REPLICATORS)
        check_float("compression", self.compression, 0, 1, low_open=True)
        check_int("seed", self.seed, 0)
        check_choice("outer", self.outer, OUTER_STEPS)
        check_float("error_decay", self.error_decay, 0, 1)
        check_float("topk_density", self.topk_density, 0, 1, low_open=True)
        check_int("topk_chunk", self.topk_chunk, 1)
        if self.pseudo_grad_replicator != "none" and self.pseudo_grad_dtype == "int8":
            raise ValueError("pseudo_grad_replicator must be none with pseudo_grad_dtype int8 "
                             "(replicators send fp32, bf16 or low-bit values)")
        if self.pseudo_grad_error_feedback and self.pseudo_grad_dtype not in LOWBIT_PSEUDO_GRAD_DTYPES:
            raise ValueError(f"pseudo_grad_error_feedback needs a low-bit pseudo_grad_dtype "
                             f"({', '.join(LOWBIT_PSEUDO_GRAD_DTYPES)}), got {self.pseudo_grad_dtype!r}")
        if self.outer == "sparseloco":
            if self.pseudo_grad_replicator != "none":
                raise ValueError(f"pseudo_grad_replicator must be none with outer sparseloco (it selects its own "
                                 f"top-k), got {self.pseudo_grad_replicator!r}")
            if self.pseudo_grad_dtype == "int8":
                values = ", ".join(d for d in PSEUDO_GRAD_DTYPES if d != "int8")
                raise ValueError(f"pseudo_grad_dtype must be one of {values} with outer sparseloco, got 'int8'")

    def round_length(self) -> int:
        """Steps between two syncs (a round of adaptive inner steps): H / F."""
        return self.sync_every // self.fragments


__all__ = ["OUTER_STEPS", "OuterConfig", "PSEUDO_GRAD_DTYPES", "PSEUDO_GRAD_REPLICATORS"]
