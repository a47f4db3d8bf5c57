"""The decoupled-momentum optimizer step shared by DeMo-SGD and decoupled AdamW (paper 001).

Every step, for all parameters that have a gradient, together:

1. ``delta <- beta * delta + s * g``  (decoupled momentum, local to the worker; ``s`` is the lr for
   DeMo-SGD as in the DeMo reference, 1 for decoupled AdamW),
2. the replicator extracts ``q`` from ``delta``, removes it (``delta <- delta - decode(q)``) and
   exchanges it with the replicate group in one collective, returning the average ``Q``,
3. the base rule applies ``Q`` (optionally its sign) to the parameters.

Periodic replication: step ``t`` (1-based) replicates iff ``t % replicate_every == 0`` and not
``t % skip_every == 0``; on other steps the momentum is left alone and the local gradient
(``s * g``) is applied, as in the DeToNATION reference.

All parameters' momenta live in one flat fp32 buffer (each ``state[p]["delta"]`` is a view of it), in
the replicator's **domain** (:attr:`~quietsync.wire.replicators.Replicator.momentum_domain`): as the parameters
are laid out for ``random`` / ``striding`` / ``full`` / ``none``, as the DCT-II coefficients of every block
(``(blocks, *block_shape)`` per parameter) for ``dct`` -- then step 1 transforms the gradient and step 2's
error feedback is exact in the coefficients, one transform fewer than a spatial momentum needs. The buffer is
rebuilt only when the set of parameters with gradients changes. ``state_dict()`` holds the momenta (and their
domain), the step counter and the replicator's counters, so a resumed run continues exactly; a checkpoint
whose momenta are spatial (older ones, or another replicator's) is converted on loading.

When the replicator hands back a sparse update (``random`` / ``striding``), a base rule that can
(:meth:`DecoupledOptimizer._apply_sparse`: DeMo-SGD) applies it at the sent positions only, with the same
values a dense update gives; the others get it densified.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..transport import Collectives
from ..validate import check_float, check_int
from ..wire.replicators import Replicator, Segments, SparseUpdate, convert_momentum, make_replicator

__all__ = ["DecoupledOptimizer", "check_replication_schedule"]


def check_replication_schedule(replicate_every: int, skip_every: int) -> None:
    """Raise ``ValueError`` unless ``replicate_every`` is an integer >= 1 and ``skip_every`` is 0 (never
    skip) or an integer >= 2 (skipping every step would never replicate)."""
    check_int("replicate_every", replicate_every, 1)
    check_int("skip_every", skip_every, 2, special={0: "never skip"})


class DecoupledOptimizer(torch.optim.Optimizer):
    """Base class of the decoupled optimizers (see the module docstring).

    Args:
        params: parameters or parameter groups (torch style).
        defaults: per-group defaults (``lr``, ``beta``, ``sign``, ``weight_decay``, ...); ``lr``,
            ``beta`` and ``weight_decay`` are checked here for every subclass.
        replicator: a :class:`~quietsync.wire.replicators.Replicator` or its name (then built with
            ``replicator_kwargs``).
        transport: the :class:`~quietsync.transport.Transport`; None = a world of one.
        group: transport group to replicate over (``world`` for DeMo, ``replicate`` for FlexDeMo).
        replicate_every / skip_every: periodic replication (``skip_every=0``: never skip); see
            :func:`check_replication_schedule`.
    """

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        replicator: Replicator | str = "dct",
        transport: Collectives | None = None,
        group: str = "world",
        replicate_every: int = 1,
        skip_every: int = 0,
        replicator_kwargs: dict[str, Any] | None = None,
    ) -> None:
        check_float("lr", defaults.get("lr", 0.0), 0)
        check_float("beta", defaults.get("beta", 0.0), 0, 1)
        check_float("weight_decay", defaults.get("weight_decay", 0.0), 0)
        check_replication_schedule(replicate_every, skip_every)
        super().__init__(params, defaults)
        if isinstance(replicator, str):
            replicator = make_replicator(replicator, **(replicator_kwargs or {}))
        if not isinstance(replicator, Replicator):
            raise TypeError(f"replicator must be a Replicator or a name, got {type(replicator).__name__}")
        if transport is not None:
            replicator.bind(transport, group)
        self.replicator = replicator
        self.replicate_every = replicate_every
        self.skip_every = skip_every
        self.decoupled_step = 0
        self._flat: torch.Tensor | None = None
        self._flat_key: tuple[int, ...] | None = None
        self.last_replicated = False

    # ------------------------------------------------------------------ hooks for the base rules
    @abstractmethod
    def _delta_scale(self, group: dict[str, Any]) -> float:
        """``s`` in ``delta <- beta * delta + s * g``."""

    @abstractmethod
    def _apply(self, group: dict[str, Any], params: list[torch.Tensor], updates: list[torch.Tensor]) -> None:
        """Apply the replicated (already sign-ed if asked) updates to ``params`` of ``group``."""

    def _apply_sparse(self, group: dict[str, Any], params: list[torch.Tensor],
                      updates: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Apply updates that are zero except at ``(flat positions, values)`` per parameter, with exactly the
        result :meth:`_apply` gives on the dense update; return False (doing nothing) where the rule cannot."""
        return False

    # ------------------------------------------------------------------ the step
    def replicates_at(self, step: int) -> bool:
        """Whether 1-based step ``step`` replicates."""
        if step % self.replicate_every:
            return False
        return not (self.skip_every and step % self.skip_every == 0)

    def _flat_delta(self, params: list[torch.Tensor], segments: Segments) -> torch.Tensor:
        key = tuple(id(p) for p in params)
        if key == self._flat_key and self._flat is not None:
            return self._flat
        device = params[0].device if params else torch.device("cpu")
        flat = torch.zeros(self.replicator.momentum_numel(segments), dtype=torch.float32, device=device)
        for p, view in zip(params, self.replicator.momentum_views(flat, segments)):
            old = self.state[p].get("delta")
            if old is not None:
                if old.shape != view.shape:
                    raise ValueError(f"momentum of a parameter of shape {tuple(p.shape)} has shape {tuple(old.shape)}, "
                                     f"the {self.replicator.momentum_domain} domain needs {tuple(view.shape)}")
                view.copy_(old)
            self.state[p]["delta"] = view
        self._flat, self._flat_key = flat, key
        return flat

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.decoupled_step += 1
        groups = [(g, [p for p in g["params"] if p.grad is not None]) for g in self.param_groups]
        params = [p for _, ps in groups for p in ps]
        if not params:
            self.last_replicated = False
            return loss
        segments = Segments([p.shape for p in params])
        flat = self._flat_delta(params, segments)
        self.last_replicated = self.replicates_at(self.decoupled_step)
        update: torch.Tensor | SparseUpdate
        if self.last_replicated:
            betas = [float(g["beta"]) for g, ps in groups for _ in ps]
            scales = [self._delta_scale(g) for g, ps in groups for _ in ps]
            self.replicator.accumulate(flat, segments, [p.grad for p in params], betas, scales)
            update = self.replicator.replicate_momentum(flat, segments)
        else:
            update = torch.cat(
                [p.grad.reshape(-1).to(torch.float32) * self._delta_scale(g) for g, ps in groups for p in ps]
            )
        if isinstance(update, SparseUpdate):
            pieces = update.split(segments.sizes)
            done = 0
            for g, ps in groups:
                mine = pieces[done : done + len(ps)]
                done += len(ps)
                if g["sign"]:
                    mine = [(i, v.sign()) for i, v in mine]
                if ps and not self._apply_sparse(g, ps, mine):
                    dense = []
                    for p, (i, v) in zip(ps, mine):
                        u = v.new_zeros(p.numel())
                        u.index_copy_(0, i, v)
                        dense.append(u.view(p.shape))
                    self._apply(g, ps, dense)
            return loss
        at = 0
        for g, ps in groups:
            if not ps:
                continue
            ups = []
            for p in ps:
                ups.append(update[at : at + p.numel()].view(p.shape))
                at += p.numel()
            if g["sign"]:
                torch._foreach_sign_(ups)
            self._apply(g, ps, ups)
        return loss

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["decoupled"] = {"step": self.decoupled_step, "replicator": self.replicator.state_dict(),
                           "momentum_domain": self.replicator.momentum_domain}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("decoupled", None)
        super().load_state_dict(state_dict)
        self._flat, self._flat_key = None, None  # momenta are new tensors now; rebuild the flat buffer
        if extra is not None:
            self.decoupled_step = int(extra["step"])
            self.replicator.load_state_dict(extra["replicator"])
        domain = (extra or {}).get("momentum_domain", "spatial")  # checkpoints before domains were spatial
        if domain != self.replicator.momentum_domain:
            for group in self.param_groups:
                for p in group["params"]:
                    st = self.state.get(p, {})
                    if "delta" in st:
                        st["delta"] = convert_momentum(st["delta"], p.shape, domain, self.replicator)
