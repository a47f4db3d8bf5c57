"""Checkpoints that reshard for the dim-0-sharded strategies (``fsdp``, ``flexdemo``), through DCP.

Claims, each against an oracle written here (the workers cut each worker's rows out of the substrate
themselves, and the tests put the rows of a shard group back together):

* ``fsdp`` saved on one layout (nodes × workers per node) loads on another — more or fewer nodes, more or fewer
  workers per node — with the parameters and AdamW state equal to those saved, and continues like one process
  running plain ``torch.optim.AdamW`` from them on the new world's global batch;
* ``flexdemo`` keeps **each node's** state: parameters, decoupled momentum (spatial; converted into the DCT
  domain of the new cut), Adam moments and counters of node ``r`` come back on node ``r`` on another number of
  workers per node, either substrate; at the same layout the run continues as if never stopped;
* ``flexdemo`` on another number of nodes: each node is a replica (``tests/train/test_reshard_replicas.py``).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.strategies.helpers import logical_shards_workers as w
from tests.train._reshard_workers import adamw_from

pytestmark = pytest.mark.timeout(240)


def _assemble(held: list[dict], node: int, part: str, name: str, key: str | None = None) -> torch.Tensor:
    """Node ``node``'s rows of ``name`` (``part`` params, or state ``key``) put back together in shard order."""
    pieces = sorted((h["index"], h[part][name] if key is None else h[part][name][key])
                    for h in held if h["node"] == node)
    return torch.cat([t for _, t in pieces])


def _nodes(held: list[dict]) -> list[int]:
    return sorted({h["node"] for h in held})


