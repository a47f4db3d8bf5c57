"""``demo`` and ``flexdemo`` with compression against the fp64 oracle of paper 001 (``reference_demo.py``).

DeMo-SGD and decoupled AdamW with the DCT, random and striding replicators, several steps, on 2 workers
(``demo``) and on 2 nodes x 2 workers (``flexdemo``, both parameter substrates): the library's parameters after
every step and its decoupled momentum (for ``dct`` its DCT coefficients) equal the oracle's within what fp32
against fp64 allows. The oracle computes its own gradients in fp64 and knows nothing of the library but the
positions of ``random``, which it reads from the library's momentum (sent positions are exactly zero after
error feedback in fp32) and checks: the same on every member of a replicate group, the documented count,
stratified. Each comparison first checks the data leaves fp32 no room to pick another top-k coefficient or
flip a sign, and a wrong variant of the algorithm (no error feedback; the DCT mean over all workers instead of
over the senders) is far outside the tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch

import quietsync
from tests.distributed import run_ranks
from tests.strategies.helpers.common import param_groups
from tests.strategies.helpers.reference_demo import (
    Base,
    Blocking,
    DCTReference,
    DecoupledGroup,
    PositionsReference,
    is_stratified,
    ks_from_compression,
    striding_positions,
    values_count,
)

STEPS = 5
SGD = {"lr": 1e-2}
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
CASES = {
    "sgd-dct-sign": {"base": "sgd", "replicator": "dct", "chunk": 4, "topk": 3, "beta": 0.9},
    "sgd-dct-nosign": {"base": "sgd", "replicator": "dct", "chunk": 4, "topk": 2, "beta": 0.9, "sign": False},
    "sgd-dct-compression": {"base": "sgd", "replicator": "dct", "chunk": 4, "compression": 1 / 4, "beta": 0.9},
    "adamw-dct-nosign": {"base": "adamw", "replicator": "dct", "chunk": 4, "topk": 3, "beta": 0.9, "sign": False},
    "sgd-random-sign": {"base": "sgd", "replicator": "random", "compression": 1 / 4, "beta": 0.9, "seed": 7},
    "adamw-random-nosign": {"base": "adamw", "replicator": "random", "compression": 1 / 8, "beta": 0.8,
                            "sign": False},
    "sgd-striding-nosign": {"base": "sgd", "replicator": "striding", "compression": 1 / 4, "beta": 0.9,
                            "sign": False},
    "adamw-striding-sign": {"base": "adamw", "replicator": "striding", "compression": 1 / 4, "beta": 0.9},
}
THETA_ATOL = 1e-6
"""|θ_library − θ_oracle| over all steps: measured at most 1.2e-7 (fp32 rounding of θ ≈ 0.3 and of the momentum).
One step moves θ by lr = 1e-2 (sign) or ~1e-3, so a wrong selection, average or error feedback lands far outside:
each case checks that the oracle without error feedback (and, for dct, averaging over all workers instead of the
senders) is more than 100x the tolerance away (measured: 4.6e-4 to 8e-2)."""
MOMENTUM_ATOL = 5e-7
"""|δ_library − δ_oracle| (δ ~ lr·g ≈ 1e-2 for DeMo-SGD, g ≈ 1 for AdamW): fp32 rounding, measured at most 6e-8."""
MARGIN = 1e-5
"""Smallest relative top-k gap (k-th against k+1-th magnitude of a block) and smallest relative |Q| under a sign
the data must keep (measured: 2e-5 and 3e-5 at the least): fp32 rounding, ~1e-7 of a block's largest
coefficient, cannot then pick another coefficient or flip a sign -- else the comparison would not be fair."""


def oracle_model() -> torch.nn.Module:
    """An MLP whose every tensor and dim-0 half cuts into 4-blocks with no odd block and no block holding a single
    row or element (remainders 2 and 3 only, padding included): there an orthonormal DCT-II has coefficients of
    exactly equal magnitude (``D[0,0] = D[n/2,0]``) or exactly zero entries (odd sizes), and fp32 could settle a
    top-k tie or the sign of a zero otherwise than fp64. Every output is used: no gradient is zero by structure
    (but for the padding row the replicated substrate adds to the second half of the 15-row layer)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 12), torch.nn.Tanh(), torch.nn.Linear(12, 15))


def micro_batch(step: int, rank: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * rank)
    return torch.randn(size, 7, generator=g), torch.randn(size, 15, generator=g)


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _opt_params(strategy) -> list[torch.Tensor]:
    return [p for g in strategy.optimizer.param_groups for p in g["params"]]


