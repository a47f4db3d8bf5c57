"""The outer machinery's checkpoints: this worker's file, and the logical form that reshards.

* :func:`state_dict` / :func:`load_state_dict`: θ_global, the outer optimizers, the exchanges (residuals,
  counters, generators) and the fragment in flight, as this worker holds them (the fragment in flight's outer
  step finished first, by the caller).
* The logical form: what is the same on every worker — θ_global ``outer.global.<f>``, the outer optimizer's state
  ``outer.<f>.<key>``, a replicator's counters ``outer.replicator.<f>.<key>`` and the fragment in flight
  ``outer.pending`` — is written once (:func:`shared_state`); what each worker keeps of its own — the
  error-feedback residuals — are its :func:`worker_slots`, written as its replica's state with the rule a worker
  that joins follows (:mod:`~quietsync.strategies.checkpoint.replicas`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ...wire.exchange import Exchange, Replicated
from ...wire.packed import PackedExchange
from ..checkpoint.logical import SavedTensors, local_part
from ..checkpoint.replicas import JoinRule
from .fragments import Pending


class OuterState(Protocol):
    """What the outer machinery holds (:class:`~.outer.OuterSync`), as its checkpoints read and write it."""

    F: int
    globals: list[torch.Tensor]
    optimizers: list[torch.optim.SGD]
    exchanges: list[Exchange]
    pending: Pending | None
    store: torch.device


def state_dict(sync: OuterState) -> dict[str, Any]:
    return {
        "globals": [g.detach().clone() for g in sync.globals],
        "outer": [opt.state_dict() for opt in sync.optimizers],
        "exchanges": [e.state_dict() for e in sync.exchanges],
        "pending": None if sync.pending is None else [sync.pending.fragment, sync.pending.apply_after],
    }


def load_state_dict(sync: OuterState, state: dict[str, Any]) -> None:
    if len(state["globals"]) != sync.F:
        raise ValueError(f"checkpoint has {len(state['globals'])} fragments, this run {sync.F}")
    with torch.no_grad():
        for g, s in zip(sync.globals, state["globals"]):
            if s.numel() != g.numel():
                raise ValueError("checkpoint fragments do not match this model's parameters")
            g.copy_(s)
    for opt, s in zip(sync.optimizers, state["outer"]):
        opt.load_state_dict(s)
        _to_store(opt, sync.store)
    kinds = [sorted(s) for s in state["exchanges"]]
    if kinds != [sorted(e.state_dict()) for e in sync.exchanges]:
        raise ValueError("checkpoint pseudo-gradient exchange (replicator, low-bit dtype / sparseloco, error "
                         "feedback) does not match this run's")
    for e, s in zip(sync.exchanges, state["exchanges"]):
        e.load_state_dict(s)
    pending = state["pending"]
    sync.pending = None if pending is None else Pending(int(pending[0]), int(pending[1]), None)


def worker_slots(sync: OuterState) -> dict[str, tuple[torch.Tensor, JoinRule]]:
    """This worker's own outer state, by logical key, each with what a worker that joins a resharded job gets. A
    new per-worker buffer is one line here."""
    slots: dict[str, tuple[torch.Tensor, JoinRule]] = {}
    for f, e in enumerate(sync.exchanges):
        if e.residual is not None:  # error feedback (a replicator's, low-bit, SparseLoCo's): a joiner owes nothing
            kind = "packed_residual" if isinstance(e, PackedExchange) or getattr(e, "packed_residual", False) \
                else "residual"
            slots[f"outer.{kind}.{f}"] = (e.residual, "zero")
    return slots


def shared_state(sync: OuterState) -> dict[str, torch.Tensor]:
    """The world-size-independent outer state (the same on every worker), keys as in the module docstring; the
    fragment in flight is a pair (fragment, the step its merge is due after), or -1, -1."""
    pending = [-1, -1] if sync.pending is None else [sync.pending.fragment, sync.pending.apply_after]
    out = {"outer.pending": torch.tensor(pending, dtype=torch.int64)}
    for f, (g, opt, e) in enumerate(zip(sync.globals, sync.optimizers, sync.exchanges)):
        out[f"outer.global.{f}"] = g.detach()
        for key, value in opt.state.get(g, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"outer.{f}.{key}"] = value.detach()
        for key, value in (e.replicator.state_dict() if isinstance(e, Replicated) else {}).items():
            out[f"outer.replicator.{f}.{key}"] = torch.tensor(int(value), dtype=torch.int64)
    return out


def shared_targets(sync: OuterState, saved: SavedTensors) -> dict[str, torch.Tensor]:
    """Tensors to read :func:`shared_state` into (checks the fragments match)."""
    out = {"outer.pending": torch.zeros(2, dtype=torch.int64)}
    for f, g in enumerate(sync.globals):
        key = f"outer.global.{f}"
        shape = saved.get(key, (None, None))[0]
        if shape is not None and tuple(shape) != tuple(g.shape):
            raise ValueError(f"the checkpoint's {key} has {tuple(shape)} elements, this run's fragment "
                             f"{f} {tuple(g.shape)} (another model or --fragments?)")
        out[key] = torch.empty_like(g)
        head = f"outer.{f}."
        for k, (shape, dtype) in saved.items():
            if k.startswith(head) and "." not in k[len(head):]:
                out[k] = torch.empty(shape, dtype=dtype)
            elif k.startswith(f"outer.replicator.{f}."):
                out[k] = torch.zeros((), dtype=torch.int64)
    return out


def load_shared(sync: OuterState, filled: dict[str, torch.Tensor], mine: dict[str, torch.Tensor]) -> None:
    """Take :func:`shared_targets` filled, and this worker's :func:`worker_slots` from ``mine``."""
    with torch.no_grad():
        for f, (g, opt, e) in enumerate(zip(sync.globals, sync.optimizers, sync.exchanges)):
            g.copy_(filled[f"outer.global.{f}"])
            head = f"outer.{f}."
            state = {k[len(head):]: v for k, v in filled.items() if k.startswith(head) and "." not in k[len(head):]}
            opt.load_state_dict({"state": {0: state} if state else {},
                                 "param_groups": opt.state_dict()["param_groups"]})
            _to_store(opt, sync.store)
            if isinstance(e, Replicated):
                head = f"outer.replicator.{f}."
                e.replicator.load_state_dict({k[len(head):]: int(v) for k, v in filled.items() if k.startswith(head)})
        for key, (t, _) in worker_slots(sync).items():
            t.copy_(local_part(mine[key]))
    fragment, apply_after = (int(x) for x in filled["outer.pending"])
    sync.pending = None if fragment < 0 else Pending(fragment, apply_after, None)


def _to_store(opt: torch.optim.Optimizer, store: torch.device) -> None:
    """The optimizer casts its state to the parameter's device already; keep the tensors where θ_global is."""
    for st in opt.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.device != store and v.dim() > 0:
                st[k] = v.to(store)
