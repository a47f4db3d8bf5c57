"""Single-process reference recurrences of Local SGD and (Streaming, hierarchical) DiLoCo, written from the
equations (docs/local.md) with plain torch — nothing here calls quietsync.

Replicas: ``nodes`` model copies; replica k's gradient at inner step s is the mean over its workers
``r = k·W .. k·W + W − 1`` (W = world/nodes, node-major as torchrun lays ranks out) and their ``accumulation``
micro-batches ``micro_batch(s, r, a)`` — i.e. synchronous data parallelism inside a node; with ``nodes = world``
each worker is its own replica.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch

from tests.strategies.helpers.common import flat_params, loss_fn, micro_batch, param_groups, tiny_model


def _replicas(nodes: int, make_opt: Callable) -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer]]:
    base = tiny_model()
    models = [copy.deepcopy(base) for _ in range(nodes)]
    return models, [make_opt(param_groups(m)) for m in models]


def _inner_step(model: torch.nn.Module, opt: torch.optim.Optimizer, s: int, ranks: range, accumulation: int) -> None:
    opt.zero_grad()
    total = sum(loss_fn(model, micro_batch(s, r, a)) for r in ranks for a in range(accumulation))
    (total / (len(ranks) * accumulation)).backward()
    opt.step()


def reference_localsgd(world: int, sync_every: int, steps: int, make_opt: Callable, accumulation: int = 1,
                       average_state: bool = False) -> list[torch.Tensor]:
    """Each worker: θ_i ← Opt_i(θ_i, g_i); after every K-th step θ_i ← mean_j θ_j (and the moments, if asked).
    Returns every worker's flat parameters after ``steps``."""
    models, opts = _replicas(world, make_opt)
    for s in range(steps):
        for i in range(world):
            _inner_step(models[i], opts[i], s, range(i, i + 1), accumulation)
        if (s + 1) % sync_every == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in models)):
                    mean = torch.stack([p for p in ps]).mean(0)
                    for p in ps:
                        p.copy_(mean)
                if average_state:
                    for ps in zip(*(m.parameters() for m in models)):
                        states = [o.state[p] for o, p in zip(opts, ps)]
                        for key in states[0]:
                            if states[0][key].dim() > 0:
                                mean = torch.stack([st[key] for st in states]).mean(0)
                                for st in states:
                                    st[key].copy_(mean)
    return [flat_params(m) for m in models]