def _oracle(saved: list[dict], new_world: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """One process: plain AdamW from the saved (reassembled) weights and state, on the new world's global batch."""
    params = {name: _assemble(saved, 0, "params", name) for name in w.NAMES}
    state = {name: {"step": next(h["state"][name]["step"] for h in saved if h["node"] == 0),
                    "exp_avg": _assemble(saved, 0, "state", name, "exp_avg"),
                    "exp_avg_sq": _assemble(saved, 0, "state", name, "exp_avg_sq")} for name in w.NAMES}
    return adamw_from(params, state, new_world)


@pytest.mark.parametrize(("old", "new"), [((4, 2), (2, 1)), ((2, 1), (4, 2)), ((4, 1), (4, 4))],
                         ids=["2x2-to-1x2", "1x2-to-2x2", "1x4-to-4x1"])
def test_fsdp_reshards_across_nodes_and_workers_and_continues_like_one_process(tmp_path, old, new):
    folder = str(tmp_path / "step")
    saved = run_ranks(w.train_and_save, old[0], "fsdp", {}, folder, nodes=old[1])
    loaded = run_ranks(w.load_and_continue, new[0], "fsdp", {}, folder, nodes=new[1])
    for node in _nodes(loaded):
        for name in w.NAMES:
            assert torch.equal(_assemble(loaded, node, "params", name), _assemble(saved, 0, "params", name)), name
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(_assemble(loaded, node, "state", name, key),
                                   _assemble(saved, 0, "state", name, key)), (name, key)
    assert all(h["steps"] == w.STEPS and h["base_lrs"] == saved[0]["base_lrs"] for h in loaded)
    losses, params = _oracle(saved, new[0])
    for r, h in enumerate(loaded):
        assert h["continued"]["losses"] == pytest.approx([step[r] for step in losses], rel=1e-6, abs=1e-7)
        for k, v in params.items():
            torch.testing.assert_close(h["continued"]["params"][k], v, rtol=1e-5, atol=1e-6)


FLEX = {"base": "adamw", "compression": 0.25, "chunk": 4, "sign": False, "beta": 0.9}


@pytest.mark.parametrize(("replicator", "params", "old", "new"), [
    ("dct", "sharded", (4, 2), (2, 2)),
    ("dct", "sharded", (2, 2), (4, 2)),
    ("striding", "replicated", (4, 2), (2, 2)),
    ("dct", "sharded", (4, 2), (4, 2)),
    ("striding", "replicated", (4, 2), (4, 2)),
], ids=["dct-fsdp2-2x2-to-2x1", "dct-fsdp2-2x1-to-2x2", "striding-flat-2x2-to-2x1", "dct-fsdp2-same",
        "striding-flat-same"])
def test_flexdemo_keeps_each_nodes_state_on_another_number_of_workers_per_node(tmp_path, replicator, params, old,
                                                                                new):
    config = {**FLEX, "replicator": replicator, "params": params}
    folder = str(tmp_path / "step")
    saved = run_ranks(w.train_and_save, old[0], "flexdemo", config, folder, nodes=old[1])
    loaded = run_ranks(w.load_and_continue, new[0], "flexdemo", config, folder, nodes=new[1])
    assert _nodes(saved) == _nodes(loaded) == [0, 1]
    spatial = replicator != "dct"  # a DCT-domain momentum goes through space and back: equal up to rounding
    for node in (0, 1):
        for name in w.NAMES:
            assert torch.equal(_assemble(loaded, node, "params", name), _assemble(saved, node, "params", name))
            for key in ("exp_avg", "exp_avg_sq", "delta"):
                got, want = _assemble(loaded, node, "state", name, key), _assemble(saved, node, "state", name, key)
                if spatial or key != "delta":
                    assert torch.equal(got, want), (node, name, key)
                else:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # each node's momentum is its own: the two nodes' differ
    assert not torch.equal(_assemble(saved, 0, "state", "0.weight", "delta"),
                           _assemble(saved, 1, "state", "0.weight", "delta"))
    assert {h["decoupled_step"] for h in loaded} == {saved[0]["decoupled_step"]} == {w.STEPS}
    assert all(h["replicator"] == saved[0]["replicator"] for h in loaded)
    if old == new:  # the same layout continues as if never stopped
        for s, h in zip(saved, loaded):
            if spatial:
                assert h["continued"]["losses"] == s["continued"]["losses"]
            else:
                assert h["continued"]["losses"] == pytest.approx(s["continued"]["losses"], rel=1e-5)
            for k, v in s["continued"]["params"].items():
                torch.testing.assert_close(h["continued"]["params"][k], v, rtol=1e-5, atol=1e-6)


class _WithScalar(torch.nn.Module):
    """A model with a 0-dim parameter and a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(5, 3)
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))
        self.register_buffer("offset", torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.temperature + self.offset


@pytest.mark.parametrize(("name", "config"), [("fsdp", {}), ("flexdemo", {**FLEX, "replicator": "dct"}),
                                              ("flexdemo", {**FLEX, "replicator": "full", "params": "replicated"})])
def test_a_world_of_one_round_trips_scalars_and_buffers(tmp_path, name, config):
    from quietsync.strategies import make_strategy
    from quietsync.train.logical_checkpoint import load_logical, save_logical
    from tests.train._reshard_workers import _stream

    def build(seed: int):
        torch.manual_seed(seed)
        return make_strategy(name, _WithScalar(), torch.optim.AdamW, lr=0.05, config=config)

    def step(strategy, s: int) -> float:
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        loss = strategy.forward_backward((x, y), lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
        assert strategy.step()
        return float(loss)

    first, stream = build(0), _stream(0, 1)
    for s in range(3):
        step(first, s)
    save_logical(tmp_path, first, stream, tokens_total=7)
    want = [step(first, s) for s in (3, 4)]
    second = build(1)
    assert load_logical(tmp_path, second, _stream(0, 1)) == 7
    assert torch.equal(second.module.offset, first.module.offset)
    assert [step(second, s) for s in (3, 4)] == pytest.approx(want, rel=1e-6)
    torch.testing.assert_close(second.module.temperature, first.module.temperature, rtol=1e-6, atol=1e-7)
    first.close()
    second.close()
