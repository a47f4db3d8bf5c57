"""The baselines every method is compared with: PyTorch DDP, ZeRO-1 and hybrid-sharded FSDP2 (HSDP)."""
