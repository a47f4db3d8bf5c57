"""The decoupled-momentum optimizer step shared by DeMo-SGD and decoupled AdamW (paper 001).

Every step, for all parameters that have a gradient, together (one method each, so a strategy can spell the
update out: :meth:`DecoupledOptimizer.begin_step`, then):

1. :meth:`~DecoupledOptimizer.momentum`: ``delta <- beta * delta + s * g`` (decoupled momentum, local to the
   worker; ``s`` is the lr for DeMo-SGD as in the DeMo reference, 1 for decoupled AdamW),
2. :meth:`~DecoupledOptimizer.extract`: the replicator extracts ``q`` from ``delta`` and removes it
   (``delta <- delta - decode(q)``),
3. :meth:`~DecoupledOptimizer.exchange`: ``q`` crosses the replicate group in one collective; the average ``Q``
   comes back,
4. :meth:`~DecoupledOptimizer.apply`: the base rule applies ``Q`` (optionally its sign) to the parameters; where
   every group applies the sign, step 3 returns ``sign(Q)`` already (the replicator takes it while the update is in
   cache) and ``DecoupledStep.signed`` says so.

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
from dataclasses import dataclass
from typing import Any

import torch

from ..transport import Collectives
from ..validate import check_float, check_int
from ..wire.replicators import Message, Replicator, Segments, SparseUpdate, convert_momentum, make_replicator

__all__ = ["DecoupledOptimizer", "DecoupledStep", "check_replication_schedule"]


@dataclass
class DecoupledStep:
    """One step of a :class:`DecoupledOptimizer`, from :meth:`~DecoupledOptimizer.begin_step` to
    :meth:`~DecoupledOptimizer.apply`."""

    groups: list[tuple[dict[str, Any], list[torch.Tensor]]]
    """Each parameter group with its parameters that have a gradient."""
    params: list[torch.Tensor]
    """Those parameters, in order."""
    segments: Segments
    """Their shapes, as laid out in ``delta``."""
    delta: torch.Tensor
    """The flat decoupled momentum of ``params``, in the replicator's domain."""
    replicates: bool
    """Whether this step replicates (else it applies the local gradient)."""
    signed: bool = False
    """Whether the exchange already took the update's sign (every group applies ``sign(Q)``)."""


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
            # a rebuilt buffer (another set of parameters with gradients) keeps each one's momentum
            old = self.state[p].get("delta")
            if old is not None:
                if old.shape != view.shape:
                    raise ValueError(f"momentum of a parameter of shape {tuple(p.shape)} has shape {tuple(old.shape)}, "
                                     f"the {self.replicator.momentum_domain} domain needs {tuple(view.shape)}")
                view.copy_(old)
            self.state[p]["delta"] = view
        self._flat, self._flat_key = flat, key
        return flat

    # DeMo's update, one phase at a time (a strategy may call them itself: ``strategies/decoupled/demo.py``)
    def begin_step(self) -> DecoupledStep | None:
        """Open step ``t + 1``: the parameters with a gradient and their momentum buffer, and whether the step
        replicates (None, and no replication, when no parameter has a gradient)."""
        self.decoupled_step += 1
        groups = [(g, [p for p in g["params"] if p.grad is not None]) for g in self.param_groups]
        params = [p for _, ps in groups for p in ps]
        self.last_replicated = bool(params) and self.replicates_at(self.decoupled_step)
        if not params:
            return None
        segments = Segments([p.shape for p in params])
        return DecoupledStep(groups, params, segments, self._flat_delta(params, segments), self.last_replicated)

    @torch.no_grad()
    def momentum(self, step: DecoupledStep) -> None:
        """``delta <- beta * delta + s * g`` for every parameter, in the replicator's domain."""
        betas = [float(g["beta"]) for g, ps in step.groups for _ in ps]
        scales = [self._delta_scale(g) for g, ps in step.groups for _ in ps]
        self.replicator.accumulate(step.delta, step.segments, [p.grad for p in step.params], betas, scales)

    @torch.no_grad()
    def extract(self, step: DecoupledStep) -> Message:
        """``q``: the part of ``delta`` that travels, removed from ``delta`` (error feedback)."""
        return self.replicator.extract_momentum(step.delta, step.segments)

    @torch.no_grad()
    def exchange(self, step: DecoupledStep, q: Message) -> torch.Tensor | SparseUpdate:
        """``Q``: every worker's ``q`` exchanged in one collective, averaged and decoded (spatial, flat) -- its sign
        where every group applies ``sign(Q)``: the replicator takes it while decoding (``step.signed``)."""
        step.signed = all(g["sign"] for g, ps in step.groups if ps)
        return self.replicator.exchange_momentum(q, step.segments, sign=step.signed)

    @torch.no_grad()
    def local_update(self, step: DecoupledStep) -> torch.Tensor:
        """A step that does not replicate applies the local gradient, ``s * g`` (the momentum is left alone)."""
        return torch.cat([p.grad.reshape(-1).to(torch.float32) * self._delta_scale(g)
                          for g, ps in step.groups for p in ps])

    @torch.no_grad()
    def apply(self, step: DecoupledStep, update: torch.Tensor | SparseUpdate) -> None:
        """The base rule on ``Q`` (its sign where the group asks for it)."""
        if isinstance(update, SparseUpdate):
            pieces = update.split(step.segments.sizes)
            done = 0
            for g, ps in step.groups:
                mine = pieces[done : done + len(ps)]
                done += len(ps)
                # groups differ on sign: the exchange returned Q, so each signing group signs its own
                if g["sign"] and not step.signed:
                    mine = [(i, v.sign()) for i, v in mine]
                if ps and not self._apply_sparse(g, ps, mine):
                    dense = []
                    for p, (i, v) in zip(ps, mine):
                        u = v.new_zeros(p.numel())
                        u.index_copy_(0, i, v)
                        dense.append(u.view(p.shape))
                    self._apply(g, ps, dense)
            return
        at = 0
        for g, ps in step.groups:
            if not ps:
                continue
            ups = []
            for p in ps:
                ups.append(update[at : at + p.numel()].view(p.shape))
                at += p.numel()
            if g["sign"] and not step.signed:
                torch._foreach_sign_(ups)
            self._apply(g, ps, ups)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():  # step runs under no_grad; the closure needs autograd
                loss = closure()
        step = self.begin_step()
        if step is None:
            return loss
        if step.replicates:
            self.momentum(step)
            update = self.exchange(step, self.extract(step))
        else:
            update = self.local_update(step)
        self.apply(step, update)
        return loss

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["decoupled"] = {"step": self.decoupled_step, "replicator": self.replicator.state_dict(),
                           "momentum_domain": self.replicator.momentum_domain}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)  # a copy: the pop below must not change the caller's dict
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
