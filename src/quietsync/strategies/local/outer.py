"""The outer loop of DiLoCo-style training (a part): θ_global, the outer optimizer, the fragment schedule and
the pseudo-gradient exchange.

:class:`OuterSync` splits the model's parameters into ``fragments`` contiguous fragments (by parameter tensor,
balanced by element count) and keeps, per fragment f,

* ``θ_global[f]`` — the globally agreed parameters (fp32; on CPU with ``offload``);
* an outer ``torch.optim.SGD`` over it (lr, momentum, Nesterov) whose state is the outer momentum;
* with a replicator, the error-feedback residual ``e[f]`` and the replicator's own state.

Fragment f is synced after inner steps ``s`` with ``s mod H == ((f+1)·H/F) mod H`` (every H steps, fragments
staggered by H/F). A sync of fragment f launched after inner step s:

1. ``Δ = θ_global[f] − θ_local[f]`` (this worker's pseudo-gradient);
2. ``Δ̄ = mean over the group of Δ`` — dense in fp32/bf16 (all-reduce), int8 with a per-fragment scale
   (all-gather of codes and scales, decoded and averaged locally), or through a replicator:
   ``e ← e + Δ; q = extract(e); e ← e − decode(q); Δ̄ = mean of decode(q)`` (error feedback);
3. ``θ_global[f] ← OuterSGD(θ_global[f], Δ̄)``;
4. applied after inner step ``s + τ`` (``τ = overlap_delay``): with τ = 0, ``θ_local[f] ← θ_global[f]``; with
   τ > 0 steps 2–3 run on the :class:`~quietsync.comm_worker.CommWorker` while the τ inner steps continue, and
   the merge is Streaming DiLoCo's mixing ``θ_local[f] ← α·θ_local[f] + (1 − α)·θ_global[f]`` (α = ``mixing``;
   Douillard et al. 2025, "Streaming DiLoCo with overlapping communication", the overlapped outer step).

At most one fragment is in flight (``τ ≤ H/F``; an apply due at a step runs before that step's launch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ...comm_worker import CommWorker, Job
from ...events import label
from ...flat import nbytes
from ...link import traffic
from ...replicators import Replicator, Segments, make_replicator
from ...transport import Transport
from ...validate import check_choice, check_float, check_int
from ..parts.part import Part

PSEUDO_GRAD_DTYPES = ("fp32", "bf16", "int8")
PSEUDO_GRAD_REPLICATORS = ("none", "dct", "random", "striding", "full")


def split_fragments(sizes: list[int], fragments: int) -> list[list[int]]:
    """Indices of the tensors of each of ``fragments`` contiguous, non-empty fragments, balanced by element
    count (fragment k starts at the first tensor with at least k/F of all elements before it)."""
    check_int("fragments", fragments, 1, len(sizes))
    n, total = len(sizes), sum(sizes)
    before = [sum(sizes[:i]) for i in range(n)]
    bounds = [0]
    for k in range(1, fragments):
        b = next((i for i in range(n) if before[i] >= k * total / fragments), n)
        bounds.append(min(max(b, bounds[-1] + 1), n - (fragments - k)))
    bounds.append(n)
    return [list(range(bounds[k], bounds[k + 1])) for k in range(fragments)]


class OuterSync(Part):
    """θ_global + outer SGD per fragment + the staggered, optionally delayed, compressed sync (module docstring).

    Args:
        params: the model parameters synced (read through ``p.data`` each time: strategies may re-view them).
        transport: the transport; ``group``: the group the pseudo-gradients are averaged over.
        sync_every: H, inner steps between two syncs of the same fragment.
        fragments: F, number of fragments (H must be a multiple of F).
        overlap_delay: τ, inner steps between the launch and the application of a fragment's sync (≤ H/F).
        mixing: α of the delayed merge (unused when τ = 0).
        outer_lr / outer_momentum / outer_nesterov: the outer SGD (Nesterov only takes effect with momentum > 0).
        pseudo_grad_dtype: fp32, bf16 or int8 (per-fragment scale).
        replicator: ``none`` (dense exchange) or a :mod:`quietsync.replicators` name; ``compression``/``seed``
            its knobs.
        offload: keep θ_global and the outer optimizer state on CPU.
        on_params_written: called after the model parameters were overwritten (e.g. to refresh a ZeRO-1 master).
    """

    def __init__(self, params: list[torch.Tensor], transport: Transport, group: str, *, sync_every: int,
                 fragments: int = 1, overlap_delay: int = 0, mixing: float = 0.5, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, outer_nesterov: bool = True, pseudo_grad_dtype: str = "fp32",
                 replicator: str = "none", compression: float = 1 / 32, seed: int = 0, offload: bool = False,
                 on_params_written: Callable[[], None] | None = None) -> None:
        check_int("sync_every", sync_every, 1)
        check_int("fragments", fragments, 1, len(params))
        if sync_every % fragments:
            raise ValueError(f"fragments must be a divisor of sync_every ({sync_every}), got {fragments}")
        check_int("overlap_delay", overlap_delay, 0, sync_every // fragments)
        check_float("mixing", mixing, 0, 1)
        check_choice("pseudo_grad_dtype", pseudo_grad_dtype, PSEUDO_GRAD_DTYPES)
        check_choice("pseudo_grad_replicator", replicator, PSEUDO_GRAD_REPLICATORS)
        if replicator != "none" and pseudo_grad_dtype == "int8":
            raise ValueError("pseudo_grad_replicator must be none with pseudo_grad_dtype int8 "
                             "(replicators send fp32 or bf16 values)")
        self.params = list(params)
        self.transport, self.group = transport, group
        self.H, self.F, self.tau, self.alpha = sync_every, fragments, overlap_delay, float(mixing)
        self.dtype = pseudo_grad_dtype
        self.device = self.params[0].device
        self.store = torch.device("cpu") if offload else self.device
        self.on_params_written = on_params_written
        self.fragments = split_fragments([p.numel() for p in self.params], fragments)
        self.segments = [Segments([self.params[i].shape for i in frag]) for frag in self.fragments]
        self.globals: list[torch.Tensor] = []
        self.outer: list[torch.optim.SGD] = []
        for frag in self.fragments:
            g = torch.cat([self.params[i].detach().reshape(-1).float() for i in frag]).to(self.store)
            self.globals.append(g)
            self.outer.append(torch.optim.SGD([g], lr=outer_lr, momentum=outer_momentum,
                                              nesterov=bool(outer_nesterov and outer_momentum > 0)))
        self.replicators: list[Replicator] | None = None
        self.residuals: list[torch.Tensor] = []
        if replicator != "none":
            self.replicators = [
                make_replicator(replicator, compression=compression, transfer_dtype=pseudo_grad_dtype,
                                seed=seed + f).bind(transport, group) for f in range(fragments)]
            self.residuals = [torch.zeros_like(g, device=self.device) for g in self.globals]
        self.worker = CommWorker(transport.device, timeout_s=transport.timeout_s, name="quietsync-outer") \
            if overlap_delay > 0 else None
        self.pending: tuple[int, int, Job | None] | None = None  # (fragment, apply after step, job)

    # ------------------------------------------------------------------ schedule
    def due(self, step: int) -> list[int]:
        """Fragments whose sync launches after inner step ``step`` (1-based)."""
        return [f for f in range(self.F) if step % self.H == ((f + 1) * self.H // self.F) % self.H]

    def after_inner_step(self, step: int, timed: Callable[[Callable[[], Any], str], None],
                         idle: Callable[[str], Any]) -> dict[str, Any]:
        """Apply the fragment due after ``step``, launch the ones due; return the step's metrics extras.

        ``timed(fn, name)`` runs blocking work (collective time = idle); ``idle(name)`` is a context for waits.
        """
        extra: dict[str, Any] = {"synced": False, "fragment": -1, "applied": -1, "sync_bytes": 0}
        if self.pending is not None and self.pending[1] == step:
            f, _, job = self.pending
            if job is not None:
                with idle("outer_wait"):
                    job.wait()
            self._write(f, self.alpha)
            self.pending = None
            extra["applied"] = f
        for f in self.due(step):
            delta = self._pseudo_gradient(f)
            extra.update(synced=True, fragment=f, sync_bytes=self.payload_bytes(f))
            if self.tau == 0:
                timed(lambda f=f, d=delta: self._exchange_and_step(f, d), "outer_sync")
                self._write(f, 0.0)
                extra["applied"] = f
            else:
                job = self.worker.submit(self._exchange_and_step, f, delta)
                self.pending = (f, step + self.tau, job)
        return extra

    # ------------------------------------------------------------------ the sync of one fragment
    def _local(self, f: int) -> torch.Tensor:
        return torch.cat([self.params[i].detach().reshape(-1).float() for i in self.fragments[f]])

    def _pseudo_gradient(self, f: int) -> torch.Tensor:
        """Δ = θ_global[f] − θ_local[f] (fp32, on the parameters' device; a fresh buffer)."""
        return self.globals[f].to(self.device) - self._local(f)

    def _average(self, f: int, delta: torch.Tensor) -> torch.Tensor:
        """Mean of every worker's Δ (fp32), through the configured dtype or replicator."""
        name = f"outer/fragment{f}"
        if self.replicators is not None:
            self.residuals[f].add_(delta)
            return self.replicators[f].replicate(self.residuals[f], self.segments[f])
        if self.dtype == "int8":
            return self._average_int8(delta, name)
        wire = delta if self.dtype == "fp32" else delta.to(torch.bfloat16)
        self.transport.all_reduce(wire, self.group, op="avg", name=name)
        return wire.float()

    def _average_int8(self, delta: torch.Tensor, name: str) -> torch.Tensor:
        """int8 codes with this worker's scale ``max|Δ|/127``; all-gathered, decoded and averaged locally."""
        n = self.transport.group_size(self.group)
        amax = float(delta.abs().max()) if delta.numel() else 0.0
        scale = torch.tensor([amax / 127 if amax > 0 else 1.0], dtype=torch.float32, device=delta.device)
        codes = torch.round(delta / scale).clamp_(-127, 127).to(torch.int8)
        all_codes = torch.empty(n * codes.numel(), dtype=torch.int8, device=delta.device)
        all_scales = torch.empty(n, dtype=torch.float32, device=delta.device)
        self.transport.all_gather(all_codes, codes, self.group, name=name)
        self.transport.all_gather(all_scales, scale, self.group, name=f"{name}/scale")
        return (all_codes.view(n, -1).float() * all_scales[:, None]).mean(0)

    def _exchange_and_step(self, f: int, delta: torch.Tensor) -> None:
        """Steps 2–3 of the module docstring (on the main thread or the communication worker)."""
        avg = self._average(f, delta)
        g = self.globals[f]
        g.grad = avg.to(self.store)
        with label("quietsync/optimizer_step"):
            self.outer[f].step()
        g.grad = None

    def _write(self, f: int, alpha: float) -> None:
        """θ_local[f] ← α·θ_local[f] + (1 − α)·θ_global[f]."""
        src = self.globals[f].to(self.device)
        with torch.no_grad():
            for i, chunk in zip(self.fragments[f], src.split([self.params[i].numel() for i in self.fragments[f]])):
                p = self.params[i]
                chunk = chunk.view_as(p).to(p.dtype)
                if alpha == 0.0:
                    p.data.copy_(chunk)
                else:
                    p.data.mul_(alpha).add_(chunk, alpha=1 - alpha)
        if self.on_params_written is not None:
            self.on_params_written()

    # ------------------------------------------------------------------ bytes (hand count)
    def payload_bytes(self, f: int) -> int:
        """Bytes this worker puts into the collective(s) of one sync of fragment ``f``."""
        numel = self.segments[f].numel
        if self.replicators is not None:
            return self.replicators[f].payload_bytes(self.segments[f])
        if self.dtype == "int8":
            return numel + 4
        return numel * (4 if self.dtype == "fp32" else 2)

    def sent_bytes(self, f: int) -> int:
        """Bytes this worker sends for one sync of fragment ``f`` (the transport's ring accounting)."""
        n = self.transport.group_size(self.group)
        if self.replicators is not None:
            r = self.replicators[f]
            return traffic(r.collective, r.payload_bytes(self.segments[f]) * (n if r.collective == "all_gather" else 1),
                           n)[1]
        if self.dtype == "int8":
            return traffic("all_gather", n * self.segments[f].numel, n)[1] + traffic("all_gather", 4 * n, n)[1]
        return traffic("all_reduce", self.payload_bytes(f), n)[1]

    # ------------------------------------------------------------------ committed θ
    def quiesce(self) -> None:
        """Wait for the fragment in flight (its outer step done; its merge stays due)."""
        if self.pending is not None and self.pending[2] is not None:
            self.pending[2].wait()
            self.pending = (self.pending[0], self.pending[1], None)

    @contextmanager
    def global_params(self) -> Iterator[None]:
        """Within this context the model parameters hold θ_global (the local θ comes back afterwards)."""
        self.quiesce()
        saved = [p.detach().clone() for p in self.params]
        try:
            for f in range(self.F):
                self._write(f, 0.0)
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved):
                    p.data.copy_(s)
            if self.on_params_written is not None:
                self.on_params_written()

    @property
    def pending_fragment(self) -> int:
        return -1 if self.pending is None else self.pending[0]

    # ------------------------------------------------------------------ part protocol
    def memory_report(self) -> dict[str, int]:
        report = {
            "theta_global": sum(nbytes(g) for g in self.globals),
            "outer_state": sum(nbytes(v) for opt in self.outer for st in opt.state.values() for v in st.values()
                               if isinstance(v, torch.Tensor)),
        }
        if self.residuals:
            report["pseudo_grad_residual"] = sum(nbytes(r) for r in self.residuals)
        # the pseudo-gradient buffer of one sync (the largest fragment) and its wire copy
        largest = max(s.numel for s in self.segments)
        wire = {"fp32": 4, "bf16": 2, "int8": 1}[self.dtype]
        n = self.transport.group_size(self.group) if self.dtype == "int8" else 1
        report["fragment_buffers"] = largest * 4 + largest * wire * n * (self.dtype != "fp32")
        return report

    def state_dict(self) -> dict[str, Any]:
        self.quiesce()
        return {
            "globals": [g.detach().clone() for g in self.globals],
            "outer": [opt.state_dict() for opt in self.outer],
            "residuals": [r.clone() for r in self.residuals],
            "replicators": [r.state_dict() for r in self.replicators or []],
            "pending": None if self.pending is None else [self.pending[0], self.pending[1]],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.quiesce()
        if len(state["globals"]) != self.F:
            raise ValueError(f"checkpoint has {len(state['globals'])} fragments, this run {self.F}")
        with torch.no_grad():
            for g, s in zip(self.globals, state["globals"]):
                if s.numel() != g.numel():
                    raise ValueError("checkpoint fragments do not match this model's parameters")
                g.copy_(s)
        for opt, s in zip(self.outer, state["outer"]):
            opt.load_state_dict(s)
            for st in opt.state.values():  # the optimizer casts its state to the parameter's device already
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.device != self.store and v.dim() > 0:
                        st[k] = v.to(self.store)
        if len(state["residuals"]) != len(self.residuals):
            raise ValueError("checkpoint pseudo-gradient replicator does not match this run's")
        for r, s in zip(self.residuals, state["residuals"]):
            r.copy_(s)
        for r, s in zip(self.replicators or [], state["replicators"]):
            r.load_state_dict(s)
        pending = state["pending"]
        self.pending = None if pending is None else (int(pending[0]), int(pending[1]), None)

    def close(self) -> None:
        if self.worker is not None:
            try:
                self.quiesce()
            finally:
                self.worker.close()


__all__ = ["OuterSync", "PSEUDO_GRAD_DTYPES", "PSEUDO_GRAD_REPLICATORS", "split_fragments"]
