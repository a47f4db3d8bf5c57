"""Checkpoints that reshard for the strategies whose workers keep state of their own (localsgd, diloco in all its
forms, demo, flexdemo) and those with a round in flight (acco, dpu, wp).

The policy (``quietsync.strategies.checkpoint.replicas``), checked here against an oracle written from its
statement on the saved workers' state, by name:

* at the same number of workers the logical path continues the uninterrupted run bit for bit (every replica
  is a survivor);
* on another number, a survivor (new replica i < old count) holds exactly what old replica i saved and — until
  the next synchronisation, which mixes in the new world — continues exactly as old worker i would have; a joiner
  holds θ_global (diloco) / the last averaged θ (localsgd) / the shared model (demo, flexdemo), the mean of the
  saved moments, and zero residual / decoupled momentum; a leaver's state is gone;
* acco/dpu/wp drain the round in flight: the new world holds exactly the old world's P, B, master, moments,
  counters and Σg̃ (the old workers' gradients), the drained job's per-worker counts folded.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks

from . import _replica_workers as w

pytestmark = pytest.mark.timeout(600)

WORKER_CASES = ["localsgd", "diloco", "diloco-sparseloco", "diloco-streaming", "demo"]
NODE_CASES = ["diloco-zero1", "diloco-ddp", "flexdemo"]
ROUND_CASES = ["acco", "dpu", "wp"]
MORE = 2
"""Steps after the checkpoint: the first is local for localsgd/diloco (sync_every 3, saved at step 4), the
second synchronises."""


def _numel() -> int:
    from . import _reshard_workers as base

    return sum(p.numel() for p in base.model(0).parameters())


def _save_and_load(tmp_path, case: str, old: tuple[int, int | None],
                   news: list[tuple[int, int | None]]) -> tuple[list[dict], list[list[dict]]]:
    """Train and save on ``old`` = (workers, nodes), load on each of ``news``; every worker's held state."""
    folder = str(tmp_path / "step")
    saved = run_ranks(w.train_and_save, old[0], case, folder, MORE, nodes=old[1], timeout=180)
    loads = [run_ranks(w.load_and_continue, n, case, folder, MORE, nodes=k, timeout=180) for n, k in news]
    for h in saved + [h for run in loads for h in run]:
        h["numel"] = _numel()
    return saved, loads


def _same_world_is_exact(saved: list[dict], loaded: list[dict]) -> None:
    for r, (s, h) in enumerate(zip(saved, loaded)):
        assert h["continued"]["losses"] == s["continued"]["losses"], r
        _equal(h["continued"]["held"], s["continued"]["held"], f"rank {r}")


def _equal(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), (where, set(a), set(b))
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)



# ---------------------------------------------------------------------------------------------- another world
def _mean(values: list[torch.Tensor]) -> torch.Tensor:
    """The oracle's mean of the saved replicas' values: theirs when they agree, else the fp64 mean."""
    if all(torch.equal(values[0], v) for v in values[1:]):
        return values[0]
    return (sum(v.double() for v in values) / len(values)).to(values[0].dtype)


def _close(a: torch.Tensor, b: torch.Tensor, where: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=where)


def _by_name_mean(states: list[dict[str, dict[str, torch.Tensor]]]) -> dict[str, dict[str, torch.Tensor]]:
    return {p: {k: _mean([s[p][k] for s in states]) for k in states[0][p]} for p in states[0]}


def _check_named_optim(got: dict, want: dict, where: str) -> None:
    assert set(got) == set(want), where
    for p in want:
        assert set(got[p]) == set(want[p]), (where, p)
        for k in want[p]:
            _close(got[p][k], want[p][k], f"{where} {p}.{k}")


def _flat(held: list[dict], key: str) -> torch.Tensor:
    """A sharded flat tensor of a group of workers, their pieces concatenated by offset, padding cut."""
    pieces = sorted((h["bounds"][0], h[key]) for h in held)
    numel = held[0].get("numel", None)
    flat = torch.cat([t for _, t in pieces])
    return flat if numel is None else flat[:numel]


def _node(held: list[dict], nodes: int, k: int) -> list[dict]:
    per = len(held) // nodes
    return held[k * per:(k + 1) * per]


