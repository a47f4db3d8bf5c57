"""The baselines every method is compared with: PyTorch DDP, ZeRO-1 and hybrid-sharded FSDP2 (HSDP)."""

from . import ddp, fsdp, zero1  # noqa: F401  (importing a strategy module registers it)
