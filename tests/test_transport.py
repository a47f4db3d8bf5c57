"""The transport: bytes equal a hand computation, the link model stretches collectives, failures surface."""

from __future__ import annotations

import os
import time

import pytest
import torch

import quietsync
from quietsync import LinkModel, Topology, Transport
from tests.distributed import run_ranks
from tests.strategies.helpers.common import loss_fn, micro_batch, param_groups, tiny_model


def _every_collective(rank: int, world: int) -> dict:
    t = Transport(Topology.from_env(nodes=2))
    x = torch.ones(1000)  # 4000 bytes
    t.all_reduce(x, "world")
    assert torch.all(x == world)
    out = torch.empty(250)
    t.reduce_scatter(out, torch.ones(1000), "world")
    assert torch.all(out == world)
    gathered = torch.empty(4000)
    t.all_gather(gathered, torch.full((1000,), float(rank)), "world")
    assert torch.equal(gathered.view(world, -1)[:, 0], torch.arange(world, dtype=torch.float32))
    b = torch.full((1000,), float(rank))
    t.broadcast(b, src=1, group="world")
    assert torch.all(b == 1)
    s = torch.ones(1000)
    t.all_reduce(s, "shard", op="avg")
    r = torch.ones(1000)
    t.all_reduce(r, "replicate")
    parts = t.all_gather_uneven(torch.arange(rank + 1, dtype=torch.float32), "world")
    assert [p.numel() for p in parts] == [1, 2, 3, 4]
    return {"meter": t.meter.snapshot(), "kinds": t.meter.by_kind()}


@pytest.mark.timeout(120)
def test_bytes_equal_a_hand_computation():
    results = run_ranks(_every_collective, 4, nodes=2)
    B = 4000
    for rank, res in enumerate(results):
        kinds = res["kinds"]
        assert kinds["world/all_reduce"] == 2 * 3 * B // 4          # ring: 2(n-1)/n of the buffer
        assert kinds["world/reduce_scatter"] == 3 * B // 4          # (n-1)/n of the input
        assert kinds["shard/all_reduce"] == 2 * 1 * B // 2          # a node of 2 workers
        assert kinds["replicate/all_reduce"] == 2 * 1 * B // 2      # 2 nodes
        # chain broadcast from group rank 1: 1 -> 2 -> 3 -> 0; the last one (rank 0) forwards nothing
        assert kinds["world/broadcast"] == (0 if rank == 0 else B)
        # all-gather: (n-1)/n of the 16000-byte output, plus the uneven gather's sizes and padded values
        sizes, values = 3 * 4 * 8 // 4, 3 * 4 * 4 * 4 // 4
        assert kinds["world/all_gather"] == 3 * 16000 // 4 + sizes + values
        meter = res["meter"]
        recv_broadcast = 0 if rank == 1 else B
        sent_broadcast = 0 if rank == 0 else B
        assert meter["world"]["recv"] - recv_broadcast == meter["world"]["sent"] - sent_broadcast


def _timed_all_reduce(rank: int, world: int, numel: int) -> dict:
    link = LinkModel.parse("10mbit,5ms")
    t = Transport(Topology.from_env(), links={"inter": link})
    x = torch.ones(numel)
    t.barrier()
    t0 = time.perf_counter()
    t.all_reduce(x)
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    a, b = t.all_reduce(torch.ones(numel), async_op=True), t.all_reduce(torch.ones(numel), async_op=True)
    a.wait()
    b.wait()
    two = time.perf_counter() - t0
    spans = t.recorder.spans("comm")
    return {"one": one, "two": two, "modeled": link.time("all_reduce", numel * 4, world), "spans": len(spans),
            "booked": [(w.t_issue, w.t_wire, w.deadline, w.modeled_s) for w in (a, b)],
            "last_two": [(s.t0, s.t_wire, s.t1) for s in spans[-2:]]}


