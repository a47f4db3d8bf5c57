"""Checkpoints that reshard for the strategies whose workers keep state of their own (localsgd, diloco in all its
forms, demo, flexdemo) and those with a round in flight (acco, dpu, wp).

The policy (``quietsync.strategies.checkpoint.replicas``), checked here against an oracle written from its
statement on the saved workers' state, by name:

* at the same number of workers the logical path continues the uninterrupted run bit for bit (every replica
  is a survivor);
* on another number, a survivor (new replica i < old count) holds exactly what old replica i saved and — until
  the next synchronisation, which mixes in the new world — continues exactly as old worker i would have; a joiner
  holds θ_global (diloco) / the last averaged θ (localsgd) / the shared model (demo, flexdemo), the mean of the
  saved moments, and zero residual / decoupled momentum; a leaver's state is gone;
* acco/dpu/wp drain the round in flight: the new world holds exactly the old world's P, B, master, moments,
  counters and Σg̃ (the old workers' gradients), the drained job's per-worker counts folded.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks

from . import _replica_workers as w

pytestmark = pytest.mark.timeout(300)

_ALL = list(w.CASES)


def _run(case: str, world: int, folder: str, more: int, load: bool) -> list[dict]:
    _, _, nodes = w.CASES[case]
    fn = w.load_and_continue if load else w.train_and_save
    return run_ranks(fn, world, case, folder, more, nodes=(nodes if nodes and world % nodes == 0 else None)
                     if world > 1 else None, timeout=150)


def _equal(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), (where, set(a), set(b))
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("case", _ALL)
def test_the_logical_path_at_the_same_world_size_continues_bit_for_bit(tmp_path, case):
    world = 4 if w.CASES[case][2] else 2
    folder = str(tmp_path / "step")
    saved = _run(case, world, folder, 2, load=False)
    loaded = _run(case, world, folder, 2, load=True)
    for r, (s, h) in enumerate(zip(saved, loaded)):
        assert h["continued"]["losses"] == s["continued"]["losses"], r
        _equal(h["continued"]["held"], s["continued"]["held"], f"rank {r}")