def _group_order(model: torch.nn.Module) -> list[int]:
    """Indices (into ``model.parameters()``) in the order of :func:`param_groups`: the weights, then the biases --
    how a strategy concatenates a fragment's pseudo-gradient into one buffer."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return [index[id(p)] for g in param_groups(model) for p in g["params"]]


def reference_diloco(world: int, nodes: int, sync_every: int, steps: int, make_opt: Callable, *,
                     outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                     fragments: list[list[int]] | None = None, delay: int = 0, alpha: float = 0.5,
                     accumulation: int = 1, record: dict | None = None,
                     average: Callable[[int, list[torch.Tensor]], torch.Tensor] | None = None,
                     finish: bool | None = None) -> list[torch.Tensor]:
    """DiLoCo with staggered fragments and delayed merge; returns every replica's flat parameters.

    Fragment f (a list of parameter indices) launches after inner step s (1-based) when
    ``s mod H == ((f+1)·H/F) mod H``: Δ = mean_k(θ_g − θ_k); b ← μ·b + Δ (b = Δ the first time);
    θ_g ← θ_g − lr·(Δ + μ·b if Nesterov else b); merged after step s + τ: θ_k ← θ_g if τ = 0 else
    α·θ_k + (1−α)·θ_g. ``record`` (optional) receives ``{"global": flat θ_g}`` at the end.

    ``finish`` (the end of training, docs/local.md): None — nothing; True — merges still pending are dropped,
    every fragment with inner steps since its last launch syncs once more (the same outer step, on that partial
    round), and every replica takes θ_g; False — every replica just takes θ_g.

    ``average(f, [Δ_k])`` (optional) replaces the plain mean: it receives every replica's pseudo-gradient of
    fragment f as one flat fp32 buffer (the fragment's tensors in :func:`param_groups` order) and returns Δ̄ --
    for pseudo-gradients that travel rounded or compressed.
    """
    per = world // nodes
    models, opts = _replicas(nodes, make_opt)
    n_params = len(list(models[0].parameters()))
    order = _group_order(models[0])
    fragments = fragments or [list(range(n_params))]
    F = len(fragments)
    theta_g = [p.detach().clone() for p in models[0].parameters()]
    buf: dict[int, torch.Tensor] = {}
    pending: list[tuple[int, int]] = []  # (fragment, apply after step)

    def merge(f: int, a: float) -> None:
        with torch.no_grad():
            for m in models:
                ps = list(m.parameters())
                for i in fragments[f]:
                    ps[i].mul_(a).add_(theta_g[i], alpha=1 - a)

    def outer_step(f: int) -> None:
        with torch.no_grad():
            members = [i for i in order if i in fragments[f]]
            if average is None:
                mean = {i: torch.stack([theta_g[i] - list(m.parameters())[i] for m in models]).mean(0)
                        for i in members}
            else:
                flat = average(f, [torch.cat([(theta_g[i] - list(m.parameters())[i]).reshape(-1) for i in members])
                                   for m in models])
                pieces = flat.split([theta_g[i].numel() for i in members])
                mean = {i: piece.view_as(theta_g[i]) for i, piece in zip(members, pieces)}
            for i in fragments[f]:
                delta = mean[i]
                if outer_momentum > 0:
                    buf[i] = delta.clone() if i not in buf else outer_momentum * buf[i] + delta
                    d = delta + outer_momentum * buf[i] if nesterov else buf[i]
                else:
                    d = delta
                theta_g[i] = theta_g[i] - outer_lr * d

    last_launch = [0] * F
    for s in range(1, steps + 1):
        for k in range(nodes):
            _inner_step(models[k], opts[k], s - 1, range(k * per, (k + 1) * per), accumulation)
        for f, at in [x for x in pending if x[1] == s]:
            merge(f, alpha)
            pending.remove((f, at))
        for f in range(F):
            if s % sync_every != ((f + 1) * sync_every // F) % sync_every:
                continue
            outer_step(f)
            last_launch[f] = s
            if delay == 0:
                merge(f, 0.0)
            else:
                pending.append((f, s + delay))
    if finish is not None:
        for f in range(F):
            if finish and last_launch[f] < steps:
                outer_step(f)
            merge(f, 0.0)
    if record is not None:
        record["global"] = torch.cat([t.reshape(-1) for t in theta_g])
    return [flat_params(m) for m in models]


# ---------------------------------------------------------------------------------------------- compressed Δ
# What each pseudo-gradient goes through on the wire (docs/local.md, "Compressed pseudo-gradients"), for
# ``reference_diloco(average=...)``: the same roundings, written from that description.

def bf16_mean(f: int, deltas: list[torch.Tensor]) -> torch.Tensor:
    """bf16 all-reduce: every Δ_k rounded to bf16, summed in bf16 (each addition rounds), divided by n."""
    total = deltas[0].to(torch.bfloat16)
    for d in deltas[1:]:
        total = total + d.to(torch.bfloat16)
    return (total / len(deltas)).float()


def int8_mean(f: int, deltas: list[torch.Tensor]) -> torch.Tensor:
    """int8 codes: worker k's scale s_k = max|Δ_k| / 127 (fp32), codes round(Δ_k / s_k) (half to even) in
    [−127, 127]; everyone decodes every worker's codes · s_k and takes the mean."""
    decoded = []
    for d in deltas:
        amax = float(d.abs().max())
        scale = torch.tensor(amax / 127 if amax > 0 else 1.0, dtype=torch.float32)
        codes = torch.round(d / scale).clamp(-127, 127)
        decoded.append(codes * scale)
    return torch.stack(decoded).mean(0)


class ReplicatorMean:
    """A replicator with error feedback per worker (one residual e_k per fragment):
    ``e_k ← e_k + Δ_k; q_k = extract(e_k); e_k ← e_k − decode(q_k); Δ̄ = average of the q_k, decoded``.

    ``make(f)`` builds fragment f's fp64 oracle replicator (:mod:`tests.strategies.helpers.reference_demo`); shapes are
    those of the fragment's tensors in :func:`param_groups` order."""

    def __init__(self, make: Callable[[int], object], shapes: dict[int, list[tuple[int, ...]]]) -> None:
        self.make, self.shapes = make, shapes
        self.reps: dict[int, object] = {}
        self.residuals: dict[int, list[list[torch.Tensor]]] = {}

    def __call__(self, f: int, deltas: list[torch.Tensor]) -> torch.Tensor:
        shapes = self.shapes[f]
        sizes = [math.prod(s) for s in shapes]
        if f not in self.reps:
            self.reps[f] = self.make(f)
            self.residuals[f] = [[torch.zeros(s, dtype=torch.float64) for s in shapes] for _ in deltas]
        rep, res = self.reps[f], self.residuals[f]
        qs = []
        for k, d in enumerate(deltas):
            res[k] = [e + x.view(s).double() for e, x, s in zip(res[k], d.split(sizes), shapes)]
            q = rep.extract(res[k])
            res[k] = [e - x for e, x in zip(res[k], rep.sent(q))]
            qs.append(q)
        return torch.cat([u.reshape(-1) for u in rep.average(qs)]).float()
