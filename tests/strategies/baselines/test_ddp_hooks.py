"""``ddp`` with ``comm_hook`` powersgd / fp16 / bf16: bytes per step equal the hand count, PowerSGD's state
resumes exactly (before and after compression starts, several buckets), bad knobs are refused. The hooks
themselves are checked against PyTorch's in ``test_powersgd.py``."""

from __future__ import annotations

import pytest
import torch

import quietsync
from tests.distributed import run_ranks
from tests.strategies.helpers.common import tiny_model
from tests.strategies.helpers.local_common import train_many

PSI = 174
PSGD = {"comm_hook": "powersgd", "powersgd_rank": 1, "powersgd_start_iter": 3, "bucket_cap_mb": 0.0003}


def _sent(step: dict) -> int:
    return step["bytes"].get("world", {}).get("sent", 0)


@pytest.mark.timeout(300)
def test_powersgd_and_half_hooks_bytes_and_exact_resume():
    jobs = [
        {"strategy": "ddp", "config": PSGD, "steps": 7},                       # 0
        {"strategy": "ddp", "config": PSGD, "steps": 7, "resume_at": 2},       # 1 before compression starts
        {"strategy": "ddp", "config": PSGD, "steps": 7, "resume_at": 5},       # 2 with residuals and Q
        {"strategy": "ddp", "config": {**PSGD, "powersgd_warm_start": False}, "steps": 6},
        {"strategy": "ddp", "config": {"comm_hook": "fp16"}, "steps": 3},      # 4
        {"strategy": "ddp", "config": {"comm_hook": "bf16"}, "steps": 3},      # 5
        {"strategy": "ddp", "config": {}, "steps": 3},                         # 6 plain
    ]
    res = run_ranks(train_many, 2, jobs, timeout=280)
    for r in range(2):
        assert torch.equal(res[r][1]["params"], res[r][0]["params"])
        assert torch.equal(res[r][2]["params"], res[r][0]["params"])
        for j in (4, 5):  # half-precision averages land near the fp32 run
            diff = (res[r][j]["params"] - res[r][6]["params"]).abs().max()
            assert 0 < diff < 1e-2, (j, diff)
    # replicas agree after every step (PowerSGD's P Q^T and the averaged vectors are the same everywhere)
    for j in (0, 3):
        for t in range(len(res[0][j]["trace"])):
            assert torch.equal(res[0][j]["trace"][t]["params"], res[1][j]["trace"][t]["params"])
    # bytes, 2 workers (a ring all-reduce of B bytes sends B): warm-up steps send every gradient in fp32;
    # compressed steps W0 (13x7) and W1 (5x13) as rank-1 P and Q, the biases (18) uncompressed
    compressed = 4 * ((13 + 7) + (5 + 13) + 13 + 5)
    for j in (0, 3):  # (a resumed run's first step also carries the load's position check)
        sent = [_sent(s) for s in res[0][j]["trace"]]
        assert sent == [4 * PSI] * 3 + [compressed] * (len(sent) - 3), (j, sent)
    for j in (4, 5):
        assert [_sent(s) for s in res[0][j]["trace"]] == [2 * PSI] * 3
    assert res[0][0]["memory"]["powersgd_error"] == 4 * PSI


def test_bad_hook_knobs(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    cases = [({"comm_hook": "int8"}, "comm_hook must be one of allreduce, powersgd, fp16, bf16"),
             ({"comm_hook": "powersgd", "powersgd_rank": 0}, "powersgd_rank must be an integer >= 1"),
             ({"comm_hook": "powersgd", "powersgd_start_iter": 1}, "powersgd_start_iter must be >= 2")]
    for bad, message in cases:
        with pytest.raises(ValueError, match=f"^{message}"):
            quietsync.make_strategy("ddp", tiny_model(), torch.optim.SGD, config=bad, lr=0.1)
    s = quietsync.make_strategy("ddp", tiny_model(), torch.optim.SGD, config={"comm_hook": "powersgd"}, lr=0.1)
    assert s.reshard_refusal is not None and "PowerSGD" in s.reshard_refusal
    s.close()
