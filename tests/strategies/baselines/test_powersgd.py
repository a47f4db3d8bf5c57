"""quietsync's PowerSGD and fp16/bf16 DDP hooks (through the transport) against PyTorch's own hooks on a plain
gloo process group: same model, same data, several steps across ``start_iter``; parameters bit-equal, and
the metered bytes equal a hand count from the parameter shapes."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel

from quietsync.strategies.baselines.powersgd import PowerSGDState, cast_hook, orthogonalize, powersgd_hook
from quietsync.topology import Topology
from quietsync.transport import Transport
from tests.distributed import run_ranks


class Net(torch.nn.Module):
    """Shapes chosen so that some gradients are compressed, some are not (vectors, a thin matrix), and two
    compressed shapes recur out of order (the P/Q layout groups them by shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 16, 3)        # (16, 36) as a matrix
        self.l1 = torch.nn.Linear(256, 32)           # (32, 256)
        self.l2 = torch.nn.Linear(32, 32)            # (32, 32)
        self.l3 = torch.nn.Linear(32, 256)           # (256, 32)
        self.l4 = torch.nn.Linear(256, 32)           # (32, 256) again
        self.head = torch.nn.Linear(32, 2)           # (2, 32): never worth compressing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)).flatten(1)
        h = torch.tanh(self.l1(h))
        h = torch.tanh(self.l2(h))
        h = torch.tanh(self.l3(h))
        h = torch.tanh(self.l4(h))
        return self.head(h)


def hand_count(model: torch.nn.Module, rank: int, start_iter: int, steps: int) -> int:
    """Bytes a worker of 2 sends: ring all-reduce of B bytes over 2 workers sends B. Warm-up steps send every
    gradient; compressed steps send Σ rows·r (P) + Σ cols·r (Q) + the uncompressed elements, in fp32."""
    full = compressed = 0
    for p in model.parameters():
        rows = p.shape[0]
        cols = math.prod(p.shape[1:]) if p.dim() > 1 else 1
        r = min(rows, cols, rank)
        full += p.numel() * 4
        compressed += (rows + cols) * r * 4 if (rows + cols) * r * 2 < rows * cols else p.numel() * 4
    warm = min(start_iter, steps)
    return warm * full + (steps - warm) * compressed


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 4, 6, 6, generator=g), torch.randn(8, 2, generator=g)


def _train(ddp: torch.nn.Module, steps: int, rank: int) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = _batch(step, rank)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()


def _serially(state: torch_psgd.PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's hook, one bucket at a time. With several buckets on gloo its continuations (which issue the P
    and Q all-reduces) run on gloo's threads, and two workers can issue different buckets' collectives in a
    different order (a mismatched collective); waiting for each bucket keeps its math and fixes the order."""
    value = torch_psgd.powerSGD_hook(state, bucket).wait()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(value)
    return fut


_serially.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


def _torch_bf16(pg: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's ``bf16_compress_hook`` itself; DDP refuses to register it by name without NCCL, gloo runs it."""
    return default_hooks.bf16_compress_hook(pg, bucket)


_torch_bf16.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


def _oracle(rank: int, world: int, cases: list[dict]) -> list[dict]:
    transport = Transport(Topology.from_env())
    plain = dist.new_group(list(range(world)), backend="gloo")  # PyTorch's hooks run on this one
    out = []
    for case in cases:
        torch.manual_seed(0)
        ours_model = Net()
        ref_model = copy.deepcopy(ours_model)
        kw = {"bucket_cap_mb": case["bucket_cap_mb"]}
        ref = DistributedDataParallel(ref_model, process_group=plain, **kw)
        ours = DistributedDataParallel(ours_model, process_group=transport.process_group("world"), **kw)
        if case["hook"] == "powersgd":
            ref_state = torch_psgd.PowerSGDState(
                process_group=plain, matrix_approximation_rank=case["rank"], start_powerSGD_iter=case["start"],
                warm_start=case["warm_start"], use_error_feedback=case["error_feedback"], random_seed=case["seed"])
            ref.register_comm_hook(ref_state, torch_psgd.powerSGD_hook if case["bucket_cap_mb"] > 1 else _serially)
            state = PowerSGDState(rank=case["rank"], start_iter=case["start"], warm_start=case["warm_start"],
                                  error_feedback=case["error_feedback"], seed=case["seed"])
            ours.register_comm_hook(None, powersgd_hook(transport, state))
        else:
            torch_hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": _torch_bf16}
            ref.register_comm_hook(plain, torch_hook[case["hook"]])
            ours.register_comm_hook(None, cast_hook(transport, case["hook"]))
        before = transport.meter.snapshot()["world"]["sent"] if "world" in transport.meter.snapshot() else 0
        _train(ref, case["steps"], rank)
        _train(ours, case["steps"], rank)
        sent = transport.meter.snapshot()["world"]["sent"] - before
        diffs = [float((a - b).detach().abs().max()) for a, b in zip(ref_model.parameters(), ours_model.parameters())]
        equal = all(torch.equal(a, b) for a, b in zip(ref_model.parameters(), ours_model.parameters()))
        moved = float(sum((a - b).detach().abs().sum() for a, b in zip(ours_model.parameters(), Net().parameters())))
        out.append({"max_diff": max(diffs), "equal": equal, "sent": sent, "moved": moved,
                    "hand": hand_count(ours_model, case.get("rank", 0), case.get("start", 0), case["steps"])})
    transport.close()
    return out


