"""A cluster described, not measured (``--what-if``): nodes, workers per node, links, and the device.

:class:`Device` turns a workload into a :class:`~quietsync.cost.compute.ComputeProfile` from its peak FLOP/s,
the fraction of it training reaches (MFU) and its memory bandwidth, with stated assumptions:

* forward + backward of a micro-batch = the workload's training FLOPs (6 × parameters × tokens, plus
  attention) / (peak × MFU), one third forward, two thirds backward;
* the optimizer (AdamW, fp32) streams ``ADAMW_BYTES`` bytes per parameter element through memory;
* a copy moves each byte twice (read, write);
* a decoupled step (DeMo's codec) costs ``CODEC_FLOPS`` FLOPs per element at ``CODEC_MFU`` of peak for the DCT
  (two 64-point transforms per element, each way) plus ``CODEC_BYTES`` bytes per element of memory traffic
  (momentum update, top-k, error feedback, sign, apply); the random/striding replicators only the memory part.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cost.compute import ComputeProfile
from ..cost.costmodel import Links
from ..cost.workload import Workload
from ..validate import check_float, check_int

ADAMW_BYTES = 28.0
"""AdamW per fp32 element: read parameter, gradient, two moments (16 B); write parameter and moments (12 B)."""
CODEC_FLOPS = 512.0
"""DCT-II of 64×64 blocks as two 64-point matrix products, forward and inverse: 4 × 2 × 64 FLOPs per element."""
CODEC_MFU = 0.3
"""Fraction of peak the DCT's small batched matrix products reach."""
CODEC_BYTES = 64.0
"""Memory traffic per element of the decoupled step beyond the transform (momentum, top-k, feedback, apply)."""


@dataclass(frozen=True)
class Device:
    """One worker's accelerator, as far as the cost model needs it."""

    flops: float
    """Peak dense FLOP/s in the training dtype (e.g. 989e12 for an H100 SXM in bf16)."""
    mfu: float = 0.4
    """Fraction of ``flops`` training reaches (model FLOPs utilisation)."""
    memory_bandwidth: float = 2.0e12
    """Bytes/s of device memory."""
    memory_bytes: float | None = None
    """Device memory (for the fits-in-memory column); None: not checked."""
    name: str = "device"

    def __post_init__(self) -> None:
        check_float("flops", self.flops, 0, low_open=True)
        check_float("mfu", self.mfu, 0, 1, low_open=True)
        check_float("memory_bandwidth", self.memory_bandwidth, 0, low_open=True)
        check_float("memory_bytes", self.memory_bytes, 0, low_open=True, allow_none=True)

    def profile(self, w: Workload, codecs: dict[str, str] | None = None) -> ComputeProfile:
        """The compute profile of ``w`` on this device (see the module docstring). ``codecs``: ``{key:
        replicator name}`` of the decoupled settings to cost."""
        train = w.training_flops() / (self.flops * self.mfu)
        codec_s = {}
        for key, name in (codecs or {}).items():
            mem = CODEC_BYTES * w.params / self.memory_bandwidth
            dct = CODEC_FLOPS * w.params / (self.flops * CODEC_MFU) if name == "dct" else 0.0
            codec_s[key] = mem + dct
        return ComputeProfile(
            forward_s=train / 3, backward_s=2 * train / 3,
            optimizer_s_per_element=ADAMW_BYTES / self.memory_bandwidth, elements=w.params, codec_s=codec_s,
            # activations: the what-if plan sets them from Korthikanti et al.'s estimate (planner._activation_estimate)
            copy_s_per_byte=2.0 / self.memory_bandwidth, activation_bytes=0,
            source=(f"{self.name}: {self.flops / 1e12:g} TFLOP/s peak at {self.mfu:.0%} MFU, "
                    f"{self.memory_bandwidth / 1e12:g} TB/s memory"))


@dataclass(frozen=True)
class Cluster:
    """Nodes × workers per node and the links between them."""

    nodes: int
    workers_per_node: int
    links: Links
    device: Device | None = None
    """For ``--what-if``: the device every worker has (None: measured instead)."""

    def __post_init__(self) -> None:
        check_int("nodes", self.nodes, 1)
        check_int("workers_per_node", self.workers_per_node, 1)

    @property
    def world(self) -> int:
        return self.nodes * self.workers_per_node

    def describe(self) -> str:
        links = ", ".join(f"{k} {v}" for k, v in self.links.describe().items()) or "no links modeled"
        return f"{self.nodes} node(s) × {self.workers_per_node} worker(s); {links}"


def parse_quantity(text: str, what: str, units: dict[str, float], examples: str) -> float:
    """``"80GB"`` → 80e9 with ``units`` (lower-case suffixes); an error names ``what`` and shows examples."""
    t = text.strip().lower().replace(" ", "")
    for suffix in sorted(units, key=len, reverse=True):  # longest first: "80gb" also ends with "b"
        if t.endswith(suffix):
            number = t[: len(t) - len(suffix)]
            try:
                value = float(number) * units[suffix]
            except ValueError:
                break
            if value > 0:
                return value
            break
    raise ValueError(f"{what} must be a positive number with a unit (e.g. {examples}), got {text!r}")


BYTES_UNITS = {"b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 1024.0, "mib": 1024.0**2,
               "gib": 1024.0**3, "tib": 1024.0**4}
FLOPS_UNITS = {"flops": 1.0, "gflops": 1e9, "tflops": 1e12, "pflops": 1e15}
RATE_UNITS = {"b/s": 1.0, "gb/s": 1e9, "tb/s": 1e12, "gbps": 1e9, "tbps": 1e12}

