"""The planner's schedules against the transport's meter: for every strategy and its main knob settings, the
bytes per step per group the schedule predicts equal what ``strategy.last_step_metrics().bytes_by_group``
reports on real gloo runs (2 workers as 2 nodes, and 2 nodes × 2 workers), and the memory per worker equals
``memory_report()``.

The prediction comes from shapes alone (:class:`quietsync.cost.workload.Workload` of the model) and the
schedule functions; the measurement from the transport. The model has awkward sizes (dims not multiples of the
worker count or of DeMo's DCT chunk), so padding is exercised everywhere.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import quietsync  # noqa: E402
from quietsync.cost.workload import Workload  # noqa: E402
from quietsync.plan.schedules import schedule  # noqa: E402
from quietsync.topology import Topology  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402

VOCAB, SEQ, BATCH = 61, 8, 2
STEPS = 4


def _model() -> torch.nn.Module:
    from quietsync.models import ModelPreset, build_model

    return build_model(ModelPreset(hidden_size=24, num_layers=2, num_heads=2, max_positions=16), VOCAB, seed=0)


def _groups(model: torch.nn.Module) -> list[dict]:
    from quietsync.models import param_groups

    return param_groups(model, 0.1)


def _loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


# (strategy, config, steps run, compare): "step" = every step equal; "total" = the sums over the run equal
# (transfers on the communication worker land in whichever step's window they complete in); "after<k>" skips the
# first k steps: cdp's first (its pipeline fills: the first cycle's sends are metered later), PowerSGD's plain
# warm-up.
BOTH = [
    ("ddp", {}, STEPS, "step"),
    ("ddp", {"accumulation": 2, "bucket_cap_mb": 0.01}, STEPS, "step"),
    ("zero1", {}, STEPS, "step"),
    ("zero1", {"reduce_dtype": "bfloat16", "accumulation": 2}, STEPS, "step"),
    ("acco", {"deterministic_accumulation": 1}, STEPS, "step"),
    ("acco", {}, STEPS, "step"),
    ("dpu", {"deterministic_accumulation": 2}, STEPS, "step"),
    ("dpu", {"sync_warmup_steps": 2, "reduce_dtype": "bfloat16"}, STEPS, "step"),
    ("wp", {"deterministic_accumulation": 1}, STEPS, "step"),
    ("demo", {}, STEPS, "step"),
    ("demo", {"replicator": "random", "compression": 1 / 16, "transfer_dtype": "bf16"}, STEPS, "step"),
    ("demo", {"replicator": "striding", "replicate_every": 2}, STEPS, "step"),
    ("demo", {"replicator": "full", "base": "adamw"}, STEPS, "step"),
    ("demo", {"replicator": "dct", "topk": 3, "chunk": 16, "skip_every": 3}, STEPS + 2, "step"),
    ("flexdemo", {}, STEPS, "step"),
    ("flexdemo", {"params": "replicated", "replicator": "random", "base": "adamw"}, STEPS, "step"),
    ("fsdp", {}, STEPS, "step"),
    ("fsdp", {"accumulation": 2}, STEPS, "step"),
    ("localsgd", {"sync_every": 2}, STEPS, "step"),
    ("localsgd", {"sync_every": 3, "average_optimizer_state": True}, 6, "step"),
    ("diloco", {"sync_every": 2}, STEPS, "step"),
    ("diloco", {"sync_every": 4, "fragments": 2, "pseudo_grad_dtype": "bf16"}, 8, "step"),
    ("diloco", {"sync_every": 4, "fragments": 2, "overlap_delay": 1}, 5, "total"),
    ("diloco", {"sync_every": 2, "pseudo_grad_dtype": "int8"}, STEPS, "step"),
    ("diloco", {"sync_every": 2, "pseudo_grad_replicator": "random", "compression": 0.25}, STEPS, "step"),
    ("diloco", {"sync_every": 2, "pseudo_grad_replicator": "dct", "compression": 0.25}, STEPS, "step"),
    # issue 22: fewer bits
    ("ddp", {"comm_hook": "powersgd", "powersgd_rank": 2, "powersgd_start_iter": 2}, STEPS, "after2"),
    ("ddp", {"comm_hook": "bf16", "bucket_cap_mb": 0.01}, STEPS, "step"),
    ("demo", {"replicator": "dct", "transfer_dtype": "fp4"}, STEPS, "step"),
    ("diloco", {"sync_every": 2, "pseudo_grad_dtype": "fp4"}, STEPS, "step"),
    ("diloco", {"sync_every": 2, "outer": "sparseloco", "pseudo_grad_dtype": "int2", "topk_chunk": 64,
                "topk_density": 0.1}, STEPS, "step"),
    ("diloco", {"sync_every": 4, "fragments": 2, "fragment_pattern": "strided", "pseudo_grad_dtype": "int4",
                "pseudo_grad_error_feedback": True}, 8, "step"),
    ("diloco", {"sync_every": 2, "pseudo_grad_replicator": "random", "compression": 0.25, "pseudo_grad_dtype": "int4"},
     STEPS, "step"),
]
HIERARCHICAL = [
    ("diloco", {"sync_every": 2, "inner": "ddp"}, STEPS, "step"),
    ("diloco", {"sync_every": 2, "inner": "zero1"}, STEPS, "step"),
]
CDP2 = [("cdp", {}, 5, "after1"), ("cdp", {"rule": "v1"}, 5, "after1")]
CDP4 = [("cdp", {}, 5, "after1")]


def _run(rank: int, world: int, cases: list) -> list[dict]:
    transport = quietsync.Transport()
    out = []
    g = torch.Generator().manual_seed(rank)
    try:
        for name, cfg, steps, _ in cases:
            model = _model()
            # cdp leaves its last time step's sends unreceived: it gets a transport (process groups) of its own
            s = quietsync.make_strategy(name, model, torch.optim.AdamW, param_groups=_groups(model),
                                        transport=None if name == "cdp" else transport, config=dict(cfg), lr=1e-3)
            per_step = []
            while s.steps < steps:
                s.forward_backward(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), _loss)
                if s.step():
                    per_step.append(s.last_step_metrics().bytes_by_group)
            memory = s.memory_report()
            s.close()
            out.append({"per_step": per_step, "memory": memory})
    finally:
        transport.close()
    return out


def _predicted(name: str, cfg: dict, topo: Topology, steps: int) -> tuple[list[dict], dict]:
    model = _model()
    w = Workload.from_model(model, tokens_per_micro_batch=BATCH * SEQ, param_groups=_groups(model),
                            stages=(topo.world_size,))
    sched = schedule(name, w, topo, cfg)
    return [sched.bytes_at(k, topo) for k in range(1, steps + 1)], sched.memory


def _nonzero(by_group: dict) -> dict:
    return {g: {"sent": int(v["sent"]), "recv": int(v["recv"])} for g, v in by_group.items()
            if v["sent"] or v["recv"]}


def _total(per_step: list[dict]) -> dict:
    out: dict = {}
    for by_group in per_step:
        for g, v in by_group.items():
            t = out.setdefault(g, {"sent": 0, "recv": 0})
            t["sent"] += v["sent"]
            t["recv"] += v["recv"]
    return _nonzero(out)


def _check(cases: list, results: list, world: int, nodes: int) -> None:
    for rank, per_rank in enumerate(results):
        topo = Topology(rank, world, nodes)
        for (name, cfg, steps, compare), got in zip(cases, per_rank):
            want, memory = _predicted(name, cfg, topo, steps)
            what = f"{name} {cfg} rank {rank} of {world} on {nodes} node(s)"
            measured = [_nonzero(b) for b in got["per_step"]]
            assert len(measured) == steps, what
            if compare == "step":
                assert measured == [_nonzero(b) for b in want], what
            elif compare == "total":
                assert _total(got["per_step"]) == _total(want), what
            else:  # after the first k steps ("after<k>": a pipeline filling, PowerSGD's plain warm-up)
                k = int(compare[len("after"):])
                assert measured[k:] == [_nonzero(b) for b in want[k:]], what
            report = {k: v for k, v in got["memory"].items() if k != "gradient_partials"}
            assert {k: memory[k] for k in report} == report, what


@pytest.mark.timeout(600)
def test_two_workers_on_two_nodes_every_strategy_bytes_and_memory_equal_the_meter():
    cases = BOTH + CDP2
    results = run_ranks(_run, 2, cases, nodes=2, timeout=540)
    _check(cases, results, 2, 2)


@pytest.mark.long
@pytest.mark.timeout(600)
def test_two_nodes_of_two_workers_every_strategy_bytes_and_memory_equal_the_meter():
    cases = BOTH + HIERARCHICAL + CDP4
    results = run_ranks(_run, 4, cases, nodes=2, timeout=540)
    _check(cases, results, 4, 2)


def test_every_strategy_has_its_schedule_beside_it():
    """Each family's ``cost.py`` holds the schedules of that family's strategies (so the model cannot drift from
    the code unseen: the tests above hold them to the meter)."""
    from quietsync.plan.schedules import schedules
    from quietsync.strategies.registry import available, get
    from tests.strategies.test_contract import FAMILIES

    table = schedules()
    shipped = {n for names in FAMILIES.values() for n in names}
    assert shipped <= set(available()) and shipped <= set(table)
    for name in shipped:
        family = get(name)[0].__module__.split(".")[2]
        assert table[name].__module__ == f"quietsync.strategies.{family}.cost", name
    covered = {c[0] for c in BOTH + HIERARCHICAL + CDP2 + CDP4}
    assert covered == shipped  # every shipped strategy is checked against the meter above