CASES = [
    # rank 1 and 2: Gram-Schmidt; rank 4: QR. Buckets: one, or several (and rebuilt after iteration 1).
    {"hook": "powersgd", "rank": 1, "start": 2, "warm_start": True, "error_feedback": True, "seed": 0,
     "bucket_cap_mb": 25.0, "steps": 6},
    {"hook": "powersgd", "rank": 2, "start": 3, "warm_start": True, "error_feedback": True, "seed": 7,
     "bucket_cap_mb": 0.02, "steps": 7},
    {"hook": "powersgd", "rank": 4, "start": 2, "warm_start": True, "error_feedback": True, "seed": 1,
     "bucket_cap_mb": 25.0, "steps": 6},
    {"hook": "powersgd", "rank": 4, "start": 2, "warm_start": False, "error_feedback": False, "seed": 3,
     "bucket_cap_mb": 0.02, "steps": 5},
    {"hook": "fp16", "bucket_cap_mb": 25.0, "steps": 4},
    {"hook": "bf16", "bucket_cap_mb": 0.02, "steps": 4},
]


@pytest.mark.timeout(180)
def test_hooks_match_pytorch_to_the_rounding_and_bytes_match_hand_count():
    results = run_ranks(_oracle, 2, CASES, timeout=170)
    for per_rank in results:
        for case, res in zip(CASES, per_rank):
            if case["hook"] == "powersgd":
                # the same arithmetic, but PyTorch's hook and ours reach the matrix products through differently
                # shaped calls, and some CPUs' kernels round those apart by an ulp (1.5e-8 seen on one Xeon model
                # whose recordings matched bit for bit elsewhere): bit-equal, or within float32 rounding
                assert res["equal"] or res["max_diff"] <= 1e-7, (case, res["max_diff"])
            else:
                assert res["equal"], (case, res["max_diff"])
            assert res["moved"] > 0  # training happened
            if case["hook"] == "powersgd":
                assert res["sent"] == res["hand"], case
            else:  # every gradient in 2 bytes
                full = sum(p.numel() for p in Net().parameters())
                assert res["sent"] == case["steps"] * full * 2, case


def test_orthogonalize_gives_orthonormal_columns():
    for r in (1, 2, 3, 5):
        m = torch.randn(2, 9, r, dtype=torch.float64)
        span = m.clone()
        orthogonalize(m)
        eye = torch.eye(r, dtype=torch.float64).expand(2, r, r)
        assert torch.allclose(m.transpose(1, 2) @ m, eye, atol=1e-12)
        # same column space as the input: projecting the input onto it changes nothing
        assert torch.allclose(m @ (m.transpose(1, 2) @ span), span, atol=1e-10)


def test_bad_knobs_and_state_round_trip():
    with pytest.raises(ValueError, match="powersgd_start_iter must be >= 2"):
        PowerSGDState(rank=2, start_iter=1)
    with pytest.raises(ValueError, match="powersgd_rank must be an integer >= 1"):
        PowerSGDState(rank=0, start_iter=10)
    s = PowerSGDState(rank=2, start_iter=5, seed=3)
    s.rng.randint(10)
    s.iter = 7
    t = PowerSGDState(rank=2, start_iter=5, seed=3)
    t.load_state_dict(s.state_dict())
    assert t.iter == 7 and t.rng.randint(1_000_000_000) == s.rng.randint(1_000_000_000)
    s.errors[0] = torch.randn(5)  # residuals are saved per parameter: that needs the parameters' names
    with pytest.raises(ValueError, match="needs names"):
        s.state_dict()
    # which tensors are compressed: vectors never; (rows + cols)·r·2 < rows·cols decides
    assert s.plan([torch.Size([64]), torch.Size([32, 256]), torch.Size([2, 32]), torch.Size([8, 4, 3, 3])]) == (
        [1, 3], [0, 2])
