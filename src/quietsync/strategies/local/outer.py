"""The outer loop of DiLoCo-style training (a part): θ_global, the outer optimizer, the fragment schedule and
the pseudo-gradient exchange.

:class:`OuterSync` splits the model's parameters into ``fragments`` fragments -- contiguous runs of tensors
balanced by element count, or whole layers strided over the depth (:mod:`.fragments`) -- and keeps, per
fragment f,

* ``θ_global[f]`` — the globally agreed parameters (fp32; on CPU with ``offload``);
* an outer ``torch.optim.SGD`` over it (lr, momentum, Nesterov) whose state is the outer momentum;
* with a replicator, the error-feedback residual ``e[f]`` and the replicator's own state;
* with a low-bit dtype or SparseLoCo, a :class:`~.packed.PackedExchange` (its residual, its generator).

Fragment f is synced after inner steps ``s`` with ``s mod H == ((f+1)·H/F) mod H`` (every H steps, fragments
staggered by H/F). A sync of fragment f launched after inner step s:

1. ``Δ = θ_global[f] − θ_local[f]`` (this worker's pseudo-gradient);
2. ``Δ̄ = mean over the group of Δ`` — dense in fp32/bf16 (all-reduce), int8 with a per-fragment scale
   (all-gather of codes and scales, decoded and averaged locally), or through a replicator:
   ``e ← e + Δ; q = extract(e); e ← e − decode(q); Δ̄ = mean of decode(q)`` (error feedback); or packed
   (:mod:`.packed`): fp4 / fp4_e3m0 / int4 / int2 codes with block scales, all-gathered and averaged in fp32,
   optionally with error feedback; with ``outer = sparseloco`` (Sarfi et al. 2025, arXiv 2508.15706)
   ``e ← β·e + Δ; q = Q(TopK(e)); e ← e − decode(q); Δ̄ = mean of decode(q)``;
3. ``θ_global[f] ← OuterSGD(θ_global[f], Δ̄)`` (SparseLoCo: momentum 0, ``θ_global[f] ← θ_global[f] − lr·Δ̄``);
4. applied after inner step ``s + τ`` (``τ = overlap_delay``): with τ = 0, ``θ_local[f] ← θ_global[f]``; with
   τ > 0 steps 2–3 run on the :class:`~quietsync.comm_worker.CommWorker` while the τ inner steps continue, and
   the merge is Streaming DiLoCo's mixing ``θ_local[f] ← α·θ_local[f] + (1 − α)·θ_global[f]`` (α = ``mixing``;
   Douillard et al. 2025, "Streaming DiLoCo with overlapping communication", the overlapped outer step).

At most one fragment is in flight (``τ ≤ H/F``; an apply due at a step runs before that step's launch).

The end of training (:meth:`OuterSync.finish`): the fragment in flight is waited for (its outer step is in
θ_global; its delayed merge is superseded), every fragment with inner steps since its last launch is synced
once more — steps 1–3, blocking — and every fragment's θ_global is written into the model (α = 0), so every
worker ends on the same, committed parameters.

Checkpoints that reshard: θ_global, the outer SGD state, the replicators' counters and the fragment in flight
(its outer step finished first) are the same on every worker and written once (:meth:`OuterSync.logical_state`);
what each worker keeps of its own — the error-feedback residuals — are its :meth:`OuterSync.worker_slots`,
written as its replica's state with the rule a joining worker follows
(:mod:`~quietsync.strategies.checkpoint.replicas`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ...codecs.lowbit import ROUNDINGS
from ...comm_worker import CommWorker, Job
from ...events import label
from ...flat import nbytes
from ...replicators import Replicator, Segments, make_replicator
from ...transport import Transport, across_replicas
from ...validate import check_choice, check_float, check_int
from ..checkpoint.logical import SavedTensors, local_part
from ..checkpoint.replicas import JoinRule
from ..parts.accumulation import AccumulationConfig
from ..parts.part import Part
from .fragments import FRAGMENT_PATTERNS, split_fragments, strided_fragments
from .packed import LOWBIT_PSEUDO_GRAD_DTYPES, PackedExchange, packed_exchange

PSEUDO_GRAD_DTYPES = ("fp32", "bf16", "int8", *LOWBIT_PSEUDO_GRAD_DTYPES)
PSEUDO_GRAD_REPLICATORS = ("none", "dct", "random", "striding", "full")
OUTER_STEPS = ("sgd", "sparseloco")


@dataclass
class OuterConfig(AccumulationConfig):
    """The outer loop's knobs (DiLoCo's config extends it with the inner training); checked once, here."""

    sync_every: int = 64
    """H: inner optimizer steps between two syncs of each fragment."""
    outer_lr: float = 0.7
    """Learning rate of the outer SGD on the averaged pseudo-gradient."""
    outer_momentum: float = 0.9
    """Momentum of the outer SGD (0: none)."""
    outer_nesterov: bool = True
    """Nesterov momentum for the outer SGD (takes effect only with outer_momentum > 0)."""
    fragments: int = 1
    """Streaming DiLoCo: split the parameters into this many fragments synced at staggered steps (must divide
    sync_every)."""
    overlap_delay: int = 0
    """tau: inner steps a fragment's outer communication overlaps before it is merged (0: blocking; at most
    sync_every/fragments)."""
    mixing: float = 0.5
    """alpha of the delayed merge theta_local <- alpha*theta_local + (1-alpha)*theta_global (only with
    overlap_delay > 0)."""
    fragment_pattern: Literal["contiguous", "strided"] = "contiguous"
    """How parameters form fragments: contiguous (consecutive tensors balanced by size) or strided (whole
    layers, layer l in fragment l mod fragments, Streaming DiLoCo's pattern)."""
    pseudo_grad_dtype: Literal["auto", "fp32", "bf16", "int8", "fp4", "fp4_e3m0", "int4", "int2"] = "auto"
    """dtype pseudo-gradients travel in: fp32, bf16 (all-reduce), int8 with a per-fragment scale, or packed
    fp4 (E2M1), fp4_e3m0, int4, int2 codes with a bf16 scale per pseudo_grad_block elements (all-gather,
    averaged in fp32); auto: fp32, or int2 with outer sparseloco (the SparseLoCo paper sends 2-bit values)."""
    pseudo_grad_block: int = 64
    """Elements per scale of the low-bit pseudo-gradient dtypes (fp4, fp4_e3m0, int4, int2); with a replicator,
    values per scale."""
    pseudo_grad_rounding: Literal["nearest", "stochastic"] = "nearest"
    """Rounding of the low-bit pseudo-gradient dtypes: nearest, or stochastic (unbiased, seeded per worker)."""
    pseudo_grad_error_feedback: bool = False
    """Keep what low-bit quantization lost and add it to the next sync's pseudo-gradient (low-bit dtypes)."""
    outer: Literal["sgd", "sparseloco"] = "sgd"
    """Outer step: sgd (outer_lr, outer_momentum, Nesterov), or sparseloco (per-worker error feedback decayed
    by error_decay in place of momentum, chunk-wise top-k values in pseudo_grad_dtype, plain step
    theta <- theta - outer_lr * mean)."""
    error_decay: float = 0.95
    """SparseLoCo's beta: e <- beta*e + pseudo-gradient before the top-k (outer sparseloco)."""
    topk_density: float = 1 / 64
    """SparseLoCo: fraction of each chunk sent, in (0, 1] (outer sparseloco)."""
    topk_chunk: int = 4096
    """SparseLoCo: elements per top-k chunk; chunks stay inside each tensor (at most the largest one)."""
    pseudo_grad_replicator: Literal["none", "dct", "random", "striding", "full"] = "none"
    """Compress pseudo-gradients with a quietsync replicator (error feedback in its residual); none: dense
    exchange."""
    compression: float = 1 / 32
    """Replicator bandwidth: bytes sent / bytes of the fp32 pseudo-gradient, in (0, 1] (with
    pseudo_grad_replicator)."""
    seed: int = 0
    """Shared seed of the random replicator's positions."""
    offload_outer: bool = False
    """Keep theta_global and the outer optimizer state on CPU (saves 2 model copies of accelerator memory)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pseudo_grad_dtype == "auto":
            self.pseudo_grad_dtype = "int2" if self.outer == "sparseloco" else "fp32"
        check_int("sync_every", self.sync_every, 1)
        check_float("outer_lr", self.outer_lr, 0, low_open=True)
        check_float("outer_momentum", self.outer_momentum, 0, 1, high_open=True)
        check_int("fragments", self.fragments, 1, self.sync_every)
        if self.sync_every % self.fragments:
            raise ValueError(
                f"fragments must be a divisor of sync_every ({self.sync_every}), got {self.fragments}"
            )
        check_int("overlap_delay", self.overlap_delay, 0, self.sync_every // self.fragments)
        check_float("mixing", self.mixing, 0, 1)
        check_choice("fragment_pattern", self.fragment_pattern, FRAGMENT_PATTERNS)
        check_choice("pseudo_grad_dtype", self.pseudo_grad_dtype, PSEUDO_GRAD_DTYPES)
        check_int("pseudo_grad_block", self.pseudo_grad_block, 1)
        check_choice("pseudo_grad_rounding", self.pseudo_grad_rounding, ROUNDINGS)
        check_choice("pseudo_grad_replicator", self.pseudo_grad_replicator, PSEUDO_GRAD_REPLICATORS)
        check_float("compression", self.compression, 0, 1, low_open=True)
        check_int("seed", self.seed, 0)
        check_choice("outer", self.outer, OUTER_STEPS)
        check_float("error_decay", self.error_decay, 0, 1)
        check_float("topk_density", self.topk_density, 0, 1, low_open=True)
        check_int("topk_chunk", self.topk_chunk, 1)
        if self.pseudo_grad_replicator != "none" and self.pseudo_grad_dtype == "int8":
            raise ValueError("pseudo_grad_replicator must be none with pseudo_grad_dtype int8 "
                             "(replicators send fp32, bf16 or low-bit values)")
        if self.pseudo_grad_error_feedback and self.pseudo_grad_dtype not in LOWBIT_PSEUDO_GRAD_DTYPES:
            raise ValueError(f"pseudo_grad_error_feedback needs a low-bit pseudo_grad_dtype "
                             f"({', '.join(LOWBIT_PSEUDO_GRAD_DTYPES)}), got {self.pseudo_grad_dtype!r}")
        if self.outer == "sparseloco":
            if self.pseudo_grad_replicator != "none":
                raise ValueError(f"pseudo_grad_replicator must be none with outer sparseloco (it selects its own "
                                 f"top-k), got {self.pseudo_grad_replicator!r}")
            if self.pseudo_grad_dtype == "int8":
                values = ", ".join(d for d in PSEUDO_GRAD_DTYPES if d != "int8")
                raise ValueError(f"pseudo_grad_dtype must be one of {values} with outer sparseloco, got 'int8'")


@dataclass
class _Pending:
    """The fragment whose sync is in flight (τ > 0)."""

    fragment: int
    apply_after: int
    """Inner step after which its merge is applied."""
    job: Job | None
    """The outer step running on the communication worker; None once it finished."""


class OuterSync(Part):
    """θ_global + outer SGD per fragment + the staggered, optionally delayed, compressed sync (module
    docstring).

    Args:
        params: the model parameters synced (read through ``p.data`` each time: strategies may re-view them).
        transport: the transport; ``group``: the group the pseudo-gradients are averaged over.
        config: the outer knobs (:class:`OuterConfig`: H, F, τ, α, the outer SGD, the pseudo-gradient's dtype
        or
            replicator, offloading).
        on_params_written: called after the model parameters were overwritten (e.g. to refresh a ZeRO-1
        master).
    """

    def __init__(self, params: list[torch.Tensor], transport: Transport, group: str, config: OuterConfig,
                 on_params_written: Callable[[], None] | None = None,
                 layers: list[list[int]] | None = None) -> None:
        fragments, outer_lr, outer_momentum = config.fragments, config.outer_lr, config.outer_momentum
        sparseloco = config.outer == "sparseloco"
        if sparseloco:  # SparseLoCo's outer step is plain: its error feedback stands in for the momentum
            outer_momentum = 0.0
        self.params = list(params)
        self.transport, self.group = transport, group
        self.H, self.F, self.tau = config.sync_every, fragments, config.overlap_delay
        self.alpha = float(config.mixing)
        self.dtype = config.pseudo_grad_dtype
        self.device = self.params[0].device
        self.store = torch.device("cpu") if config.offload_outer else self.device
        self.on_params_written = on_params_written
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
        self.outer: list[torch.optim.SGD] = []
        for frag in self.fragments:
            g = torch.cat([self.params[i].detach().reshape(-1).float() for i in frag]).to(self.store)
            self.globals.append(g)
            self.outer.append(torch.optim.SGD([g], lr=outer_lr, momentum=outer_momentum,
                                              nesterov=bool(config.outer_nesterov and outer_momentum > 0)))
        self.replicators: list[Replicator] | None = None
        self.residuals: list[torch.Tensor] = []
        if config.pseudo_grad_replicator != "none":
            self.replicators = [
                make_replicator(
                    config.pseudo_grad_replicator,
                    compression=config.compression,
                    transfer_dtype=config.pseudo_grad_dtype,
                    transfer_block=config.pseudo_grad_block,
                    seed=config.seed + f,
                ).bind(transport, group)
                for f in range(fragments)
            ]
            self.residuals = [torch.zeros_like(g, device=self.device) for g in self.globals]
        self.packed: list[PackedExchange] | None = None
        if self.replicators is None and (sparseloco or self.dtype in LOWBIT_PSEUDO_GRAD_DTYPES):
            rank = transport.group_rank(group)
            self.packed = [packed_exchange(
                dtype=self.dtype, sizes=list(self.segments[f].sizes), transport=transport, group=group,
                sparseloco=sparseloco, block=config.pseudo_grad_block, rounding=config.pseudo_grad_rounding,
                error_feedback=config.pseudo_grad_error_feedback, decay=config.error_decay,
                density=config.topk_density, chunk=config.topk_chunk, seed=config.seed + 7919 * rank + f,
                device=self.device, name=f"outer/fragment{f}") for f in range(fragments)]
        self.worker = CommWorker(transport.device, timeout_s=transport.timeout_s, name="quietsync-outer") \
            if self.tau > 0 else None
        self.pending: _Pending | None = None

    # ------------------------------------------------------------------ schedule
    def due(self, step: int) -> list[int]:
        """Fragments whose sync launches after inner step ``step`` (1-based)."""
        return [f for f in range(self.F) if step % self.H == ((f + 1) * self.H // self.F) % self.H]

    def after_inner_step(self, step: int, timed: Callable[[Callable[[], Any], str], None],
                         idle: Callable[[str], Any]) -> dict[str, Any]:
        """Apply the fragment due after ``step``, launch the ones due; return the step's metrics extras.

        ``timed(fn, name)`` runs blocking work (collective time = idle); ``idle(name)`` is a context for
        waits.
        """
        extra: dict[str, Any] = {"synced": False, "fragment": -1, "applied": -1, "sync_bytes": 0}
        if self.pending is not None and self.pending.apply_after == step:
            f, job = self.pending.fragment, self.pending.job
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
                self.pending = _Pending(f, step + self.tau, job)
        return extra

    def last_launch(self, f: int, step: int) -> int:
        """The inner step after which fragment ``f``'s latest sync launched, at or before ``step`` (0: none)."""
        first = ((f + 1) * self.H // self.F) % self.H or self.H
        return 0 if step < first else first + (step - first) // self.H * self.H

    def finish(self, step: int, sync: bool, timed: Callable[[Callable[[], Any], str], None],
               idle: Callable[[str], Any]) -> list[int]:
        """End of training after inner step ``step`` (module docstring); returns the fragments synced here.
        ``sync=False``: no final sync — the model just takes θ_global of the last syncs."""
        if self.pending is not None:
            if self.pending.job is not None:
                with idle("outer_wait"):
                    self.pending.job.wait()
            self.pending = None
        synced = [f for f in range(self.F) if sync and self.last_launch(f, step) < step]
        for f in synced:
            delta = self._pseudo_gradient(f)
            timed(lambda f=f, d=delta: self._exchange_and_step(f, d), "outer_sync")
        for f in range(self.F):
            self._write(f, 0.0)
        return synced

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
        if self.packed is not None:
            return self.packed[f].average(delta)
        if self.dtype == "int8":
            return across_replicas(self.transport, lambda: self._average_int8(delta, name))
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
            for i, chunk in zip(
                self.fragments[f], src.split([self.params[i].numel() for i in self.fragments[f]])
            ):
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
        if self.packed is not None:
            return self.packed[f].payload_bytes()
        if self.dtype == "int8":
            return numel + 4
        return numel * (4 if self.dtype == "fp32" else 2)

    # ------------------------------------------------------------------ committed θ
    def quiesce(self) -> None:
        """Wait for the fragment in flight (its outer step done; its merge stays due)."""
        if self.pending is not None and self.pending.job is not None:
            self.pending.job.wait()
            self.pending.job = None

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
        return -1 if self.pending is None else self.pending.fragment

    # ------------------------------------------------------------------ part protocol
    def memory_report(self) -> dict[str, int]:
        report = {
            "theta_global": sum(nbytes(g) for g in self.globals),
            "outer_state": sum(
                nbytes(v)
                for opt in self.outer
                for st in opt.state.values()
                for v in st.values()
                if isinstance(v, torch.Tensor)
            ),
        }
        if self.residuals:
            report["pseudo_grad_residual"] = sum(nbytes(r) for r in self.residuals)
        largest = max(s.numel for s in self.segments)
        if self.packed is not None:
            parts = [p.memory_report() for p in self.packed]
            if "pseudo_grad_residual" in parts[0]:
                report["pseudo_grad_residual"] = sum(r["pseudo_grad_residual"] for r in parts)
            # the pseudo-gradient of one sync (the largest fragment), its gathered payloads and their decoding
            report["fragment_buffers"] = largest * 4 + max(r["packed_buffers"] for r in parts)
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
        return {
            "globals": [g.detach().clone() for g in self.globals],
            "outer": [opt.state_dict() for opt in self.outer],
            "residuals": [r.clone() for r in self.residuals],
            "replicators": [r.state_dict() for r in self.replicators or []],
            **({"packed": [p.state_dict() for p in self.packed]} if self.packed is not None else {}),
            "pending": None if self.pending is None else [self.pending.fragment, self.pending.apply_after],
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
        if ("packed" in state) != (self.packed is not None):
            raise ValueError("checkpoint pseudo-gradient packing (low-bit dtype / sparseloco) does not match "
                             "this run's")
        for p, s in zip(self.packed or [], state.get("packed", [])):
            p.load_state_dict(s)
        pending = state["pending"]
        self.pending = None if pending is None else _Pending(int(pending[0]), int(pending[1]), None)

    # ------------------------------------------------------------------ checkpoints that reshard
    def worker_slots(self) -> dict[str, tuple[torch.Tensor, JoinRule]]:
        """This worker's own outer state, by logical key, each with what a worker that joins a resharded job
        gets (:mod:`~quietsync.strategies.checkpoint.replicas`). A new per-worker buffer is one line here."""
        slots: dict[str, tuple[torch.Tensor, JoinRule]] = {}
        for f, r in enumerate(self.residuals):
            slots[f"outer.residual.{f}"] = (r, "zero")  # error feedback: a joining worker owes nothing yet
        for f, p in enumerate(self.packed or []):
            if p.feedback is not None:  # low-bit / SparseLoCo error feedback: the same rule
                slots[f"outer.packed_residual.{f}"] = (p.feedback.residual, "zero")
        return slots

    def logical_state(self) -> dict[str, torch.Tensor]:
        """The world-size-independent outer state (the same on every worker): ``outer.global.<f>`` (θ_global),
        ``outer.<f>.<key>`` (the outer SGD's state), ``outer.replicator.<f>.<key>`` (counters) and
        ``outer.pending`` (the fragment in flight and the step its merge is due after, or -1, -1); the
        fragment in flight is waited for first, so its outer step is in θ_global."""
        self.quiesce()
        pending = [-1, -1] if self.pending is None else [self.pending.fragment, self.pending.apply_after]
        out = {"outer.pending": torch.tensor(pending, dtype=torch.int64)}
        for f, (g, opt) in enumerate(zip(self.globals, self.outer)):
            out[f"outer.global.{f}"] = g.detach()
            for key, value in opt.state.get(g, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"outer.{f}.{key}"] = value.detach()
            for key, value in (self.replicators[f].state_dict() if self.replicators else {}).items():
                out[f"outer.replicator.{f}.{key}"] = torch.tensor(int(value), dtype=torch.int64)
        return out

    def logical_targets(self, saved: SavedTensors) -> dict[str, torch.Tensor]:
        """Tensors to read :meth:`logical_state` into (checks the fragments match)."""
        out = {"outer.pending": torch.zeros(2, dtype=torch.int64)}
        for f, g in enumerate(self.globals):
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

    def load_logical(self, filled: dict[str, torch.Tensor], mine: dict[str, torch.Tensor]) -> None:
        """Take :meth:`logical_targets` filled, and this worker's :meth:`worker_slots` from ``mine``."""
        with torch.no_grad():
            for f, (g, opt) in enumerate(zip(self.globals, self.outer)):
                g.copy_(filled[f"outer.global.{f}"])
                head = f"outer.{f}."
                state = {k[len(head):]: v for k, v in filled.items()
                         if k.startswith(head) and "." not in k[len(head):]}
                opt.load_state_dict({"state": {0: state} if state else {},
                                     "param_groups": opt.state_dict()["param_groups"]})
                for st in opt.state.values():
                    for k, v in st.items():
                        if isinstance(v, torch.Tensor) and v.device != self.store and v.dim() > 0:
                            st[k] = v.to(self.store)
                if self.replicators:
                    head = f"outer.replicator.{f}."
                    self.replicators[f].load_state_dict(
                        {k[len(head):]: int(v) for k, v in filled.items() if k.startswith(head)})
            for key, (t, _) in self.worker_slots().items():
                t.copy_(local_part(mine[key]))
        fragment, apply_after = (int(x) for x in filled["outer.pending"])
        self.pending = None if fragment < 0 else _Pending(fragment, apply_after, None)

    def start_from_global(self) -> None:
        """θ_local ← θ_global for every fragment (a worker that joins a resharded job)."""
        for f in range(self.F):
            self._write(f, 0.0)

    def close(self) -> None:
        if self.worker is not None:
            try:
                self.quiesce()
            finally:
                self.worker.close()


__all__ = ["OuterConfig", "OuterSync", "PSEUDO_GRAD_DTYPES", "PSEUDO_GRAD_REPLICATORS"]
