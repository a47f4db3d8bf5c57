"""diloco --adapt of the pseudo-gradient bits (adapt_knobs bits / H,bits): a link that drops lowers the bits before
it lengthens the round (the cost model's bytes per sync against the budget); the error-feedback residual carries
across every change of dtype (what is sent plus what is still owed equals every pseudo-gradient so far); a run that
adapts to the dtype it has is the static run bit for bit; a run stopped right after a change and resumed equals the
unbroken one; each change is logged; bad knobs are refused in one line."""

from __future__ import annotations

import io
import math

import pytest
import torch

from quietsync.cost.workload import Workload
from quietsync.strategies.local.adapt import SyncPeriod, pick_sync_every
from quietsync.strategies.local.diloco import DiLoCoConfig
from quietsync.topology import Topology
from quietsync.train.plots import knob_changes
from tests.distributed import run_ranks
from tests.strategies.helpers.common import flat_params, loss_fn, micro_batch, param_groups, tiny_model
from tests.strategies.helpers.probe_fakes import FakeTransport
from tests.strategies.local.test_adapt import PSI, _build, _Stream


# ---------------------------------------------------------------------------------------------- the decision
def _sync_bytes(dtype: str) -> float:
    """By hand, what one worker sends per sync of the tiny model's one fragment on 2 workers: fp32 and bf16 are
    all-reduced (a ring on 2 workers sends the buffer once: 4Ψ or 2Ψ bytes); fp4 and int2 are all-gathered (the
    other worker's payload once): Ψ·bits/8 bytes of codes plus a bf16 scale per 64 values."""
    if dtype in ("fp32", "bf16"):
        return {"fp32": 4, "bf16": 2}[dtype] * PSI
    bits = {"fp4": 4, "int2": 2}[dtype]
    return math.ceil(PSI * bits / 8) + 2 * math.ceil(PSI / 64)


def _expected(hs, dtypes, bandwidth, step_s, overhead):
    """The smallest H, then the most bits, whose sync (bytes / bandwidth, spread over H steps) adds at most
    ``overhead`` of the compute; else the largest H with the fewest bits."""
    for h in hs:
        for d in dtypes:
            if _sync_bytes(d) / bandwidth / (h * step_s) <= overhead:
                return h, d
    return hs[-1], dtypes[-1]


def test_a_link_that_drops_lowers_the_bits_before_it_lengthens_the_round():
    model = tiny_model()
    workload = Workload.from_model(model, tokens_per_micro_batch=1, param_groups=param_groups(model))
    topo = Topology(0, 2, 2)
    cfg = DiLoCoConfig(sync_every=8, adapt=True, adapt_knobs="H,bits", adapt_sync_every="8,16,32,64",
                       adapt_pseudo_grad_dtype="fp32,bf16,fp4,int2")
    hs, dtypes, step_s = (8, 16, 32, 64), ("fp32", "bf16", "fp4", "int2"), 1e-3
    seen = []
    for mbit in (100, 5, 2, 0.4, 0.1, 0.01):
        bw = mbit * 1e6 / 8
        d = pick_sync_every(workload, topo, cfg, hs, 8, step_s, bw, 0.1, "world", dtypes, "fp32")
        assert (d.new, d.new_dtype) == _expected(hs, dtypes, bw, step_s, 0.1), mbit
        assert d.share == pytest.approx(_sync_bytes(d.new_dtype) / bw / (d.new * step_s), rel=1e-9)
        seen.append((d.new, d.new_dtype))
    # 100 Mbit/s: fp32 at H=8; the drop first takes bits away at H=8, then lengthens the round
    assert seen[:3] == [(8, "fp32"), (8, "bf16"), (8, "fp4")] and seen[3][0] > 8
    assert seen[-1] == (64, "int2")
    # the bits alone (H fixed): the most bits that fit, else the fewest
    only = DiLoCoConfig(sync_every=8, adapt=True, adapt_knobs="bits", adapt_pseudo_grad_dtype="fp32,bf16,fp4,int2")
    assert only.adapt_candidates(8, 1, 0) == (8,)
    for mbit in (100, 5, 0.1):
        bw = mbit * 1e6 / 8
        d = pick_sync_every(workload, topo, only, (8,), 8, step_s, bw, 0.1, "world", dtypes, "fp32")
        assert (d.new, d.new_dtype) == _expected((8,), dtypes, bw, step_s, 0.1)
    assert d.new_dtype == "int2" and "nothing keeps the sync under 10%" in d.why


