"""Sign and transfer-dtype cast: the element-wise part of the codecs.

``transfer_dtype`` is what values travel as (``fp32`` / ``bf16`` / ``fp16``); the sender
keeps in its residual exactly what the cast lost, so error feedback also corrects quantisation.
``sign`` maps an update to {-1, 0, +1} (DeMo's default; paper 001 Appendix B finds it helps).
"""

from __future__ import annotations

import torch

from ...validate import check_choice

__all__ = ["TRANSFER_DTYPES", "transfer_dtype", "apply_sign"]

TRANSFER_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def transfer_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a transfer-dtype name (``fp32``, ``bf16``, ``fp16``)."""
    if isinstance(name, torch.dtype):
        check_choice("transfer_dtype", name, TRANSFER_DTYPES.values())
        return name
    check_choice("transfer_dtype", name, TRANSFER_DTYPES)
    return TRANSFER_DTYPES[name]


def apply_sign(x: torch.Tensor, enabled: bool = True) -> torch.Tensor:
    """``sign(x)`` when enabled, else ``x`` (in place on a tensor the caller owns)."""
    return x.sign_() if enabled else x
