"""What the computation of a step costs on one worker: the :class:`ComputeProfile` a plan predicts from.

Calibrated on the device (:mod:`~quietsync.plan.calibrate`) or derived from a described device's FLOP/s and
memory bandwidth (:class:`~quietsync.plan.cluster.Device`). The decoupled optimizers' codecs are costed per
setting, keyed by :func:`codec_key`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ComputeProfile:
    """Seconds of the computation a step is made of, on one worker (calibrated, or derived from FLOP/s)."""

    forward_s: float
    """Forward pass of one micro-batch."""
    backward_s: float
    """Backward pass of one micro-batch."""
    optimizer_s_per_element: float
    """The user's optimizer step (AdamW by default) per parameter element (a full step / parameters)."""
    elements: int
    """Parameters the calibration ran on (the model's)."""
    codec_s: dict[str, float] = field(default_factory=dict)
    """Extra seconds a decoupled optimizer step spends per full-model step, by replicator setting
    (``"dct:0.03125"``...): encode, error feedback, decode, sign, apply — everything but the collective."""
    copy_s_per_byte: float = 0.0
    """A device memory copy per byte (hand-overs between buffers, pseudo-gradients)."""
    worker_scale: tuple[float, ...] = ()
    """Each worker's compute time relative to the profile (1.0 = as calibrated; heterogeneous workers differ);
    empty: all equal."""
    activation_bytes: int = 0
    """Bytes autograd holds for backward at the peak of one micro-batch."""
    source: str = "calibrated"
    """How the numbers were obtained (``calibrated on cpu``, ``from 312 TFLOP/s at 40% MFU``...)."""

    @property
    def micro_batch_s(self) -> float:
        """Forward + backward of one micro-batch."""
        return self.forward_s + self.backward_s

    def optimizer_s(self, elements: float) -> float:
        """An optimizer step over ``elements`` parameter elements."""
        return self.optimizer_s_per_element * elements

    def codec(self, key: str, elements: float) -> float:
        """The decoupled step's own computation for ``elements`` elements with setting ``key`` (see
        :func:`~quietsync.cost.compute.codec_key`). A setting not calibrated takes the costliest calibrated one
        of the same replicator (the codec's cost hardly depends on the compression; the costliest errs on the slow
        side), else the optimizer step."""
        seconds = self.codec_s.get(key)
        if seconds is None:
            same = [v for k, v in self.codec_s.items() if k.split(":")[0] == key.split(":")[0]]
            if not same:
                return self.optimizer_s(elements)
            seconds = max(same)
        # codec_s is per full-model step: scale to this share of the calibrated elements
        return seconds * elements / max(1, self.elements)

    def scales(self, world: int) -> tuple[float, ...]:
        """Per-worker compute scale for ``world`` workers."""
        if not self.worker_scale:
            return (1.0,) * world
        if len(self.worker_scale) != world:
            raise ValueError(f"worker_scale has {len(self.worker_scale)} entries for {world} workers")
        return self.worker_scale


def codec_key(replicator: str, compression: float, transfer_dtype: str = "fp32", chunk: int = 64,
              topk: int | None = None, base: str = "sgd") -> str:
    """The key of a decoupled setting in :attr:`~quietsync.cost.compute.ComputeProfile.codec_s`:
    ``replicator:compression:dtype[:chunk:topk]:base`` (the replicator's name first)."""
    key = replicator
    if replicator not in ("full", "none"):
        key += f":{compression:.6g}:{transfer_dtype}"
    if replicator == "dct":
        key += f":{chunk}:{topk}"
    return f"{key}:{base}"


def codec_knobs(key: str) -> dict:
    """The knobs of :func:`codec_key`'s ``key`` (for calibrating it)."""
    parts = key.split(":")
    knobs: dict = {"replicator": parts[0], "base": parts[-1]}
    if parts[0] not in ("full", "none"):
        knobs.update(compression=float(parts[1]), transfer_dtype=parts[2])
    if parts[0] == "dct":
        # codec_key writes a topk of None as the text 'None'
        knobs.update(chunk=int(parts[3]), topk=None if parts[4] == "None" else int(parts[4]))
    return knobs