class _Switch:
    current = ""


def test_the_controller_logs_each_change_of_bits_with_step_old_new_and_why():
    model = tiny_model()
    cfg = DiLoCoConfig(sync_every=8, adapt=True, adapt_knobs="bits", adapt_window=8,
                       adapt_pseudo_grad_dtype="fp32,fp4,int2")
    transport = FakeTransport()
    ctrl = SyncPeriod(transport, "world", cfg, model, param_groups(model))
    waited = []
    switches = [_Switch(), _Switch()]
    ctrl.bind(switches, lambda: waited.append(1))
    step, step_s = 0, 1e-3

    def round_at(bandwidth: float, nbytes: float):
        nonlocal step
        decision = None
        for _ in range(8):
            step += 1
            synced = step % 8 == 0
            if synced:
                transport.meter.sent += nbytes
                transport.meter.seconds += nbytes / bandwidth
            decision = ctrl.after_inner_step(step, synced, step_s) or decision
        return decision

    assert round_at(100e6 / 8, 4 * PSI) is None  # the first pick keeps fp32: it fits at 100 Mbit/s
    d = round_at(5e6 / 8, 4 * PSI)  # 5 Mbit/s: fp32 adds 11%, fp4 2%
    assert d is not None and (d.old_dtype, d.new_dtype) == ("fp32", "fp4") and d.new == d.old == 8
    rec = d.record(step)
    assert rec["knob"] == "pseudo_grad_dtype" and (rec["old"], rec["new"], rec["step"]) == ("fp32", "fp4", 16)
    assert "Mbit/s" in rec["why"]
    assert cfg.pseudo_grad_dtype == "fp4" and [s.current for s in switches] == ["fp4", "fp4"] and waited
    d = round_at(100e6 / 8, _sync_bytes("fp4"))  # recovers: back to fp32
    assert (d.old_dtype, d.new_dtype) == ("fp4", "fp32")
    assert [x["new"] for x in ctrl.decisions] == ["fp32", "fp4", "fp32"]


# ---------------------------------------------------------------------------------------------- the residual
class _OneWorker:
    """A transport of one worker (what the exchanges ask of one): the mean over the group is the worker's own."""

    class meter:  # noqa: N801 - what Dense reads
        @staticmethod
        def snapshot():
            return {}

    def group_size(self, group: str) -> int:
        return 1

    def group_rank(self, group: str) -> int:
        return 0

    def all_gather(self, out, x, group, name=""):
        out.copy_(x)

    def all_reduce(self, x, group="world", name="", op="sum"):
        return None


