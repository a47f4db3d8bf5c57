"""``cdp``: Cyclic Data Parallelism (Fournier & Oyallon, 2024, paper 002), executed for real.

The model is cut into ``N`` stages (:mod:`~quietsync.models.stages`); a training step (a *cycle*) has
``N`` micro-batches. One time step is the forward or the backward of one stage. Micro-batch ``i``
(0-based slot) of cycle ``c`` starts at time ``s = c·2N + 2i`` (the paper's delay of 2 time steps), runs
the forward of stage ``j`` at ``s + j`` and its backward at ``s + 2N − 1 − j``; so at every time step each
stage does exactly one forward or backward, and about ``(N+1)/2`` micro-batches' activations are alive
instead of DP's ``N`` at its peak.

Update rules (θ_c are the parameters after ``c`` committed steps, 1-based stages ``j`` and micro-batches
``i`` as in the paper)::

    θ_{c+1} = Opt(θ_c, (1/N) Σ_i ∇f_i(θ̂_{i,c}))         with, for stage j of micro-batch i of cycle c,
    dp     : θ̂^j = θ_c^j                                 (reference; needs a barrier: no stagger)
    cdp-v1 : θ̂^j = θ_{c−1}^j                             (PipeDream-2BW's rule)
    cdp-v2 : θ̂^j = θ_c^j if j ≥ N − i + 1 else θ_{c−1}^j  (the newest version the timeline has)

Conventions: **θ_{−1} := θ_0** (at the first cycle only θ_0 exists), so the first step is a DP step. ∇f_i is
taken **at the versions the forward used**: when stage ``j`` is updated between micro-batch ``i``'s forward
and backward (``i + j ≤ N``: the update of cycle ``c−1`` arrives in between), the backward still uses the
forward's version — every forward runs on its own leaf view of the version it was given, and an update never
writes into a storage a pending backward holds (the optimizer steps a fresh copy; the old storage becomes the
kept previous version). At most two versions per stage are kept (θ_c, θ_{c−1}).

The CDP-v2 indexing follows from the timeline: stage ``j`` (1-based) of cycle ``c−1`` is complete when the
last micro-batch's backward of that stage ends, at ``2N(c−1) + 2(N−1) + 2N − j``; micro-batch ``i`` of cycle
``c`` runs that stage's forward at ``2Nc + 2(i−1) + j − 1``, strictly later iff ``i + j ≥ N + 1`` — exactly
the paper's ``j ≥ N − i + 1``. The planner checks this for every rule (:class:`Schedule`).

Executors (one code path; the :class:`Schedule` assigns slot ``i`` to worker ``i mod W``):

* **one process** (``W = 1``): the worker runs all ``N`` slots, several micro-batches in flight at once;
* **N workers** (``W = N``; any ``W`` dividing ``N`` works): worker ``w`` runs slot ``w`` of each cycle.
  Gradients of stage ``j`` travel as a **reduce chain** over the slots: after its backward of stage ``j``,
  slot ``i`` adds the partial sum it received from slot ``i−1`` and passes it to slot ``i+1`` (two time steps
  later, one hop, just in time); slot ``N−1``'s worker (the *root*) then holds ``(1/N) Σ_i ∇f_i`` of stage
  ``j``, updates the stage, and starts a **distribution chain** to the other workers, ordered by when they
  first need the new version (v2: worker ``N−j``, ``N−j+1``, ...; then the rest), one hop per time step,
  each applying the same optimizer step to the same mean gradient, so replicas stay identical. Per stage and
  cycle: ``2(N−1)`` messages of the stage's gradient size, the volume of a ring all-reduce, spread over the
  cycle, point-to-point only (no collective; the initial parameter copy is a point-to-point chain too).

Precision and clipping: bf16 runs every stage's forward (and the loss) under autocast; fp16 is refused (a
cycle's stages commit at different time steps, so no skip decision can come before all of them).
``max_grad_norm`` clips **each stage's** mean gradient by that stage's own norm when the stage is updated (the
global norm of the cycle is not known before its first stage must be updated); the committed step reports the
per-stage norms (``grad_norm_per_stage``) and their root sum of squares (``grad_norm``).

Activation checkpointing: a block whose model asked for checkpointing (Hugging Face's
``activation_checkpointing_enable``) would recompute with whatever version the module holds at backward time;
cdp turns the block's own checkpointing off and checkpoints that segment itself, recomputing it with the
forward's version (tested equal to the run without checkpointing).

``forward_backward(batch, loss_fn)`` feeds this worker's next micro-batch and runs one *window* of time steps,
the same on every worker: up to the start of worker 0's next slot (one process: 2 time steps; ``N`` workers:
``2N``), which holds the start of this worker's micro-batch. A time step waits only for what peers sent in the
previous one, so no call waits for a peer's *next* call: the loop may communicate between calls (a data loader's
broadcast, a budget agreement, a Trainer's logging). It returns the loss of the micro-batch(es) whose backward
completed in the call, or None while the pipeline fills. ``step()`` returns True once every worker has updated
all ``N`` stages of a cycle — in the same call on every worker (the first after ``2N−1`` calls on one process).
A loop must make the same number of calls on every worker (stopping on a committed step, on a micro-batch
count or at the end of equal data all do); ``finish()`` (or ``close()``) then drops the micro-batches in flight.

``loss_fn(model, batch)`` keeps its contract: it must call ``model`` once (e.g. the trainer's
``model(input_ids=batch, labels=batch).loss``). The strategy first calls it with a recorder that captures the
model call's arguments (the stage inputs), and at the last stage's forward calls it again with a stand-in
model that returns the last stage's output, so the loss is computed on the last stage's graph.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...activation_memory import ActivationMeter
from ...events import label
from ...models.stages import PARTITIONS, StagePlan, partition, run_segments, segment_flops, sequential_view
from ...validate import check_choice, check_int
from ..base import LossFn, Strategy
from ..config import StrategyConfig
from ..parts.clipping import CLIP_EPS
from ..parts.lr import LRScaler
from ..registry import register
from ..substrates.sharded_optimizer import build_optimizer
from . import facts
from .capture import Replay, capture_call
from .mailbox import Mailbox
from .schedule import Message, Schedule
from .versions import VersionStore

RULES = ("dp", "v1", "v2")
_ALIASES = {"cdp-v1": "v1", "cdp-v2": "v2"}


@dataclass
class CDPConfig(StrategyConfig):
    """Knobs of the ``cdp`` strategy."""

    rule: Literal["dp", "v1", "v2"] = "v2"
    """Update rule: v2 (CDP-v2, the newest version each stage has), v1 (CDP-v1, all stages one step behind) or
    dp (no delay; micro-batches run in lock-step, the reference)."""
    stages: int | None = None
    """Number of stages N = micro-batches per step (default: the number of workers, or 2 on one process)."""
    partition: Literal["params", "flops", "manual"] = "params"
    """How the model is cut: balance parameter counts, measured FLOPs (on the first micro-batch), or
    manual."""
    manual_stages: str = ""
    """With partition manual: comma-separated names of the modules that start stages 2..N (e.g.
    transformer.h.1,lm_head)."""
    measure_activations: bool = False
    """Record the bytes autograd holds for backward after every time step (activation_timeline())."""

    def __post_init__(self) -> None:
        self.rule = _ALIASES.get(self.rule, self.rule)  # type: ignore[assignment]
        check_choice("rule", self.rule, RULES)
        check_int("stages", self.stages, 1, allow_none=True)
        check_choice("partition", self.partition, PARTITIONS)
        if not isinstance(self.manual_stages, str):
            raise ValueError(f"manual_stages must be a comma-separated string, got {self.manual_stages!r}")
        if self.partition == "manual" and not self.manual_names:
            raise ValueError(
                "manual_stages must name the modules that start stages 2..N when partition is manual, got ''"
            )
        if self.partition != "manual" and self.manual_names:
            raise ValueError(
                f"manual_stages is only used with partition manual, got partition {self.partition!r}"
            )

    @property
    def manual_names(self) -> list[str]:
        return [s.strip() for s in self.manual_stages.split(",") if s.strip()]


@dataclass
class _MicroBatch:
    cycle: int
    slot: int
    batch: Any
    loss_fn: LossFn
    x: Any
    ctx: dict
    leaves: dict[int, torch.Tensor] = field(default_factory=dict)
    xin: dict[int, Any] = field(default_factory=dict)
    out: dict[int, Any] = field(default_factory=dict)
    gout: dict[int, torch.Tensor | None] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)
    loss: torch.Tensor | None = None


# ---------------------------------------------------------------------------------------------- the strategy
@register("cdp", CDPConfig, facts=facts.CDP)
class CDP(Strategy):
    """Cyclic Data Parallelism; see the module docstring."""

    prepares_gradient = True  # it clips each stage's gradient (fp16 it refuses: fp16_refusal)

    reshard_refusal = "micro-batches of the next step are in flight when a step commits"

    resumable = False  # micro-batches of the next step are in flight when a step commits

    buffer_sync = "refuse"  # no collective to average running statistics with (see parts/buffers.py)

    owns_schedule = True  # forward_backward runs the stages; backward(loss) of a loss computed outside is refused

    finish_policy = (
        "micro-batches in flight are dropped (their cycle never completes) and every stage holds the committed "
        "version"
    )

    fp16_refusal = (
        "each stage is updated at its own time step on each worker, so a round cannot be dropped as a whole on "
        "every worker before any of it commits (fp16 loss scaling)"
    )

    config: CDPConfig

    def __init__(self, model: nn.Module, optimizer: Any = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        cfg = self.config
        world = self.world_size
        n = cfg.stages if cfg.stages is not None else (world if world > 1 else 2)
        if n % world:
            raise ValueError(f"stages must be a multiple of the number of workers ({world}), got {n}")
        self.n = n
        self.view = sequential_view(model)
        if n > len(self.view.segments):
            names = ", ".join(s.name for s in self.view.segments)
            raise ValueError(
                f"stages must be <= the {len(self.view.segments)} segments of this model ({names}), got {n}"
            )
        self._checkpointed = self._take_over_checkpointing()
        self.schedule = Schedule(n, world, cfg.rule)
        self.me = self.rank
        self.optimizer = build_optimizer(self.optimizer_factory, self.param_groups, self.optimizer_kwargs)
        self.lr = self.hold("lr", LRScaler(self.optimizer))
        self.plan: StagePlan | None = None
        if cfg.partition != "flops":
            self._build(partition(self.view, n, cfg.partition, cfg.manual_names))
        self.meter = ActivationMeter(exclude=self._is_parameter) if cfg.measure_activations else None
        self._param_ptrs: set[int] = set()
        self.t = 0  # next time step this worker processes
        self.fed = 0  # local micro-batches fed
        self._inflight: dict[tuple[int, int], _MicroBatch] = {}
        self._own: dict[tuple[int, int, int], torch.Tensor] = {}
        self._partial: dict[tuple[int, int], torch.Tensor] = {}
        self._updates: dict[int, int] = defaultdict(int)
        self._pending_commits: list[int] = []
        self._next_commit = 0
        self._commit_times: dict[int, int] = {}
        self._done_losses: list[torch.Tensor] = []
        self._wound_down = False
        self._stage_norms: dict[int, dict[int, float]] = defaultdict(dict)  # cycle -> stage -> pre-clip norm
        self.mailbox = self.hold("mailbox", Mailbox(self.transport, self.accounting))
        """The point-to-point transfers of the chains (``sent_per_step``, ``sent_completed``: what was sent)."""
        self._initial_copy()
        self._refresh_param_ptrs()

    # ------------------------------------------------------------------ set-up
    def _build(self, plan: StagePlan) -> None:
        self.plan = plan
        trainable = {id(p) for g in self.param_groups for p in g["params"]}
        owned = [[p for p in ps if id(p) in trainable] for ps in plan.owned]
        self.versions = self.hold("versions", VersionStore(owned))
        """Each stage's live parameters and the previous version kept for micro-batches in flight."""
        self.stage_numel = [sum(p.numel() for p in ps) for ps in owned]
        self.stage_bytes = [sum(p.numel() * p.element_size() for p in ps) for ps in owned]
        self._refresh_param_ptrs()

    def _initial_copy(self) -> None:
        """Replicas start from worker 0's parameters, passed down a point-to-point chain 0 → 1 → … → W−1."""
        if self.world_size == 1:
            return
        params = [p for g in self.param_groups for p in g["params"]]
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            if self.me > 0:
                self.transport.recv(flat, self.me - 1, name="cdp/init_params")
            if self.me < self.world_size - 1:
                self.transport.send(flat, self.me + 1, name="cdp/init_params")
            torch._foreach_copy_(
                params, [x.view_as(p) for x, p in zip(flat.split([p.numel() for p in params]), params)]
            )

    def _take_over_checkpointing(self) -> set[int]:
        """Activation checkpointing the model asked for (Hugging Face blocks with ``gradient_checkpointing``
        on) recomputes a block in backward with the parameters *the module holds then* — here another version
        than the forward used, whenever the stage was updated in between. So cdp turns the blocks' own flag off
        and checkpoints those segments itself (:meth:`_run_stage`), recomputing them with the forward's version.
        Returns the ids of the segments it checkpoints."""
        ids = set()
        for seg in self.view.segments:
            flagged = [m for m in seg.module.modules() if getattr(m, "gradient_checkpointing", False) is True]
            for m in flagged:
                m.gradient_checkpointing = False
            if flagged:
                ids.add(id(seg))
        return ids

    def _run_stage(self, j: int, x: Any, ctx: dict, values: dict[int, torch.Tensor]) -> Any:
        """Stage ``j``'s segments on ``x`` with the parameter tensors ``values``; a segment the model wanted
        checkpointed runs under a non-reentrant ``torch.utils.checkpoint`` whose recomputation calls it with the
        same ``values`` again (the version the forward used)."""
        if not self._checkpointed:
            return run_segments(self.plan.stages[j], x, ctx, values)
        for seg in self.plan.stages[j]:
            if id(seg) in self._checkpointed:
                x = checkpoint(run_segments, [seg], x, ctx, values, use_reentrant=False)
            else:
                x = run_segments([seg], x, ctx, values)
        return x

    def balance(self) -> dict[str, Any]:
        """The stage cut and its balance (see :meth:`StagePlan.balance`); None-like before the first call with
        partition flops."""
        if self.plan is None:
            return {}
        return self.plan.balance()

    # ------------------------------------------------------------------ the trainer's call
    def forward_backward(self, batch: Any, loss_fn: LossFn) -> torch.Tensor | None:
        self._check_training()
        if self.plan is None:  # partition flops: measured on the first micro-batch
            args, kwargs = capture_call(self.module, batch, loss_fn)
            flops = segment_flops(
                self.view, args, kwargs, lambda out: loss_fn(Replay(self.module, out), batch)
            )
            self._build(partition(self.view, self.n, "flops", (), flops))
        per = self.n // self.world_size
        c, k = divmod(self.fed, per)
        slot = self.schedule.slots(self.me)[k]
        args, kwargs = capture_call(self.module, batch, loss_fn)
        x, ctx = self.view.enter(args, kwargs)
        self._inflight[(c, slot)] = _MicroBatch(c, slot, batch, loss_fn, x, ctx)
        self.fed += 1
        c2, k2 = divmod(self.fed, per)
        # Every worker's call covers the same window of time steps: up to the start of worker 0's next slot (this
        # worker's own next micro-batch starts in that window). So no call waits for what a peer sends in its
        # next call, and every worker reports a commit in the same call (see _time_step).
        until = self.schedule.start(c2, self.schedule.slots(0)[k2])
        while self.t < until:
            self._time_step(self.t)
            self.t += 1
        done, self._done_losses = self._done_losses, []
        if not done:
            return None
        return done[0] if len(done) == 1 else torch.stack(done).mean()

    # ------------------------------------------------------------------ one time step
    def _time_step(self, t: int) -> None:
        s = self.schedule
        me = self.me
        cycles = s.cycles_at(t)
        # 1. post the receives of everything sent to me at t-1, in the senders' order
        self._post_receives(t)
        # 2. new versions arriving now (distribution chain): apply, relay
        for c in cycles:
            for j in range(self.n):
                if me != s.root() and s.arrivals(c, j).get(me) == t:
                    buf = self.mailbox.take(("dist", c, j, 0))
                    self._apply(c, j, buf)
                    chain = s.chain(j)
                    k = chain.index(me)
                    if k + 1 < len(chain):
                        self.mailbox.send(buf, chain[k + 1], t, "dist", c)
        # 3. forwards, then 4. backwards (activations of a step's forwards count before its backwards free
        # theirs)
        mine = [(c, i) for c in cycles for i in s.slots(me) if (c, i) in self._inflight]
        for c, i in mine:
            j = t - s.start(c, i)
            if 0 <= j < self.n:
                self._forward(self._inflight[(c, i)], j)
        for c, i in mine:
            j = 2 * self.n - 1 - (t - s.start(c, i))
            if 0 <= j < self.n:
                self._backward_stage(self._inflight[(c, i)], j)
        # 5. the reduce chain: add my gradient to the partial sum; pass it on, or (the root) update and
        # distribute
        for c in cycles:
            for j in range(self.n):
                rt = s.reduce_times(c, j)
                for i in s.slots(me):
                    if rt[i] == t and (c, i, j) in self._own:
                        self._reduce(c, i, j, t)
        # 6. a cycle commits on every worker at the end of the time step in which the last worker applied its last
        # stage update (each worker's own last update is earlier or then)
        while self._commit_time(self._next_commit) <= t:
            c = self._next_commit
            if self._updates.pop(c, 0) != self.n:
                raise RuntimeError(f"cdp: cycle {c} commits with stages not updated here — schedule bug")
            self._pending_commits.append(c)
            self._next_commit += 1
        self.mailbox.retire(self.steps)
        if self.meter is not None:
            self.meter.sample(t)

    def _commit_time(self, c: int) -> int:
        """The time step at whose end every worker has applied the update of cycle ``c`` to every stage."""
        if c not in self._commit_times:
            self._commit_times[c] = max(max(self.schedule.arrivals(c, j).values()) for j in range(self.n))
        return self._commit_times[c]

    def _messages_at(self, t: int, *, to: int | None = None, by: int | None = None) -> list[Message]:
        """The schedule's transfers sent at time step ``t`` (to or by one worker), in key order."""
        s = self.schedule
        return sorted((m for c in s.cycles_at(t) for j in range(self.n) for m in s.messages_sent(c, j)
                       if m.time == t and (to is None or m.dst == to) and (by is None or m.src == by)),
                      key=lambda m: m.key)

    def _post_receives(self, t: int) -> None:
        for m in self._messages_at(t - 1, to=self.me):
            buf = torch.empty(self.stage_numel[m.stage], dtype=self._dtype, device=self._device)
            self.mailbox.post((m.kind, m.cycle, m.stage, m.slot), buf, m.src, m.kind)

    def _forward(self, mb: _MicroBatch, j: int) -> None:
        v = self.schedule.version(mb.cycle, mb.slot, j)
        mb.versions[j] = v
        for p, x in zip(self.versions.owned[j], self.versions.tensors(j, v)):
            mb.leaves[id(p)] = x.detach().requires_grad_()
        values = {}
        for seg in self.plan.stages[j]:
            for p in seg.parameters():
                values[id(p)] = mb.leaves.get(id(p), p)
        x = mb.x if j == 0 else mb.out[j - 1]
        if isinstance(x, torch.Tensor) and x.is_floating_point() and j > 0:
            x = x.detach().requires_grad_()
        mb.xin[j] = x
        with self.meter.track() if self.meter is not None else nullcontext(), self.autocast():
            out = self._run_stage(j, x, mb.ctx, values)
            if j == self.n - 1:
                loss = mb.loss_fn(Replay(self.module, out), mb.batch)  # type: ignore[arg-type]
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError("loss_fn must return a scalar tensor")
                mb.loss = loss
                out = loss / self.n  # the step's gradient is the mean over the cycle's N micro-batches
        mb.out[j] = out

    def _backward_stage(self, mb: _MicroBatch, j: int) -> None:
        out = mb.out.pop(j)
        grad = mb.gout.pop(j, None)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            torch.autograd.backward(out, grad)
        del out
        x = mb.xin.pop(j)
        if j > 0:
            mb.gout[j - 1] = x.grad if isinstance(x, torch.Tensor) else None
        grads = []
        for p in self.versions.owned[j]:
            leaf = mb.leaves.pop(id(p))
            grads.append(torch.zeros_like(p).reshape(-1) if leaf.grad is None else leaf.grad.reshape(-1))
        flat = torch.cat(grads) if grads else torch.zeros(0, dtype=self._dtype, device=self._device)
        self._own[(mb.cycle, mb.slot, j)] = flat
        if j == 0:
            del self._inflight[(mb.cycle, mb.slot)]
            self._done_losses.append(mb.loss.detach())
            self.accounting.micro_batch_done()
            self.micro_batches += 1

    def _reduce(self, c: int, i: int, j: int, t: int) -> None:
        s = self.schedule
        acc = self._own.pop((c, i, j))
        if i > 0:
            if s.worker(i - 1) == self.me:
                acc = self._partial.pop((c, j)).add_(acc)
            else:
                acc = self.mailbox.take(("partial", c, j, i - 1)).add_(acc)
        if i < self.n - 1:
            if s.worker(i + 1) == self.me:
                self._partial[(c, j)] = acc
            else:
                self.mailbox.send(acc, s.worker(i + 1), t, "partial", c)
            return
        self._apply(c, j, acc)  # the root: the stage's mean gradient is complete
        chain = s.chain(j)
        if chain:
            self.mailbox.send(acc, chain[0], t, "dist", c)

    def _apply(self, c: int, j: int, flat: torch.Tensor) -> None:
        """θ^j_{c+1} = Opt(θ^j_c, mean gradient of cycle c); θ^j_c is kept as the previous version."""
        params = self.versions.owned[j]
        coef = self._clip_stage(c, j, flat)

        def step() -> None:
            with torch.no_grad():
                for p, g in zip(params, flat.split([p.numel() for p in params])):
                    p.grad = g.view_as(p) if coef is None else g.view_as(p) * coef
                self.lr.apply(self._lr_scale(c))
                with label("quietsync/optimizer_step"):
                    self.optimizer.step()
                for p in params:
                    p.grad = None

        self.versions.update(c, j, step)
        self._refresh_param_ptrs()
        self._updates[c] += 1

    def _clip_stage(self, c: int, j: int, flat: torch.Tensor) -> float | None:
        """With ``max_grad_norm``: the factor that clips stage ``j``'s mean gradient of cycle ``c`` by **its own**
        norm (a stage is updated before the other stages' gradients exist, so the global norm is never known
        in time); None when it needs no clipping. Every worker applies the same gradient (the distribution chain
        passes it unchanged), so every worker takes the same decision. The norm is kept for the step's
        metrics."""
        if self.max_grad_norm is None:
            return None
        norm = float(torch.linalg.vector_norm(flat, dtype=torch.float32))
        self._stage_norms[c][j] = norm
        coef = self.max_grad_norm / (norm + CLIP_EPS)
        return coef if math.isfinite(coef) and coef < 1.0 else None

    # ------------------------------------------------------------------ contract
    def _step(self) -> bool:
        if not self._pending_commits:
            return False
        for c in self._pending_commits:
            extra: dict[str, Any] = {"cycle": c}
            norms = self._stage_norms.pop(c, None)
            if norms is not None:
                per_stage = [norms[j] for j in range(self.n)]
                extra["grad_norm_per_stage"] = per_stage
                extra["grad_norm"] = math.sqrt(sum(x * x for x in per_stage))
            self._commit(extra, self.n // self.world_size)
        self._pending_commits = []
        return True

    @contextmanager
    def committed_params(self) -> Iterator[nn.Module]:
        """The model holds θ_steps on every stage inside (a stage already updated past it shows its previous
        version)."""
        with self.versions.committed(self.steps) if self.plan is not None else nullcontext():
            yield self.module

    def activation_timeline(self) -> list:
        """``ActivationMeter`` samples, one per time step (with ``measure_activations``)."""
        return [] if self.meter is None else list(self.meter.timeline)

    def _is_parameter(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._param_ptrs

    def _refresh_param_ptrs(self) -> None:
        if getattr(self, "meter", None) is None:
            return
        ptrs = {p.untyped_storage().data_ptr() for p in self.module.parameters()}
        if self.plan is not None:
            ptrs |= self.versions.storages()
        for mb in self._inflight.values():
            ptrs.update(x.untyped_storage().data_ptr() for x in mb.leaves.values())
        self._param_ptrs = ptrs

    @property
    def _dtype(self) -> torch.dtype:
        return next(iter(self.module.parameters())).dtype

    @property
    def _device(self) -> torch.device:
        return next(iter(self.module.parameters())).device

    def _position(self) -> dict[str, int]:
        return {"time_step": self.t, "fed": self.fed}

    def _memory(self) -> dict[str, int]:
        inflight = sum(g.numel() * g.element_size() for g in self._own.values())
        inflight += sum(g.numel() * g.element_size() for g in self._partial.values())
        return {"params": sum(p.numel() * p.element_size() for p in self.module.parameters()),
                "gradient_partials": inflight}

    def _state(self) -> dict[str, Any]:
        if self._inflight or self._own or self._partial or self.mailbox.busy:
            raise RuntimeError(
                "cdp: state_dict() with micro-batches in flight is not supported; checkpoint before "
                "the first forward_backward or after close-out (not implemented)"
            )
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def _load_state(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def _finish(self, sync: bool) -> None:
        """Micro-batches in flight are dropped (:meth:`_wind_down`) and every stage holds θ_steps for good (a stage
        updated past it goes back to its kept previous version)."""
        self._wind_down()
        if self.plan is None:
            return
        self.versions.settle(self.steps)
        self._refresh_param_ptrs()

    def _wind_down(self) -> None:
        """Every worker left its loop after the same number of calls, so at the same time step ``t``: every
        message sent before ``t - 1`` was received by a peer in its loop, and its send is completed (so metered);
        the sends of ``t - 1`` are received by nobody. Micro-batches in flight are dropped. Once per strategy
        (finish or close, whichever comes first)."""
        if self._wound_down:
            return
        self._wound_down = True
        self.mailbox.wind_down(self.t)
        self._inflight.clear()
        self._own.clear()
        self._partial.clear()
        self._done_losses = []

    def _close(self) -> None:
        """:meth:`_wind_down` (if :meth:`finish` did not), then the sends of the last time step, which nobody
        receives, are dropped; when this strategy owns its transport, one barrier first keeps the groups alive
        until every peer is done (the trainer passes its transport and ends with its own all-reduce of the
        totals, which does the same)."""
        self._wind_down()
        if self._owns_transport and self.world_size > 1:
            self.transport.barrier()  # then the mailbox, closed after this, drops what nobody will complete