def _check_worker_replicas(case: str, saved: list[dict], loaded: list[dict]) -> None:
    """localsgd, diloco (local), demo: replica = worker."""
    name = w.CASES[case][0]
    old = len(saved)
    for r, h in enumerate(loaded):
        where = f"{case} new rank {r}"
        assert h["steps"] == w.STEPS
        survivor = r < old
        if name == "localsgd":
            _equal(h["synced"], saved[0]["synced"], where)
            if survivor:
                _equal(h["params"], saved[r]["params"], where)
                _equal(h["optim"], saved[r]["optim"], where)
            else:  # a joiner starts from the last averaged θ
                _equal(h["params"], saved[0]["synced"], where)
                _check_named_optim(h["optim"], _by_name_mean([s["optim"] for s in saved]), where)
        elif name == "diloco":
            _equal(h["globals"], saved[0]["globals"], where)
            _equal(h["outer_momentum"], saved[0]["outer_momentum"], where)
            assert h["pending"] == saved[0]["pending"]
            if survivor:
                _equal(h["params"], saved[r]["params"], where)
                _equal(h["optim"], saved[r]["optim"], where)
                _equal(h["residuals"], saved[r]["residuals"], where)
            else:  # θ_global, the mean inner moments, no residual
                assert torch.equal(h["flat_params"], torch.cat(saved[0]["globals"])), where
                _check_named_optim(h["optim"], _by_name_mean([s["optim"] for s in saved]), where)
                assert all(not t.any() for t in h["residuals"]), where
        else:  # demo: the model is shared; δ is the worker's own
            _equal(h["params"], saved[0]["params"], where)
            assert h["decoupled_step"] == saved[0]["decoupled_step"]
            assert h["replicator"] == saved[0]["replicator"]
            if survivor:
                _equal(h["optim"], saved[r]["optim"], where)
            else:
                want = _by_name_mean([s["optim"] for s in saved])
                for p in want:
                    want[p]["delta"] = torch.zeros_like(want[p]["delta"])
                _check_named_optim(h["optim"], want, where)


@pytest.mark.parametrize("case", WORKER_CASES)
def test_worker_replicas_survive_join_and_leave_by_the_policy(tmp_path, case):
    """Saved on 2 workers; loaded on 2 (exact), 1 (worker 1 leaves) and 3 (worker 2 joins)."""
    saved, (same, fewer, more) = _save_and_load(tmp_path, case, (2, None), [(2, None), (1, None), (3, None)])
    _same_world_is_exact(saved, same)
    for loaded in (fewer, more):
        _check_worker_replicas(case, saved, loaded)
        if w.CASES[case][0] in ("localsgd", "diloco"):  # the step after the checkpoint is local (no sync)
            for r in range(min(len(saved), len(loaded))):  # a survivor continues as its old worker would have
                assert loaded[r]["continued"]["losses"][0] == saved[r]["continued"]["losses"][0], r
                _equal(loaded[r]["continued"]["first_params"], saved[r]["continued"]["first_params"], f"rank {r}")


def _rows_cat(workers: list[dict], key: str, param: str) -> torch.Tensor:
    """A flexdemo parameter's state of one node: its workers' row pieces in local-rank order."""
    return torch.cat([h[key][param] for h in workers])


def _check_node_replicas(case: str, saved: list[dict], loaded: list[dict], new_nodes: int) -> None:
    for k in range(new_nodes):
        node = _node(loaded, new_nodes, k)
        where = f"{case} new node {k}"
        survivor = k < 2
        old = _node(saved, 2, k) if survivor else None
        olds = [_node(saved, 2, q) for q in range(2)]
        for h in node:
            assert h["replica"] == k
        if case.startswith("diloco"):
            for h in node:
                _equal(h["globals"], saved[0]["globals"], where)
                _equal(h["outer_momentum"], saved[0]["outer_momentum"], where)
                if survivor:  # the node's own local θ
                    _equal(h["params"], old[0]["params"], where)
                else:  # θ_global
                    assert torch.equal(h["flat_params"], torch.cat(saved[0]["globals"])), where
            if case == "diloco-ddp":
                want = old[0]["optim"] if survivor else _by_name_mean([n[0]["optim"] for n in olds])
                for h in node:
                    _check_named_optim(h["optim"], want, where)
            else:
                got = _flat(node, "exp_avg")
                want = _flat(old, "exp_avg") if survivor else _mean([_flat(n, "exp_avg") for n in olds])
                _close(got, want, where)
                want_master = _flat(old, "master") if survivor else torch.cat(saved[0]["globals"])
                assert torch.equal(_flat(node, "master"), want_master), where
        else:  # flexdemo: the model is the same on every node; δ is the node's own
            for h in node:
                _equal(h["params"], saved[0]["params"], where)
                assert h["decoupled_step"] == saved[0]["decoupled_step"]
            for param in node[0]["delta"]:
                got = _rows_cat(node, "delta", param)
                want = _rows_cat(old, "delta", param) if survivor else torch.zeros_like(got)
                assert torch.equal(got, want), (where, param)
                got = _rows_cat(node, "exp_avg", param)
                want = _rows_cat(old, "exp_avg", param) if survivor else \
                    _mean([_rows_cat(n, "exp_avg", param) for n in olds])
                _close(got, want, f"{where} {param}")