def _train(rank: int, world: int, name: str, params: str | None) -> dict:
    """Every case for ``STEPS`` steps: the committed parameters and the decoupled momentum after each step."""
    out = {}
    for case, cfg in CASES.items():
        model = oracle_model()
        config = dict(cfg) if params is None else {**cfg, "params": params}
        opt = ADAMW if cfg["base"] == "adamw" else SGD
        strategy = quietsync.make_strategy(name, model, torch.optim.AdamW, param_groups=param_groups(model),
                                           config=config, **opt)
        steps = []
        for s in range(STEPS):
            strategy.backward(loss_fn(strategy.model, micro_batch(s, rank)))
            assert strategy.step()
            with strategy.committed_params() as m:
                theta = [p.detach().clone() for p in m.parameters()]
            delta = [strategy.optimizer.state[p]["delta"].detach().clone() for p in _opt_params(strategy)]
            steps.append({"theta": theta, "delta": delta})
        out[case] = {"steps": steps, "shapes": [tuple(p.shape) for p in _opt_params(strategy)]}
        strategy.close()
    return out


# ---------------------------------------------------------------------------------------------- the oracle's side
OPT_ORDER = [0, 2, 1, 3]  # the optimizer's order: the weights' group, then the biases' (common.param_groups)
WDS = [0.1, 0.1, 0.0, 0.0]


