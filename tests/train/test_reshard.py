"""Checkpoints that reshard: ddp and zero1 saved on 4 workers resume on 2 and back.

Claims, each against an oracle written here:

* the state a new world loads equals the state the old world saved, unflattened (ZeRO-1's shards of the flat
  buffer concatenated, padding dropped, cut at the parameter offsets — the tests' own unflattening);
* the continued run on the new world equals one process running plain ``torch.optim.AdamW`` from the saved
  weights and optimizer state on the new world's global batch (the DDP ≡ ZeRO-1 ≡ one process oracle);
* at an unchanged world size the logical path continues bit-identically to the uninterrupted run;
* per-worker counters are folded so totals are kept; the data position is carried;
* a strategy whose state cannot be resharded refuses, on every worker, naming itself and why.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks

from . import _reshard_workers as w

pytestmark = pytest.mark.timeout(240)


def _flat_layout(model: torch.nn.Module) -> list[tuple[str, int, torch.Size]]:
    """(name, flat offset, shape) of each parameter in ZeRO-1's flat order: the parameter groups in order."""
    names = {id(p): n for n, p in model.named_parameters()}
    out, offset = [], 0
    for g in w.groups(model):
        for p in g["params"]:
            out.append((names[id(p)], offset, p.shape))
            offset += p.numel()
    return out


def _unflatten_shards(held: list[dict], key: str) -> dict[str, torch.Tensor]:
    """The workers' shards of ``key`` concatenated in rank order, padding dropped, cut per parameter."""
    layout = _flat_layout(w.model(0))
    numel = sum(s.numel() for _, _, s in layout)
    pieces = sorted((h["bounds"][0], h[key]) for h in held)
    flat = torch.cat([t for _, t in pieces])
    assert all(h["bounds"][1] - h["bounds"][0] == held[0]["bounds"][1] - held[0]["bounds"][0] for h in held)
    flat = flat[:numel]
    return {n: flat[o:o + s.numel()].view(s) for n, o, s in layout}


def _per_param_state(held: list[dict], name: str) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter: {exp_avg, exp_avg_sq, step}} of a saved or loaded world."""
    if name == "ddp":
        return held[0]["optim"]
    avg, sq = _unflatten_shards(held, "exp_avg"), _unflatten_shards(held, "exp_avg_sq")
    step = held[0]["step"][0]
    return {n: {"exp_avg": avg[n], "exp_avg_sq": sq[n], "step": torch.tensor(step)} for n in avg}


def _oracle(saved: list[dict], name: str, new_world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: plain AdamW from the saved weights and state, on the new world's global batch."""
    model = w.model(0)
    model.load_state_dict(saved[0]["params"])
    opt = torch.optim.AdamW(w.groups(model), lr=w.LR, betas=(0.9, 0.95))
    state = _per_param_state(saved, name)
    for p_name, p in model.named_parameters():
        opt.state[p] = {k: v.clone() for k, v in state[p_name].items()}
    losses = []
    for s in range(w.STEPS, w.STEPS + w.MORE):
        for g in opt.param_groups:
            g["lr"] = w.LR * w.schedule(s)
        opt.zero_grad()
        per_rank = [w.loss_fn(model, w.batch(s, r)) for r in range(new_world)]
        losses.append([float(x.detach()) for x in per_rank])
        (sum(per_rank) / new_world).backward()
        opt.step()
    return losses, {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize("name", ["ddp", "zero1"])
@pytest.mark.parametrize("old,new", [(4, 2), (2, 4)])
def test_a_checkpoint_reshards_and_continues_like_one_process(tmp_path, name, old, new):
    folder = str(tmp_path / "step")
    saved = run_ranks(w.train_and_save, old, name, folder)
    loaded = run_ranks(w.load_and_continue, new, name, folder)

    # the state loaded equals the state saved, unflattened
    for h in loaded:
        assert h["steps"] == w.STEPS
        assert h["base_lrs"] == saved[0]["base_lrs"]
        for k, v in saved[0]["params"].items():
            assert torch.equal(h["params"][k], v), k
    want, got = _per_param_state(saved, name), _per_param_state(loaded, name)
    assert set(got) == set(want) == set(saved[0]["params"])
    for p_name in want:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[p_name][key], want[p_name][key]), (p_name, key)
    if name == "zero1":
        assert torch.equal(torch.cat([v.reshape(-1) for v in _unflatten_shards(loaded, "master").values()]),
                           torch.cat([v.reshape(-1) for v in _unflatten_shards(saved, "master").values()]))

    # the continuation equals one process from the same weights and optimizer state
    losses, params = _oracle(saved, name, new)
    for r, h in enumerate(loaded):
        assert h["continued"]["losses"] == pytest.approx([step[r] for step in losses], rel=1e-6, abs=1e-7)
        for k, v in params.items():
            torch.testing.assert_close(h["continued"]["params"][k], v, rtol=1e-5, atol=1e-6)

    # counters folded (totals kept), data position carried
    old_tokens = [100 + q for q in range(old)]
    assert [h["tokens"] for h in loaded] == [sum(t for q, t in enumerate(old_tokens) if q % new == r)
                                             for r in range(new)]
    assert sum(h["micro_batches"] for h in loaded) == old * w.STEPS
    assert {h["position"] for h in loaded} == {saved[0]["position"]} == {(0, old * w.STEPS * w.MBS)}


@pytest.mark.parametrize("name", ["ddp", "zero1"])
def test_the_logical_path_at_the_same_world_size_is_exact(tmp_path, name):
    folder = str(tmp_path / "step")
    saved = run_ranks(w.train_and_save, 2, name, folder)
    loaded = run_ranks(w.load_and_continue, 2, name, folder)
    for r, (s, h) in enumerate(zip(saved, loaded)):
        assert h["continued"]["losses"] == s["continued"]["losses"]
        for k, v in s["continued"]["params"].items():
            assert torch.equal(h["continued"]["params"][k], v), k
        assert h["tokens"] == 100 + r  # each worker keeps its own count


@pytest.mark.parametrize("name", ["acco", "demo", "localsgd"])
def test_a_strategy_that_cannot_reshard_refuses_on_every_worker(tmp_path, name):
    errors = run_ranks(w.refuse, 2, name, str(tmp_path / "step"), "save")
    assert len(set(errors)) == 1 and errors[0].startswith(f"strategy {name} cannot be resharded: ")
    saved = tmp_path / "zero1"
    run_ranks(w.train_and_save, 2, "zero1", str(saved))
    errors = run_ranks(w.refuse, 2, name, str(saved), "load")
    assert len(set(errors)) == 1 and errors[0].startswith(f"strategy {name} cannot be resharded: ")
