"""The check every resume makes first: all workers of the job saved their checkpoints at the same position.

A strategy's :meth:`~quietsync.strategies.base.Strategy.position` (committed steps plus its stage counters) is
part of every checkpoint. Loading compares it across workers in one collective, so a checkpoint taken at
different positions is refused on every worker at once instead of resuming onto a wrong trajectory or hanging.
"""

from __future__ import annotations

from typing import Any

import torch

from ...transport import Transport


def check_positions_agree(transport: Transport, keys: dict[str, int], position: dict[str, Any],
                          problem: str | None) -> None:
    """Check across ``world`` that every worker loads a checkpoint taken at the same position.

    ``keys`` fixes the counters' order; ``problem`` is this worker's own reason to reject its checkpoint
    (then it sends a flag instead of a position). Every worker learns every other's verdict from one
    all-gather, so all raise together.
    """
    names = sorted(keys)  # one order on every worker, whatever the dict's
    mine = torch.tensor([0 if problem else 1] + [int(position.get(k, -1)) for k in names], dtype=torch.int64,
                        device=transport.device)
    n = transport.group_size("world")
    every = torch.empty(n * mine.numel(), dtype=torch.int64, device=transport.device)
    transport.all_gather(every, mine, "world", name="all_gather/checkpoint_position")
    rows = every.view(n, -1).tolist()
    # only after the all-gather: raising before it would leave the peers waiting
    if problem:
        raise ValueError(problem)
    rejected = [r for r, row in enumerate(rows) if row[0] == 0]
    if rejected:
        raise ValueError(f"the checkpoint of worker(s) {rejected} was rejected there (see their error)")
    positions = [dict(zip(names, row[1:])) for row in rows]
    if any(p != positions[0] for p in positions):
        described = "; ".join(f"rank {r}: " + ", ".join(f"{k}={v}" for k, v in p.items())
                              for r, p in enumerate(positions))
        raise ValueError(
            "workers saved this checkpoint at different positions, so resuming would continue a wrong "
            f"trajectory ({described}). Take checkpoints at the same position on every worker: right after "
            "step() returned True on all of them, as `quietsync train` does.")