@pytest.mark.timeout(120)
def test_link_model_stretches_a_collective_to_its_modeled_time():
    """The link model's computed schedule is checked exactly (it does not depend on the machine's load); the wall
    clock only from below (an emulated transfer never ends before its booked end) and, for one collective,
    with 90% slack above (a collective stretched twice would take 2x)."""
    numel = 125_000  # 0.5 MB: 2 messages x 5 ms + 0.5 MB / 1.25 MB/s = 0.41 s on 2 workers
    for res in run_ranks(_timed_all_reduce, 2, numel):
        modeled = res["modeled"]
        assert modeled == pytest.approx(2 * 0.005 + 500_000 / 1.25e6)
        # computed: the first of two collectives issued together goes on the wire at once, the second waits
        # for the first to end (the link is serial), each booked for exactly the modeled time
        (issue_a, wire_a, end_a, model_a), (issue_b, wire_b, end_b, model_b) = res["booked"]
        assert model_a == model_b == modeled
        assert wire_a == issue_a and end_a == pytest.approx(wire_a + modeled, abs=1e-9)
        assert wire_b == pytest.approx(end_a, abs=1e-9) and end_b == pytest.approx(wire_b + modeled, abs=1e-9)
        # the recorded spans carry the same schedule
        assert res["spans"] >= 3
        assert [(t0, t_wire) for t0, t_wire, _ in res["last_two"]] == [(issue_a, wire_a), (issue_b, wire_b)]
        # wall clock: stretched to the booked end, never earlier
        assert res["one"] >= 0.99 * modeled
        assert res["one"] < 1.9 * modeled, res["one"]
        assert res["two"] >= 2 * modeled * 0.99
        for (_, _, t1), end in zip(res["last_two"], (end_a, end_b)):
            assert t1 >= end - 1e-6


def _ddp_and_zero1_bytes(rank: int, world: int, name: str) -> dict:
    model = tiny_model()
    strategy = quietsync.make_strategy(name, model, torch.optim.SGD, param_groups=param_groups(model), lr=0.1)
    strategy.backward(loss_fn(strategy.model, micro_batch(0, rank, 0)))
    assert strategy.step()
    m = strategy.last_step_metrics()
    strategy.close()
    return m.bytes_by_group


@pytest.mark.timeout(120)
def test_strategies_are_metered_ddp_through_its_comm_hook():
    params = 174 * 4
    for by_group in run_ranks(_ddp_and_zero1_bytes, 4, "ddp"):
        ring = 2 * 3 * params // 4  # ring all-reduce of every gradient bucket, n=4
        assert by_group["world"] == {"sent": ring, "recv": ring}
    padded = 176 * 4  # 174 parameters padded to a multiple of 4 workers
    for by_group in run_ranks(_ddp_and_zero1_bytes, 4, "zero1"):
        half = 3 * padded // 4  # reduce-scatter + all-gather, each (n-1)/n of the padded buffer
        assert by_group["world"] == {"sent": 2 * half, "recv": 2 * half}


def _raise_or_reduce(rank: int, world: int) -> str:
    t = Transport(Topology.from_env(), timeout_s=20)
    if rank == 1:
        raise RuntimeError("worker 1 crashed")
    t0 = time.perf_counter()
    try:
        t.all_reduce(torch.ones(10))
    except RuntimeError as exc:
        return f"{time.perf_counter() - t0:.1f}s {exc}"
    return "no error"


@pytest.mark.timeout(120)
def test_a_crashed_rank_fails_the_others_fast():
    results = run_ranks(_raise_or_reduce, 2, expect_failure=True, timeout=60)
    assert results[1][0] == "error" and "worker 1 crashed" in results[1][1]
    status, message = results[0]
    assert status == "ok" and message != "no error"
    assert "quietsync: all_reduce" in message and "failed on rank 0" in message


def _hang_or_reduce(rank: int, world: int, done: str) -> str:
    t = Transport(Topology.from_env(), timeout_s=2)
    if rank == 1:  # alive but never joins the collective: until rank 0 has its error, or 30 s
        deadline = time.monotonic() + 30
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        return "slept"
    t0 = time.perf_counter()
    try:
        t.all_reduce(torch.ones(10))
    except RuntimeError as exc:
        return f"error after {time.perf_counter() - t0:.1f}s: {exc}"
    finally:
        open(done, "w").close()
    return "no error"


@pytest.mark.timeout(120)
def test_a_hung_rank_fails_the_others_within_the_timeout(tmp_path):
    """The peer of a rank that never joins errs after the 2 s timeout; the hung rank holds out 30 s (it lets go
    as soon as the error came), so waiting for it instead would take 30 s: 15 s leaves a loaded machine slack."""
    results = run_ranks(_hang_or_reduce, 2, str(tmp_path / "done"), expect_failure=True, timeout=60)
    status, message = results[0]
    assert status == "ok" and message.startswith("error after"), message
    assert float(message.split()[2].rstrip("s:")) < 15, message


