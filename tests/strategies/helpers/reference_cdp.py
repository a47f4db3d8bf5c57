"""The CDP update rules written from the paper's equations, in plain torch (no quietsync code).

    θ_{t+1} = Opt(θ_t, (1/N) Σ_{i=1..N} ∇f_i(θ̂_{i,t})),   θ̂^j_{i,t} = θ^j_t or θ^j_{t-1}
    (DP)     θ^j_t always
    (CDP-v1) θ^j_{t-1} always
    (CDP-v2) θ^j_t if j ≥ N − i + 1 else θ^j_{t-1}     (1-based i, j)

with θ_{-1} := θ_0. ``stage_of[name]`` is the 1-based stage of each parameter (written by hand in the tests).
The gradient of micro-batch i is taken at exactly the tensors its forward used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def uses_new(rule: str, i: int, j: int, n: int) -> bool:
    """Whether stage j (1-based) of micro-batch i (1-based) reads θ_t (True) or θ_{t-1} (False)."""
    if rule == "dp":
        return True
    if rule == "v1":
        return False
    if rule == "v2":
        return j >= n - i + 1
    raise ValueError(rule)


def reference_cdp(model: torch.nn.Module, optimizer: torch.optim.Optimizer, stage_of: dict[str, int], rule: str,
                  n: int, steps: int, data: Callable[[int, int], Any],
                  loss: Callable[[Callable, Any], torch.Tensor],
                  stage_max_norm: float | None = None) -> list[dict[str, torch.Tensor]]:
    """Run ``steps`` steps; returns θ_1 … θ_steps (name → tensor). ``data(t, i)`` is micro-batch i (0-based) of
    step t; ``loss(call, batch)`` computes its loss with ``call(*args, **kwargs)`` standing for the model.
    ``stage_max_norm``: each stage's mean gradient is scaled by ``min(1, max / (‖g_stage‖ + 1e-6))`` first."""
    params = dict(model.named_parameters())
    prev = {k: p.detach().clone() for k, p in params.items()}  # θ_{-1} := θ_0
    out = []
    for t in range(steps):
        grads = {k: torch.zeros_like(p) for k, p in params.items()}
        for i in range(1, n + 1):
            leaves = {k: (p.detach() if uses_new(rule, i, stage_of[k], n) else prev[k]).clone().requires_grad_()
                      for k, p in params.items()}

            def call(*args: Any, leaves: dict = leaves, **kwargs: Any) -> Any:
                return torch.func.functional_call(model, leaves, args, kwargs)

            value = loss(call, data(t, i - 1)) / n
            for k, g in zip(leaves, torch.autograd.grad(value, list(leaves.values()), allow_unused=True)):
                if g is not None:
                    grads[k] += g
        prev = {k: p.detach().clone() for k, p in params.items()}
        if stage_max_norm is not None:
            for j in set(stage_of.values()):
                names = [k for k in grads if stage_of[k] == j]
                norm = float(sum((grads[k].double() ** 2).sum() for k in names)) ** 0.5
                coef = min(1.0, stage_max_norm / (norm + 1e-6))
                for k in names:
                    grads[k] = grads[k] * coef
        for k, p in params.items():
            p.grad = grads[k]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append({k: p.detach().clone() for k, p in params.items()})
    return out