def test_the_residual_carries_across_every_change_of_bits():
    """Error feedback's conservation across changes: after each sync, everything sent so far plus what is still
    owed is every pseudo-gradient so far; a low-bit dtype continues from what the one before it owed, a dense one
    sends it all and owes nothing, the next low-bit one starts from nothing."""
    from quietsync.strategies.local.exchange import fragment_exchange
    from quietsync.wire.replicators import Segments

    cfg = DiLoCoConfig(sync_every=2, pseudo_grad_dtype="fp4", pseudo_grad_error_feedback=True, adapt=True,
                       adapt_knobs="bits", adapt_pseudo_grad_dtype="fp32,fp4,int2")
    e = fragment_exchange(cfg, 0, Segments([torch.Size([300])]), _OneWorker(), "world", torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    sent_total, delta_total = torch.zeros(300), torch.zeros(300)
    for dtype in ("fp4", "int2", "int2", "fp4", "fp32", "fp4", "int2"):
        e.current = dtype
        before = e.residual.clone()
        x = torch.randn(300, generator=g)
        out = e.average(x)
        sent_total += out
        delta_total += x
        torch.testing.assert_close(sent_total + e.residual, delta_total, rtol=0, atol=1e-5)
        if dtype == "fp32":  # sends Δ + what was owed, exactly, and owes nothing after
            assert torch.equal(out, x + before) and not e.residual.any()
        else:  # a low-bit sync: it quantized Δ + what was owed (not Δ alone), and owes the rounding's rest
            assert e.residual.any() and not torch.equal(out, x)
    # one buffer: every low-bit codec's error feedback works on it
    assert all(x.feedback.residual is e.residual for d, x in e.exchanges.items() if d != "fp32")


# ---------------------------------------------------------------------------------------------- real processes
def _run(rank: int, config: dict, steps: int, change: tuple[int, str] | None = None,
         resume_at: int | None = None, logical: str | None = None) -> dict:
    """``steps`` inner steps on 2 workers; ``change = (s, dtype)``: the bits set right after step s (as a decision
    there would); ``resume_at``: checkpoint after that step and go on in a fresh strategy built with the original
    config (the rank's ``state_dict``, or with ``logical`` the world-size-independent checkpoint)."""
    from quietsync.train.logical_checkpoint import load_logical, save_logical

    s = _build(dict(config))
    trace = []
    for t in range(1, steps + 1):
        s.forward_backward(micro_batch(t - 1, rank, 0), loss_fn)
        assert s.step()
        m = s.last_step_metrics()
        if change is not None and change[0] == t:
            s.adapter.set_dtype(change[1], t)
        trace.append({"synced": m.extra["synced"], "bytes": m.extra["sync_bytes"], "params": flat_params(s.module)})
        if resume_at == t and logical is not None:
            save_logical(logical, s, _Stream(), 0)
            s.close()
            s = _build(dict(config))
            load_logical(logical, s, _Stream())
        elif resume_at == t:
            buf = io.BytesIO()
            torch.save(s.state_dict(), buf)
            s.close()
            s = _build(dict(config))
            buf.seek(0)
            s.load_state_dict(torch.load(buf, weights_only=False))
    out = {"trace": trace, "dtype": s.config.pseudo_grad_dtype,
           "decisions": list(s.adapter.decisions) if s.adapter else []}
    s.close()
    return out


def _jobs(rank: int, world: int, jobs: list[dict]) -> list[dict]:
    return [_run(rank, **job) for job in jobs]


@pytest.mark.timeout(300)
def test_adapting_the_bits_is_exact_where_static_and_resumes_after_a_change(tmp_path):
    keep = {"adapt": True, "adapt_knobs": "bits", "adapt_overhead": 1e9, "adapt_threshold": 0.0}
    static_fp4 = {"sync_every": 2, "pseudo_grad_dtype": "fp4", "pseudo_grad_error_feedback": True}
    forced = {**static_fp4, **keep, "adapt_pseudo_grad_dtype": "fp32,fp4,int2", "adapt_every": 1000}
    jobs = [
        {"config": {"sync_every": 2}, "steps": 6},
        # decides after every sync; any dtype fits the budget: it keeps the most bits, fp32
        {"config": {"sync_every": 2, **keep, "adapt_pseudo_grad_dtype": "fp32,fp4"}, "steps": 6},
        {"config": static_fp4, "steps": 6},
        # fp4 with error feedback among fp4 and int2: it keeps fp4 (the residual of the one shared buffer)
        {"config": {**static_fp4, **keep, "adapt_pseudo_grad_dtype": "fp4,int2"}, "steps": 6},
        # fp4 -> int2 right after step 4, then -> fp32 after step 6 is not asked here: one change, resumed after it
        {"config": forced, "steps": 9, "change": (4, "int2")},
        {"config": forced, "steps": 9, "change": (4, "int2"), "resume_at": 5},
        {"config": forced, "steps": 9, "change": (4, "int2"), "resume_at": 4, "logical": str(tmp_path / "lg")},
        # a change to fp32 (the residual sent at once), resumed right after it
        {"config": forced, "steps": 9, "change": (4, "fp32")},
        {"config": forced, "steps": 9, "change": (4, "fp32"), "resume_at": 4},
    ]
    results = run_ranks(_jobs, 2, jobs, timeout=280)
    for res in results:
        fp32, kept32, fp4, kept4, changed, resumed, resumed_logical, dense, dense_resumed = res
        for static, kept in ((fp32, kept32), (fp4, kept4)):  # adapt to the same dtype = the static run, bit for bit
            assert len(kept["decisions"]) == 3 and kept["decisions"][0]["knob"] == "pseudo_grad_dtype"
            assert all(d["old"] == d["new"] == static["dtype"] for d in kept["decisions"])
            for a, b in zip(static["trace"], kept["trace"]):
                assert torch.equal(a["params"], b["params"]) and a["bytes"] == b["bytes"]
        # the change took: syncs after step 4 carry int2's bytes (fewer than fp4's), and the params moved apart
        assert changed["trace"][5]["bytes"] < changed["trace"][3]["bytes"] == fp4["trace"][3]["bytes"]
        assert not torch.equal(changed["trace"][5]["params"], fp4["trace"][5]["params"])
        assert dense["trace"][5]["bytes"] == fp32["trace"][5]["bytes"]
        # resumed right after the change = unbroken, bit for bit (the dtype and the residual came back)
        for unbroken, again in ((changed, resumed), (changed, resumed_logical), (dense, dense_resumed)):
            assert again["dtype"] == unbroken["dtype"]
            for a, b in zip(unbroken["trace"], again["trace"]):
                assert a["bytes"] == b["bytes"] and torch.equal(a["params"], b["params"])


def test_a_change_of_bits_is_drawn_as_a_knob_change(tmp_path):
    import json
    rec = {"step": 16, "knob": "pseudo_grad_dtype", "old": "fp32", "new": "fp4", "why": "5 Mbit/s"}
    (tmp_path / "metrics-rank0.jsonl").write_text(json.dumps({"step": 16, "extra": {"adapt": rec}}) + "\n")
    assert knob_changes(tmp_path) == [rec]


@pytest.mark.parametrize("knobs,match", [
    ({"adapt_knobs": "H,x"}, "adapt_knobs must be a comma-separated list of H, bits"),
    ({"adapt_knobs": "bits", "adapt_pseudo_grad_dtype": "fp32,fp8"}, "adapt_pseudo_grad_dtype must be dtypes among"),
    ({"adapt_knobs": "bits", "adapt_pseudo_grad_dtype": "fp4,fp32"}, "most bits first"),
    ({"adapt_knobs": "bits", "adapt_pseudo_grad_dtype": "bf16,fp4"}, "must include pseudo_grad_dtype"),
    ({"adapt_knobs": "bits", "pseudo_grad_replicator": "dct"}, "adapt_knobs bits needs pseudo_grad_replicator none"),
    ({"adapt_knobs": "bits", "outer": "sparseloco"}, "adapt_knobs bits needs outer sgd"),
    ({"adapt_knobs": "bits", "fragments": 2}, "fragments 1"),
])
def test_bad_bits_knobs(knobs, match):
    with pytest.raises(ValueError, match=match):
        DiLoCoConfig(sync_every=8, adapt=True, **knobs)


@pytest.mark.timeout(240)
def test_a_change_of_bits_with_a_fragment_in_flight_waits_for_it_and_resumes_exactly():
    """τ = 1: the change right after a launch waits for that exchange (it ends in the old dtype); the next sync is
    in the new one; checkpointed right after the change, the run goes on as the unbroken one."""
    forced = {"sync_every": 2, "overlap_delay": 1, "pseudo_grad_dtype": "fp4", "pseudo_grad_error_feedback": True,
              "adapt": True, "adapt_knobs": "bits", "adapt_pseudo_grad_dtype": "fp4,int2", "adapt_every": 1000}
    static = {k: v for k, v in forced.items() if not k.startswith("adapt")}
    jobs = [{"config": static, "steps": 8}, {"config": forced, "steps": 8, "change": (4, "int2")},
            {"config": forced, "steps": 8, "change": (4, "int2"), "resume_at": 4}]
    for fp4, changed, resumed in run_ranks(_jobs, 2, jobs, timeout=220):
        assert [x["bytes"] for x in changed["trace"][:4]] == [x["bytes"] for x in fp4["trace"][:4]]
        for a, b in zip(fp4["trace"][:4], changed["trace"][:4]):  # up to the change: the static run
            assert torch.equal(a["params"], b["params"])
        assert 0 < changed["trace"][5]["bytes"] < fp4["trace"][5]["bytes"]
        for a, b in zip(changed["trace"], resumed["trace"]):
            assert a["bytes"] == b["bytes"] and torch.equal(a["params"], b["params"])