@pytest.mark.parametrize("case", NODE_CASES)
def test_node_replicas_survive_join_and_leave_by_the_policy(tmp_path, case):
    """Saved on 2 nodes x 2 workers; loaded on 2 x 2 (exact), 3 nodes x 1 (a node joins, each keeps one worker)
    and 1 node x 2 (a node leaves)."""
    saved, (same, joined, left) = _save_and_load(tmp_path, case, (4, 2), [(4, 2), (3, 3), (2, 1)])
    _same_world_is_exact(saved, same)
    _check_node_replicas(case, saved, joined, 3)
    _check_node_replicas(case, saved, left, 1)


def _check_drained_round(case: str, saved: list[dict], loaded: list[dict]) -> None:
    new = len(loaded)
    for r, h in enumerate(loaded):
        where = f"{case} new rank {r}"
        assert h["steps"] == w.STEPS
        assert torch.equal(h["P"], saved[0]["P"]) and torch.equal(h["B"], saved[0]["B"]), where
        assert h["counters"] == saved[0]["counters"], where
        job = saved[0]["job"]
        folded = [sum(c for q, c in enumerate(job["counts"]) if q % new == i) for i in range(new)]
        assert h["job"] == {"kind": job["kind"], "counts": folded}, where
        if case == "acco":
            assert h["stage"] == saved[0]["stage"] and h["tilde_count"] == saved[0]["tilde_count"]
    for key in ["master", "exp_avg"] + (["tilde_sum"] if case == "acco" else []):
        assert torch.equal(_flat(loaded, key), _flat(saved, key)), (case, key)


@pytest.mark.parametrize("case", ROUND_CASES)
def test_a_round_in_flight_is_drained_and_carried_whole(tmp_path, case):
    """Saved on 2 workers; loaded on 2 (exact), 1 and 3: every new worker holds the old world's drained state."""
    saved, (same, fewer, more) = _save_and_load(tmp_path, case, (2, None), [(2, None), (1, None), (3, None)])
    _same_world_is_exact(saved, same)
    _check_drained_round(case, saved, fewer)
    _check_drained_round(case, saved, more)
    if case == "acco":
        for loaded in (fewer, more):
            want = _acco_first_commit_oracle(saved, len(loaded))
            for r, h in enumerate(loaded):
                for k, v in want.items():
                    _close(h["continued"]["first_params"][k], v, f"acco new rank {r} {k}")


def _acco_first_commit_oracle(saved: list[dict], new: int) -> dict[str, torch.Tensor]:
    """ACCO's first commit after a reshard, in one process with plain AdamW: from the saved θ and moments,
    θ ← AdamW(θ, (Σ_new g(θ) + Σ_old g̃) / (N_new + Ñ_old)), one micro-batch per new worker (deterministic mode),
    Σg̃ and Ñ the old workers' estimate stage as saved."""
    from . import _reshard_workers as base

    m = base.model(0)
    groups = base.groups(m)
    flat_params = [p for g in groups for p in g["params"]]
    sizes = [p.numel() for p in flat_params]
    theta, avg, sq, tilde = (_flat(saved, k).split(sizes) for k in ("master", "exp_avg", "exp_avg_sq", "tilde_sum"))
    opt = torch.optim.AdamW(groups, lr=base.LR * base.schedule(w.STEPS), betas=(0.9, 0.95))
    steps = [s for h in saved[:1] for s in h["opt_step"]]
    with torch.no_grad():
        for i, p in enumerate(flat_params):
            p.copy_(theta[i].view_as(p))
            group = 0 if any(p is q for q in groups[0]["params"]) else 1
            opt.state[p] = {"step": torch.tensor(steps[group]), "exp_avg": avg[i].view_as(p).clone(),
                            "exp_avg_sq": sq[i].view_as(p).clone()}
    total = sum(base.loss_fn(m, base.batch(1000 * w.STEPS, r)) for r in range(new))
    total.backward()
    with torch.no_grad():
        for i, p in enumerate(flat_params):
            p.grad.add_(tilde[i].view_as(p)).div_(new + saved[0]["tilde_count"])
    opt.step()
    return {n: p.detach() for n, p in m.named_parameters()}
