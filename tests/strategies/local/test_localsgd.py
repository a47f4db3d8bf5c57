"""localsgd ≡ HF Accelerate's LocalSGD ≡ the single-process recurrence; K=1 + SGD ≡ ddp; exact resume."""

from __future__ import annotations

import os

import pytest
import torch

import quietsync
from tests.distributed import run_ranks
from tests.strategies.helpers.common import flat_params, loss_fn, micro_batch, param_groups, tiny_model
from tests.strategies.helpers.local_common import ADAMW, train, train_many
from tests.strategies.helpers.reference_local import reference_localsgd


def _accelerate_local_sgd(rank: int, world: int, sync_every: int, steps: int) -> list[torch.Tensor]:
    """HF Accelerate's own LocalSGD (MULTI_CPU, gloo), written the way its docs show; params after each step."""
    os.environ["OMP_NUM_THREADS"] = "1"
    from accelerate import Accelerator, DistributedType
    from accelerate.local_sgd import LocalSGD

    accelerator = Accelerator(cpu=True)
    assert accelerator.distributed_type == DistributedType.MULTI_CPU
    model = tiny_model()
    opt = torch.optim.AdamW(param_groups(model), **ADAMW)
    model, opt = accelerator.prepare(model, opt)
    out = []
    with LocalSGD(accelerator, model, local_sgd_steps=sync_every) as local_sgd:
        for s in range(steps):
            accelerator.backward(loss_fn(model, micro_batch(s, rank, 0)))
            opt.step()
            opt.zero_grad()
            local_sgd.step()
            out.append(flat_params(model))
    return out


@pytest.mark.timeout(240)
def test_localsgd_equals_accelerate_local_sgd_and_the_reference():
    K, steps = 3, 8
    ours = run_ranks(train_many, 2, [{"strategy": "localsgd", "config": {"sync_every": K}, "steps": steps}])
    theirs = run_ranks(_accelerate_local_sgd, 2, K, steps)
    reference = reference_localsgd(2, K, steps, lambda g: torch.optim.AdamW(g, **ADAMW))
    for r in range(2):
        for t in range(steps):  # every step, the local steps between syncs included
            torch.testing.assert_close(ours[r][0]["trace"][t]["params"], theirs[r][t], rtol=0, atol=1e-6)
        torch.testing.assert_close(ours[r][0]["params"], reference[r], rtol=1e-5, atol=1e-6)
    # the replicas differ between syncs and agree right after each
    for t in range(steps):
        a, b = (ours[r][0]["trace"][t]["params"] for r in range(2))
        synced = ours[0][0]["trace"][t]["extra"]["synced"]
        assert synced == ((t + 1) % K == 0)
        assert (torch.equal(a, b)) == synced
    # committed params = the last average
    torch.testing.assert_close(ours[0][0]["committed"], ours[0][0]["trace"][5]["params"], rtol=0, atol=0)


@pytest.mark.timeout(240)
def test_k1_sgd_equals_ddp_and_state_averaging_and_resume():
    jobs = [
        {"strategy": "localsgd", "config": {"sync_every": 1}, "optimizer": "sgd", "steps": 4},
        {"strategy": "ddp", "config": {}, "optimizer": "sgd", "steps": 4},
        {"strategy": "localsgd", "config": {"sync_every": 2, "average_optimizer_state": True, "accumulation": 2},
         "steps": 5},
        {"strategy": "localsgd", "config": {"sync_every": 2, "average_optimizer_state": True, "accumulation": 2},
         "steps": 5, "resume_at": 3},
    ]
    res = run_ranks(train_many, 2, jobs)
    reference_avg = reference_localsgd(2, 2, 5, lambda g: torch.optim.AdamW(g, **ADAMW), accumulation=2,
                                       average_state=True)
    reference_plain = reference_localsgd(2, 2, 5, lambda g: torch.optim.AdamW(g, **ADAMW), accumulation=2)
    for r in range(2):
        local, ddp, avg, resumed = res[r]
        torch.testing.assert_close(local["params"], ddp["params"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(avg["params"], reference_avg[r], rtol=1e-5, atol=1e-6)
        # averaging the moments matters (the test can fail): the plain recurrence differs
        assert (avg["params"] - reference_plain[r]).abs().max() > 1e-5
        assert torch.equal(resumed["params"], avg["params"])
        # bytes: only sync steps talk; params + Adam moments all-reduced over 2 workers = 3·696 bytes sent
        for t, step in enumerate(avg["trace"]):
            sent = step["bytes"].get("world", {}).get("sent", 0)
            assert sent == (3 * 696 if (t + 1) % 2 == 0 else 0), (t, step["bytes"])


def test_localsgd_world_of_one_and_bad_knobs(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    out = train(0, "localsgd", {"sync_every": 2}, steps=3)
    assert out["steps"] == 3 and [t["extra"]["synced"] for t in out["trace"]] == [False, True, False]
    assert set(out["memory"]) >= {"params", "optimizer_state", "synced_params"}
    for bad, field in [({"sync_every": 0}, "sync_every"), ({"sync_every": 1.5}, "sync_every"),
                       ({"accumulation": 0}, "accumulation")]:
        with pytest.raises(ValueError, match=f"^{field} must be"):
            quietsync.make_strategy("localsgd", tiny_model(), torch.optim.SGD, config=bad, lr=0.1)
