"""Activation checkpointing and ``torch.compile`` under every strategy that moves parameter storage around (flat
buffers, ACCO's estimate, FSDP2's shards, Cyclic DP's versions): the trajectory is the one without them.

The model is a tiny GPT-Neo (the trainer's architecture); checkpointing is its own per-block
``activation_checkpointing_enable`` (``quietsync.models.enable_activation_checkpointing``), compile is
``torch.compile`` of each block (``compile_blocks``).
"""

from __future__ import annotations

import pytest
import torch

import quietsync
from quietsync.activation_memory import ActivationMeter
from quietsync.models import ModelPreset, build_model, compile_blocks, enable_activation_checkpointing
from quietsync.transport import Transport
from tests.distributed import run_ranks

CONFIG = {
    "ddp": {"accumulation": 2}, "zero1": {"accumulation": 2}, "fsdp": {"accumulation": 2},
    "acco": {"deterministic_accumulation": 2}, "dpu": {"deterministic_accumulation": 1},
    "wp": {"deterministic_accumulation": 1}, "demo": {"chunk": 4}, "flexdemo": {"chunk": 4},
    "localsgd": {"sync_every": 2}, "diloco": {"sync_every": 2}, "cdp": {"stages": 2},
}
WORLD = {"fsdp": (4, 2), "flexdemo": (4, 2)}  # (workers, nodes): FSDP2 shards inside a node of 2
STEPS = 3
COMPILED = ("zero1", "acco", "fsdp", "cdp")
"""The strategies compiled blocks run under: flat buffers, ACCO's estimate, FSDP2's shards, Cyclic DP's stages."""


def gpt_neo() -> torch.nn.Module:
    return build_model(ModelPreset(hidden_size=32, num_layers=2, num_heads=2, max_positions=32), 64, 0, seed=0)


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def trajectory(name: str, transform: str, rank: int, transport: Transport | None = None) -> list[torch.Tensor]:
    model = gpt_neo()
    if transform == "checkpointing":
        enable_activation_checkpointing(model)
    elif transform == "compile":
        compile_blocks(model)
    s = quietsync.make_strategy(name, model, torch.optim.AdamW, transport=transport, config=dict(CONFIG[name]),
                                lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    out = []
    while s.steps < STEPS:
        s.forward_backward(torch.randint(0, 64, (4, 16), generator=g), lm_loss)
        if s.step():
            with s.committed_params() as m:
                out.append(torch.cat([p.detach().reshape(-1).clone() for p in m.parameters()]))
    s.close()
    return out


def both(rank: int, world: int, name: str, transform: str) -> tuple[list, list]:
    """Worker body: the plain run, then the transformed one, on one transport."""
    transport = Transport()
    try:
        return trajectory(name, "none", rank, transport), trajectory(name, transform, rank, transport)
    finally:
        transport.close()


def one(rank: int, world: int, name: str, transform: str) -> list:
    return trajectory(name, transform, rank)


def _runs(name: str, transform: str) -> list[tuple[list, list]]:
    world, nodes = WORLD.get(name, (2, None))
    if transform == "compile" and name == "fsdp":  # compiling costs seconds per worker: shards on one node of 2
        world, nodes = 2, 1
    if name == "cdp":  # its close leaves the schedule's last sends unreceived: one strategy per launch
        plain = run_ranks(one, world, name, "none", timeout=400)
        changed = run_ranks(one, world, name, transform, timeout=400)
        return list(zip(plain, changed))
    return run_ranks(both, world, name, transform, nodes=nodes, timeout=400)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(CONFIG))
def test_activation_checkpointing_keeps_the_trajectory(name):
    for plain, checkpointed in _runs(name, "checkpointing"):
        assert len(plain) == len(checkpointed) == STEPS
        for a, b in zip(plain, checkpointed):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)  # the same ops again: equal on CPU


@pytest.mark.long
@pytest.mark.timeout(600)
def test_compiled_blocks_keep_the_trajectory():
    """One test for the four strategies, one after the other: the first launch compiles the block's kernels into
    inductor's cache and the later ones load them. As four tests started together on a cold cache, eight workers
    compiled the same kernels at once (~48 s each on two cores, against ~46 s for all four in turn; ~23 s once the
    cache is warm)."""
    for name in COMPILED:
        for plain, compiled in _runs(name, "compile"):
            assert len(plain) == len(compiled) == STEPS, name
            for a, b in zip(plain, compiled):
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_checkpointing_holds_fewer_activations_for_backward():
    def saved_bytes(checkpointing: bool) -> int:
        model = build_model(ModelPreset(hidden_size=64, num_layers=4, num_heads=2, max_positions=64), 64, 0, seed=0)
        if checkpointing:
            enable_activation_checkpointing(model)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        meter = ActivationMeter(exclude=lambda t: t.untyped_storage().data_ptr() in params)
        batch = torch.randint(0, 64, (4, 64))
        with meter.track():
            loss = lm_loss(model, batch)
        held = meter.sample().bytes
        loss.backward()
        return held

    plain, checkpointed = saved_bytes(False), saved_bytes(True)
    assert checkpointed < 0.5 * plain, (plain, checkpointed)


def test_models_without_blocks_or_checkpointing_are_refused():
    mlp = torch.nn.Sequential(torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match="--activation-checkpointing: Sequential does not support"):
        enable_activation_checkpointing(mlp)
    with pytest.raises(ValueError, match="--compile: Sequential has no transformer blocks"):
        compile_blocks(mlp)