def test_world_of_one_is_local_and_free():
    t = Transport(Topology.single(), links={"inter": LinkModel(1.0, 1.0)})
    x = torch.arange(4.0)
    t.all_reduce(x)
    out = torch.empty(4)
    t.reduce_scatter(out, x)
    assert torch.equal(out, x)
    assert t.meter.sent == 0 and t.recorder.spans("comm") == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="links keys must be in"):
        Transport(Topology.single(), links={"wan": LinkModel(1.0)})
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        Transport(Topology.single(), timeout_s=0)
    with pytest.raises(ValueError, match="backend must be"):
        Transport(Topology.single(), backend="mpi")
    t = Transport(Topology.single())
    with pytest.raises(ValueError, match="group must be one of"):
        t.all_reduce(torch.ones(1), "planet")
    with pytest.raises(ValueError, match="op must be one of"):
        t.all_reduce(torch.ones(1), op="product")


def test_default_backend_is_nccl_only_with_a_gpu_per_local_worker_process(monkeypatch):
    """NCCL refuses two ranks on one GPU: more local processes than GPUs fall back to gloo; the env overrides."""
    from quietsync.transport import default_backend

    four = Topology(0, 4, 2)
    monkeypatch.delenv("QUIETSYNC_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_backend(four) == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_backend(four) == "gloo" and default_backend(Topology.single()) == "nccl"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert default_backend(four) == "nccl"
    monkeypatch.setenv("QUIETSYNC_BACKEND", "gloo")
    assert default_backend(four) == "gloo"
    monkeypatch.setenv("QUIETSYNC_BACKEND", "mpi")
    with pytest.raises(ValueError, match="QUIETSYNC_BACKEND must be"):
        default_backend(four)
    monkeypatch.delenv("QUIETSYNC_BACKEND")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs one CUDA device per worker process"):
        Transport(four, backend="nccl")


def _scheduled_all_reduces(rank: int, world: int, numel: int, change_s: float) -> dict:
    link = LinkModel.parse(f"1MB@0s,0.25MB@{change_s}s")  # 1 MB/s, then 0.25 MB/s from change_s on
    t = Transport(Topology.from_env(), links={"inter": link})
    t0 = time.perf_counter()
    t.all_reduce(torch.ones(numel))
    before = time.perf_counter() - t0
    # wait on the schedule's clock (not standing in for work: the next transfer must start after the change)
    time.sleep(max(0.0, link.epoch + change_s + 0.05 - time.perf_counter()))
    t0 = time.perf_counter()
    work = t.all_reduce(torch.ones(numel))
    after = time.perf_counter() - t0
    t.close()
    return {"before": before, "after": after, "epoch": link.epoch, "modeled_after": work.modeled_s}


@pytest.mark.timeout(120)
def test_a_scheduled_link_changes_rate_at_the_same_moment_on_every_worker():
    """Real gloo workers: a transfer before the change takes the first rate's time, one after it the new rate's;
    both workers' clocks start at the same moment (perf_counter is one system-wide clock on this machine)."""
    numel = 62_500  # 250 kB; on 2 workers a ring all-reduce sends B: 0.25 s at 1 MB/s, 1 s at 0.25 MB/s
    res = run_ranks(_scheduled_all_reduces, 2, numel, 1.0)
    for r in res:
        assert 0.99 * 0.25 <= r["before"] < 1.9 * 0.25, r
        assert r["modeled_after"] == pytest.approx(1.0)
        assert 0.99 * 1.0 <= r["after"] < 1.5 * 1.0, r
    assert abs(res[0]["epoch"] - res[1]["epoch"]) < 0.1


def _straddling_all_reduce(rank: int, world: int, numel: int, change_s: float) -> dict:
    link = LinkModel.parse(f"1MB@0s,0.25MB@{change_s}s")
    t = Transport(Topology.from_env(), links={"inter": link})
    # worker skew, not work: rank 0 reaches the collective 0.1 s before the change, rank 1 0.1 s after it
    time.sleep(max(0.0, link.epoch + change_s + (0.1 if rank else -0.1) - time.perf_counter()))
    work = t.all_reduce(torch.ones(numel))
    t.close()
    return {"modeled": work.modeled_s, "wire": work.t_wire - link.epoch, "end": work.deadline - link.epoch}


@pytest.mark.timeout(120)
def test_both_ends_of_a_collective_that_straddles_a_change_are_charged_one_rate():
    """Real gloo workers reaching one all-reduce on either side of a rate change: it starts when the last of them
    is ready (after the change), so both charge the new rate, from the same moment to the same end."""
    numel = 62_500  # 250 kB; on 2 workers a ring all-reduce sends B: 1 s at 0.25 MB/s
    res = run_ranks(_straddling_all_reduce, 2, numel, 0.5)
    assert [r["modeled"] for r in res] == [pytest.approx(1.0)] * 2, res
    assert res[0]["wire"] == pytest.approx(res[1]["wire"], abs=0.05), res
    assert res[0]["end"] == pytest.approx(res[1]["end"], abs=0.05), res