def _grads(theta: list[torch.Tensor], rank: int, step: int) -> list[torch.Tensor]:
    """fp64 gradients of worker ``rank``'s micro-batch at ``theta`` (model order)."""
    model = oracle_model().double()
    with torch.no_grad():
        for p, t in zip(model.parameters(), theta):
            p.copy_(t)
    x, y = micro_batch(step, rank)
    loss_fn(model, (x.double(), y.double())).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _shard_rows(rows: int, shards: int, j: int, padded: bool) -> tuple[slice, int]:
    """Rows of shard ``j`` along dim 0 (FSDP2's split: ceil(rows / shards) per shard) and the shard's row count
    (``padded``: every shard as long as the first, the missing rows zero)."""
    c = -(-rows // shards)
    lo, hi = min(j * c, rows), min((j + 1) * c, rows)
    return slice(lo, hi), (c if padded else hi - lo)


def _piece(t: torch.Tensor, rows: slice, length: int) -> torch.Tensor:
    out = torch.zeros((length, *t.shape[1:]), dtype=torch.float64)
    out[: rows.stop - rows.start] = t[rows]
    return out


def _replicator(cfg: dict, shapes: list[tuple[int, ...]], library_deltas: list[list[torch.Tensor]] | None,
                mean_over: str = "senders") -> DCTReference | PositionsReference:
    n = sum(math.prod(s) for s in shapes)
    if cfg["replicator"] == "dct":
        ks = [cfg["topk"]] * len(shapes) if "topk" in cfg else ks_from_compression(shapes, cfg["chunk"],
                                                                                   cfg["compression"])
        return DCTReference(shapes, cfg["chunk"], ks, mean_over=mean_over)
    m = values_count(n, cfg["compression"])
    if cfg["replicator"] == "striding":
        return PositionsReference(shapes, striding_positions(n, m))
    assert library_deltas is not None
    return PositionsReference(shapes, lambda t: library_deltas[t])


def _random_positions(per_member: list[list[list[torch.Tensor]]], n: int, m: int, exact: bool) -> list[torch.Tensor]:
    """Positions of each replication from the library's momentum of every member of one replicate group:
    sent positions are exactly 0 after error feedback. Checks they agree across members and, where no
    padding adds zeros of its own (``exact``), that there are ``m`` of them, stratified."""
    out = []
    for t in range(STEPS):
        zeros = [torch.cat([d.reshape(-1) for d in member[t]]).eq(0).nonzero().reshape(-1) for member in per_member]
        for z in zeros[1:]:
            assert torch.equal(z, zeros[0]), f"replication {t}: members sent different positions"
        if exact:
            assert zeros[0].numel() == m, (f"replication {t}: {zeros[0].numel()} momentum entries are exactly 0 "
                                           f"after error feedback, {m} values were to be sent")
            assert is_stratified(zeros[0], n, m), f"replication {t}: positions not one per stratum"
        else:
            assert zeros[0].numel() >= m
        out.append(zeros[0])
    assert not torch.equal(out[0], out[1])  # the counter moves the draw
    return out


def _oracle(results: list[dict], case: str, topology: str, **wrong) -> tuple[list, list, list]:
    """The oracle's θ (model order) after each step, its replicate groups with their members' ranks, and every
    member's momentum after each step (``[step][group][member][tensor]``, optimizer order).

    ``topology``: ``demo`` (one replicate group of the 2 workers), ``replicated`` / ``sharded`` (flexdemo, 2 nodes
    x 2 workers: group j holds shard j of every tensor, its members are the nodes; the node's gradient is the
    mean of its workers')."""
    cfg = CASES[case]
    theta = [p.detach().double() for p in oracle_model().parameters()]
    opt = ADAMW if cfg["base"] == "adamw" else SGD
    shards = 1 if topology == "demo" else 2
    padded = topology == "replicated"
    groups = []
    for j in range(shards):
        cuts = [_shard_rows(theta[i].shape[0], shards, j, padded) for i in OPT_ORDER]
        shapes = [(length, *theta[i].shape[1:]) for i, (_, length) in zip(OPT_ORDER, cuts)]
        # demo: the 2 workers; flexdemo: the worker holding shard j on each node (node k holds ranks 2k, 2k+1)
        members = [0, 1] if topology == "demo" else [2 * node + j for node in range(2)]
        lib = [[results[r][case]["steps"][t]["delta"] for t in range(STEPS)] for r in members]
        assert [tuple(s) for s in results[members[0]][case]["shapes"]] == shapes
        positions = None
        if cfg["replicator"] == "random":
            n = sum(math.prod(s) for s in shapes)
            positions = _random_positions(lib, n, values_count(n, cfg["compression"]), exact=not padded)
        base = Base(cfg["base"], opt["lr"], WDS, cfg.get("sign", True), betas=opt.get("betas", (0.9, 0.999)),
                    eps=opt.get("eps", 1e-8))
        rep = _replicator(cfg, shapes, positions, mean_over=wrong.get("mean_over", "senders"))
        group = DecoupledGroup([_piece(theta[i], rows, length) for i, (rows, length) in zip(OPT_ORDER, cuts)], 2,
                               rep, base, cfg["beta"], error_feedback=wrong.get("error_feedback", True))
        groups.append((group, cuts, members))
    trajectory, momenta = [], []
    for s in range(STEPS):
        ranks = [0, 1] if topology == "demo" else [0, 1, 2, 3]
        grads = {r: _grads(theta, r, s) for r in ranks}
        for group, cuts, members in groups:
            if topology == "demo":
                per_member = [[grads[r][i] for i in OPT_ORDER] for r in members]
            else:  # member = node; its gradient = the mean of its two workers'
                per_member = [[_piece((grads[2 * node][i] + grads[2 * node + 1][i]) / 2, rows, length)
                               for i, (rows, length) in zip(OPT_ORDER, cuts)] for node in range(2)]
            group.step(per_member)
        new = [t.clone() for t in theta]
        for group, cuts, _ in groups:
            for k, (i, (rows, _)) in enumerate(zip(OPT_ORDER, cuts)):
                new[i][rows] = group.theta[k][: rows.stop - rows.start]
        theta = new
        trajectory.append(theta)
        momenta.append([[[d.clone() for d in member] for member in g.deltas] for g, _, _ in groups])
    return trajectory, [(g, m) for g, _, m in groups], momenta


def _max_theta_diff(results: list[dict], case: str, trajectory: list[list[torch.Tensor]]) -> float:
    worst = 0.0
    for r in range(len(results)):
        for s in range(STEPS):
            for lib, ref in zip(results[r][case]["steps"][s]["theta"], trajectory[s]):
                worst = max(worst, float((lib.double() - ref).abs().max()))
    return worst


def _check(results: list[dict], topology: str, case: str) -> None:
    cfg = CASES[case]
    trajectory, groups, momenta = _oracle(results, case, topology)
    for group, _ in groups:
        assert group.margins.topk_gap > MARGIN and group.margins.sign > MARGIN, (case, group.margins)
    diff = _max_theta_diff(results, case, trajectory)
    assert diff < THETA_ATOL, f"{topology} {case}: θ differs from the fp64 oracle by {diff:.3g}"
    # the momentum each member keeps: spatial for random / striding, the DCT coefficients of every block for dct
    for gi, (group, members) in enumerate(groups):
        for s in range(STEPS):
            for k, r in enumerate(members):
                for t, (lib, ref) in enumerate(zip(results[r][case]["steps"][s]["delta"], momenta[s][gi][k])):
                    if cfg["replicator"] == "dct":  # (blocks, *block) per tensor, blocks row-major over the grid
                        ref = Blocking(tuple(group.replicator.shapes[t]), cfg["chunk"]).encode(ref)
                    torch.testing.assert_close(lib.double().reshape(-1), ref.reshape(-1), rtol=0,
                                               atol=MOMENTUM_ATOL,
                                               msg=lambda m, s=s: f"{topology} {case} δ step {s}: {m}")
    # the tolerance tells a wrong algorithm apart
    wrongs = [{"error_feedback": False}] + ([{"mean_over": "all"}] if cfg["replicator"] == "dct" else [])
    for wrong in wrongs:
        bad = _max_theta_diff(results, case, _oracle(results, case, topology, **wrong)[0])
        assert bad > 100 * THETA_ATOL, f"{topology} {case}: {wrong} is only {bad:.3g} away"


@pytest.mark.timeout(240)
def test_demo_two_workers_equals_the_fp64_oracle():
    results = run_ranks(_train, 2, "demo", None, timeout=200)
    for case in CASES:
        _check(results, "demo", case)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("params", ["replicated", "sharded"])
def test_flexdemo_two_nodes_of_two_equals_the_fp64_oracle(params):
    results = run_ranks(_train, 4, "flexdemo", params, nodes=2, timeout=260)
    for case in CASES:
        _check(results, params, case)
