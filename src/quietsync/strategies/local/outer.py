"""The outer machinery of DiLoCo-style training (a part): θ_global per fragment, the outer optimizers, the
fragment schedule, the pseudo-gradient's exchange, the fragment in flight, the end of training.

The recurrence itself — the pseudo-gradient, the outer step on its average, the merge — is DiLoCo's, written in
:mod:`.diloco`; this part decides *when* it runs and keeps *what* it runs on. :class:`OuterSync` splits the
model's parameters into ``fragments`` fragments (contiguous runs of tensors balanced by element count, or whole
layers strided over the depth, :mod:`.fragments`) and keeps, per fragment f,

* ``globals[f]`` — θ_global of the fragment (fp32; on CPU with ``offload_outer``);
* ``optimizers[f]`` — the outer ``torch.optim.SGD`` over it (lr, momentum, Nesterov; SparseLoCo: momentum 0);
* ``exchanges[f]`` — how its pseudo-gradient crosses the wire (:mod:`.exchange`, :mod:`quietsync.wire.exchange`:
  dense, int8, a replicator or packed codes, with their error-feedback residual).

After inner step ``s`` (:meth:`OuterSync.after_inner_step`) the fragment whose merge is due is merged, and every
fragment due (:class:`~.fragments.FragmentSchedule`) is launched: its pseudo-gradient is taken, then its outer
step runs — blocking, merged at once with α = 0, when ``overlap_delay`` τ = 0; on the
:class:`~quietsync.comm_worker.CommWorker` while τ inner steps continue, merged with α = ``mixing`` after step
``s + τ``, when τ > 0 (at most one fragment in flight: τ ≤ H/F; an apply due at a step runs before that step's
launch).

The end of training (:meth:`OuterSync.finish`): the fragment in flight is waited for (its outer step is in
θ_global; its delayed merge is superseded), every fragment with inner steps since its last launch is synced
once more — blocking — and every fragment's θ_global is written into the model (α = 0), so every worker ends on
the same, committed parameters.

Checkpoints: :mod:`.outer_checkpoint` (the state the same on every worker once, each worker's residuals as its
replica's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from ...comm_worker import CommWorker
from ...flat import nbytes
from ...transport import Transport
from ...validate import check_int
from ...wire.exchange import Exchange
from ...wire.packed import LOWBIT_PSEUDO_GRAD_DTYPES, PackedExchange
from ...wire.replicators import Segments
from ..checkpoint.logical import SavedTensors
from ..checkpoint.replicas import JoinRule
from ..parts.part import Part
from . import outer_checkpoint
from .arrival import Arrival
from .exchange import fragment_exchange
from .fragments import FragmentSchedule, Pending, split_fragments, strided_fragments
from .outer_config import OuterConfig


class Recurrence(Protocol):
    """The outer step the machinery runs (DiLoCo's, :mod:`.diloco`), per fragment ``f``."""

    def pseudo_gradient(self, f: int) -> torch.Tensor:
        """Δ of fragment ``f`` now (a fresh fp32 buffer on the parameters' device)."""
        ...

    def outer_step(self, f: int, delta: torch.Tensor) -> None:
        """θ_global[f] updated from the group's average of Δ (on the main thread or the communication worker)."""
        ...

    def merge(self, f: int, alpha: float) -> None:
        """θ_local[f] ← α·θ_local[f] + (1 − α)·θ_global[f]."""
        ...


class OuterSync(Part):
    """θ_global, outer optimizer and exchange per fragment, and when the recurrence runs (module docstring).

    Args:
        params: the model parameters synced (read through ``p.data`` each time: strategies may re-view them).
        transport: the transport; ``group``: the group the pseudo-gradients are averaged over.
        config: the outer knobs (:class:`~.outer_config.OuterConfig`).
        recurrence: the pseudo-gradient, outer step and merge it runs (DiLoCo).
        on_params_written: called after the model parameters were put back from a copy (e.g. to refresh a
            ZeRO-1 master); the recurrence's merge calls it itself.
        layers: the model's layers as parameter indices (``fragment_pattern = strided``).
    """

    def __init__(self, params: list[torch.Tensor], transport: Transport, group: str, config: OuterConfig,
                 recurrence: Recurrence, on_params_written: Callable[[], None] | None = None,
                 layers: list[list[int]] | None = None) -> None:
        fragments, outer_momentum = config.fragments, config.outer_momentum
        if config.outer == "sparseloco":  # SparseLoCo's outer step is plain: its error feedback stands in
            outer_momentum = 0.0
        self.params = list(params)
        self.transport, self.group = transport, group
        self.recurrence = recurrence
        self.on_params_written = on_params_written
        self.schedule = FragmentSchedule(config.sync_every, fragments)
        self.F, self.tau = fragments, config.overlap_delay
        self.alpha = float(config.mixing)
        self.dtype = config.pseudo_grad_dtype
        self.device = self.params[0].device
        self.store = torch.device("cpu") if config.offload_outer else self.device
        if config.fragment_pattern == "strided":
            layers = layers if layers is not None else [[i] for i in range(len(self.params))]
            if fragments > len(layers):  # the checks that need the model
                raise ValueError(f"fragments must be at most the model's {len(layers)} layers with "
                                 f"fragment_pattern strided, got {fragments}")
            self.fragments = strided_fragments(layers, fragments)
        else:
            check_int("fragments", fragments, 1, len(params))
            self.fragments = split_fragments([p.numel() for p in self.params], fragments)
        self.segments = [Segments([self.params[i].shape for i in frag]) for frag in self.fragments]
        self.globals: list[torch.Tensor] = []
        self.optimizers: list[torch.optim.SGD] = []
        for frag in self.fragments:
            g = torch.cat([self.params[i].detach().reshape(-1).float() for i in frag]).to(self.store)
            self.globals.append(g)
            self.optimizers.append(torch.optim.SGD([g], lr=config.outer_lr, momentum=outer_momentum,
                                                   nesterov=bool(config.outer_nesterov and outer_momentum > 0)))
        self.exchanges: list[Exchange] = [fragment_exchange(config, f, self.segments[f], transport, group,
                                                            self.device) for f in range(fragments)]
        self.worker = CommWorker(transport.device, timeout_s=transport.timeout_s, name="quietsync-outer") \
            if self.tau > 0 else None
        self.pending: Pending | None = None
        self.arrival: Arrival | None = None
        """Set by a strategy whose workers meet before each sync (arrival.py); None: the sync's collectives wait."""

    # ------------------------------------------------------------------ when the recurrence runs
    def after_inner_step(self, step: int, timed: Callable[[Callable[[], Any], str], None],
                         idle: Callable[[str], Any]) -> dict[str, Any]:
        """Apply the fragment due after ``step``, launch the ones due; return the step's metrics extras.

        ``timed(fn, name)`` runs blocking work (collective time = idle); ``idle(name)`` is a context for
        waits.
        """
        r = self.recurrence
        extra: dict[str, Any] = {"synced": False, "fragment": -1, "applied": -1, "sync_bytes": 0}
        # <=: with adaptive inner steps a slow worker's inner step may jump past the apply step (adaptive.py)
        if self.pending is not None and self.pending.apply_after <= step:
            f, job = self.pending.fragment, self.pending.job
            if job is not None:
                with idle("outer_wait"):
                    self._wait_pending()
            r.merge(f, self.alpha)
            self.pending = None
            extra["applied"] = f
        for f in self.schedule.due(step):
            delta = r.pseudo_gradient(f)
            extra.update(synced=True, fragment=f, sync_bytes=self.exchanges[f].payload_bytes())
            if self.tau == 0:
                if self.arrival is not None:
                    self.arrival.meet(idle)
                timed(lambda f=f, d=delta: r.outer_step(f, d), "outer_sync")
                r.merge(f, 0.0)
                extra["applied"] = f
            else:
                patience = self.arrival.patience_s() if self.arrival is not None else None  # met on the comm thread
                job = self.worker.submit(self._launched, f, delta, patience)
                self.pending = Pending(f, step + self.tau, job, patience)
        return extra

    def _wait_pending(self) -> None:
        """Wait for the sync in flight: the communication worker's timeout, plus the wait for slower workers it may
        hold before its collectives (:meth:`_launched`)."""
        assert self.pending is not None and self.pending.job is not None and self.worker is not None
        patience = self.pending.patience_s
        self.pending.job.wait(None if patience is None else patience + self.worker.timeout_s)
        if self.arrival is not None and patience is not None:
            self.arrival.joined()

    def _launched(self, f: int, delta: torch.Tensor, patience: float | None) -> None:
        """A sync in flight, on the communication thread: the slower workers launch it later, so it waits for them
        here (off the main thread, behind the τ inner steps) before its collectives."""
        if patience is not None:
            self.transport.meet(patience, self.group)
        self.recurrence.outer_step(f, delta)

    def finish(self, step: int, sync: bool, timed: Callable[[Callable[[], Any], str], None],
               idle: Callable[[str], Any], fragments: list[int] | None = None) -> list[int]:
        """End of training after inner step ``step`` (module docstring); returns the fragments synced here.
        ``sync=False``: no final sync — the model just takes θ_global of the last syncs. ``fragments``: the ones
        to sync, where the caller decided it (adaptive inner steps: from the agreed steps); default: those with
        inner steps since their last launch."""
        r = self.recurrence
        if self.pending is not None:
            if self.pending.job is not None:
                with idle("outer_wait"):
                    self._wait_pending()
            self.pending = None
        if fragments is None:
            fragments = [f for f in range(self.F) if self.schedule.last_launch(f, step) < step]
        synced = fragments if sync else []
        for f in synced:
            delta = r.pseudo_gradient(f)
            timed(lambda f=f, d=delta: r.outer_step(f, d), "outer_sync")
        for f in range(self.F):
            r.merge(f, 0.0)
        return synced

    # ------------------------------------------------------------------ committed θ
    def quiesce(self) -> None:
        """Wait for the fragment in flight (its outer step done; its merge stays due)."""
        if self.pending is not None and self.pending.job is not None:
            self._wait_pending()
            self.pending.job = None

    @contextmanager
    def global_params(self) -> Iterator[None]:
        """Within this context the model parameters hold θ_global (the local θ comes back afterwards)."""
        self.quiesce()
        saved = [p.detach().clone() for p in self.params]
        try:
            self.start_from_global()
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved):
                    p.data.copy_(s)
            if self.on_params_written is not None:
                self.on_params_written()

    def start_from_global(self) -> None:
        """θ_local ← θ_global for every fragment (the end of a run, a worker that joins a resharded job)."""
        for f in range(self.F):
            self.recurrence.merge(f, 0.0)

    @property
    def pending_fragment(self) -> int:
        return -1 if self.pending is None else self.pending.fragment

    # ------------------------------------------------------------------ part protocol
    def memory_report(self) -> dict[str, int]:
        report = {
            "theta_global": sum(nbytes(g) for g in self.globals),
            "outer_state": sum(nbytes(v) for opt in self.optimizers for st in opt.state.values()
                               for v in st.values() if isinstance(v, torch.Tensor)),
        }
        residuals = [e.residual for e in self.exchanges if e.residual is not None]
        if residuals:
            report["pseudo_grad_residual"] = sum(nbytes(r) for r in residuals)
        largest = max(s.numel for s in self.segments)
        packed = [e for e in self.exchanges if isinstance(e, PackedExchange)]
        if packed:
            # the pseudo-gradient of one sync (the largest fragment), its gathered payloads and their decoding
            report["fragment_buffers"] = largest * 4 + max(p.memory_report()["packed_buffers"] for p in packed)
            return report
        # the pseudo-gradient buffer of one sync (the largest fragment) and its wire copy
        # (a replicator with low-bit values: its payload is a small part of the fragment)
        wire = {"fp32": 4, "bf16": 2, "int8": 1}.get(self.dtype, 4)
        n = self.transport.group_size(self.group) if self.dtype == "int8" else 1
        copied = self.dtype not in ("fp32", *LOWBIT_PSEUDO_GRAD_DTYPES)
        report["fragment_buffers"] = largest * 4 + largest * wire * n * copied
        return report

    def state_dict(self) -> dict[str, Any]:
        self.quiesce()
        return outer_checkpoint.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.quiesce()
        outer_checkpoint.load_state_dict(self, state)

    # ------------------------------------------------------------------ checkpoints that reshard
    def worker_slots(self) -> dict[str, tuple[torch.Tensor, JoinRule]]:
        """This worker's own outer state, by logical key, with what a joining worker gets
        (:func:`.outer_checkpoint.worker_slots`)."""
        return outer_checkpoint.worker_slots(self)

    def shared_state(self) -> dict[str, torch.Tensor]:
        """The world-size-independent outer state, the same on every worker (the fragment in flight waited for
        first): :func:`.outer_checkpoint.shared_state`."""
        self.quiesce()
        return outer_checkpoint.shared_state(self)

    def shared_targets(self, saved: SavedTensors) -> dict[str, torch.Tensor]:
        return outer_checkpoint.shared_targets(self, saved)

    def load_shared(self, filled: dict[str, torch.Tensor], mine: dict[str, torch.Tensor]) -> None:
        """Take :meth:`shared_targets` filled, and this worker's :meth:`worker_slots` from ``mine``."""
        outer_checkpoint.load_shared(self, filled, mine)

    def close(self) -> None:
        if self.worker is not None:
            try:
                self.quiesce()
            finally:
                self.worker.close()


__all__ = ["OuterSync", "Recurrence"]
