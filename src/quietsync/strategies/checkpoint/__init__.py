"""Checkpoint forms shared by strategies: the world-size-independent (logical) state written through
``torch.distributed.checkpoint``, dim-0 shard pieces, and the check that every worker saved at one
position."""
