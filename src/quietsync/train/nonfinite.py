"""The trainer's non-finite policy (``--on-nonfinite stop|skip``): a NaN or infinite loss or gradient never
becomes a committed step, a checkpoint, an exported model or a silent exit 0.

Where it is checked depends on when a strategy commits:

* **Strategies that commit a round of local micro-batches** (``Strategy.discards_rounds``: ddp, zero1, fsdp,
  demo, flexdemo, localsgd, diloco, hierarchical diloco included). Each micro-batch's loss is noted (on its
  device, no sync); when the round is full (the next ``step()`` commits) the round's loss flag and this
  worker's gradients (``p.grad``) are checked, before anything of the round commits. Then:

  - ``skip``, and ``stop`` for strategies whose every step communicates anyway (ddp, zero1, fsdp, demo,
    flexdemo): the workers **agree** — one all-reduce of one flag per rank on the transport's control group
    (``Transport.agree_rows``; not link-emulated, not counted in the bytes; its wait counts as idle time) — so every
    worker takes the same decision: ``stop`` raises :class:`NonFiniteError` on every worker naming the step
    and the ranks; ``skip`` drops the round on every worker (``Strategy.discard_round``: no commit, the lr
    schedule does not advance, the run still ends after ``--max-steps`` committed steps) and stops after
    ``limit`` non-finite rounds in a row. ``skip`` must agree on every round whatever the strategy: a round
    dropped on one worker only would put the workers' step counts (and syncs) out of step.
  - ``stop`` for local methods (``Strategy.local_rounds``: localsgd, diloco — plain, streaming, low-bit,
    SparseLoCo, hierarchical): no agreement. Their inner steps are local and their workers meet only every H
    steps, so a per-round agreement would be a cross-node round trip on every inner step — exactly what these
    methods exist to avoid (measured: docs/train.md, "Non-finite values"). The worker that saw the value
    raises at once, before its ``step()`` commits anything; its peers go on with their own (finite) local
    steps and fail on their next collective — the next sync, or the agreement before a checkpoint or at the
    end of the run, so none of them saves, exports or exits 0 — and the launcher (or torchrun) stops them
    as soon as the first worker failed, naming it; the transport's timeout is the backstop.
* **Strategies that commit inside their step or their own schedule** (acco, dpu, wp, cdp): after every
  micro-batch its loss and this worker's gradients (``p.grad``, where the strategy accumulates there: acco,
  dpu, wp) are checked on that worker, which raises at once; its peers fail on their next collective and the
  launcher names this worker (the first failure). No agreement collective is added: it would put a barrier
  into ACCO's overlap (whose workers feed different numbers of micro-batches) and deadlock CDP, whose workers
  commit at different time steps. For acco, dpu and wp this is before the micro-batch's gradient is handed
  to the communication worker, so nothing non-finite is committed anywhere; CDP applies a stage's gradient
  inside ``forward_backward``, so there the check comes after the micro-batch's stage updates (the run still
  stops, and nothing is saved or exported). ``skip`` is refused for them at parse time.

Under ``--precision fp16`` gradients are not checked here: dynamic loss scaling expects some rounds to overflow
and the strategy itself drops them on every worker (``StepMetrics.extra["overflow_skips"]``); losses still are.

Whatever the strategy, a checkpoint is only written when every floating value of every worker's state is
finite, and the run only ends successfully (summary, exported model) when the committed parameters are; both
checks are agreed across workers, so all of them stop together.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

POLICIES = ("stop", "skip")
"""Values of ``--on-nonfinite``."""

LOSS, GRADIENT = 1, 2
"""What a worker reports in the agreement (0: nothing non-finite)."""
WHAT = {LOSS: "loss", GRADIENT: "gradient"}
"""Words for the codes in messages."""


class NonFiniteError(RuntimeError):
    """A non-finite loss, gradient or state under ``--on-nonfinite stop`` (or past the skip limit)."""


def _sum(t: torch.Tensor) -> torch.Tensor:
    # half precision summed in fp32: an fp16 sum of finite values overflows easily (max 65504)
    return t.sum(dtype=torch.float32) if t.dtype in (torch.float16, torch.bfloat16) else t.sum().float()


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite. Fast path: a tensor's sum is finite only if all its
    elements are (one reduction each, one host sync); when a sum is not finite, finite values may have
    overflowed it, so the exact element-wise check decides."""
    if not tensors:
        return True
    if bool(torch.isfinite(torch.stack([_sum(t) for t in tensors])).all()):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This worker's part of ``t``: the local shard of a DTensor (FSDP2's parameters and gradients), whose own
    reductions would be collectives — and ranks take different paths through :func:`_all_finite`."""
    return t.to_local() if hasattr(t, "to_local") else t


def gradients_finite(module: torch.nn.Module) -> bool:
    """Whether every ``p.grad`` of ``module`` is finite (missing gradients count as finite; a sharded gradient
    is checked on this worker's shard)."""
    return _all_finite([_local(p.grad.detach()) for p in module.parameters() if p.grad is not None])


def parameters_finite(module: torch.nn.Module) -> bool:
    """Whether every parameter of ``module`` is finite (a sharded one on this worker's shard)."""
    return _all_finite([_local(p.detach()) for p in module.parameters()])


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, value


def nonfinite_entries(state: Any, limit: int = 3) -> list[str]:
    """Paths (``parts.sharded.optimizer.state[0].exp_avg``) of the first ``limit`` floating tensors or floats
    in a nested state dict that hold a NaN or an infinity; ``[]`` when all are finite."""
    bad = []
    for path, v in _leaves(state, ""):
        if isinstance(v, torch.Tensor):
            finite = not v.is_floating_point() or _all_finite([v.detach()])
        else:
            finite = not isinstance(v, float) or math.isfinite(v)
        if not finite:
            bad.append(path)
            if len(bad) >= limit:
                break
    return bad


class RoundCheck:
    """One round's verdict on one worker: micro-batch losses noted as they come (on their device, no host sync),
    then at the round's end the code — :data:`LOSS`, :data:`GRADIENT` (this worker's ``p.grad``) or 0. Shared by
    the trainer's guard and the torchft replica's policy (:mod:`quietsync.train.replica_nonfinite`)."""

    def __init__(self) -> None:
        self._loss_bad: torch.Tensor | None = None

    def see(self, loss: torch.Tensor | None) -> None:
        if loss is not None:
            bad = ~torch.isfinite(loss.detach()).all()
            self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def close(self, module: torch.nn.Module, check_gradients: bool = True) -> int:
        """The round's code (one host sync), and a fresh round begins."""
        bad, self._loss_bad = self._loss_bad, None
        if bad is not None and bool(bad):
            return LOSS
        if check_gradients and not gradients_finite(module):
            return GRADIENT
        return 0


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


class NonFiniteGuard:
    """Applies the policy around one worker's ``forward_backward`` / ``step`` loop (see the module docstring).

    Every worker of the job must build one and call :meth:`check_state` and :meth:`check_parameters` at the same points.

    Args:
        policy: ``"stop"`` or ``"skip"``.
        strategy: the worker's strategy.
        limit: with ``skip``, the most non-finite rounds in a row that are skipped; the next one stops.
    """

    def __init__(self, policy: str, strategy: Any, limit: int = 10) -> None:
        if policy not in POLICIES:
            raise ValueError(f"--on-nonfinite must be one of {', '.join(POLICIES)}, got {policy!r}")
        if policy == "skip" and not strategy.discards_rounds:
            raise ValueError(f"--on-nonfinite skip is not supported by {type(strategy).__name__}: it commits inside "
                             "its step, so a round cannot be dropped before it commits; use stop")
        self.policy = policy
        self.strategy = strategy
        self.limit = limit
        self.per_round = bool(strategy.discards_rounds)
        """Whether each round is checked before it commits (else each micro-batch, after it is fed)."""
        self.agrees = self.per_round and (policy == "skip" or not strategy.local_rounds)
        """Whether the workers agree on each round before it commits (else the worker that saw a non-finite
        value raises alone: ``stop`` under a strategy with ``local_rounds``, see the module docstring)."""
        precision = getattr(strategy, "precision", None)
        self.checks_gradients = getattr(precision, "name", "fp32") != "fp16"
        """Whether gradients are checked: not under fp16, whose loss scaling expects overflowing gradients and
        drops those rounds itself, on every worker (losses are still checked)."""
        self.skipped = 0
        """Rounds dropped so far."""
        self.skipped_since_commit = 0
        self._consecutive = 0
        self._round = RoundCheck()  # this round's micro-batch losses: any non-finite (on device)

    # ------------------------------------------------------------------ the step loop
    def see(self, loss: torch.Tensor | None) -> None:
        """After each ``forward_backward``: note a non-finite micro-batch loss (strategies checked per round) or,
        for strategies that commit inside the step, raise on a non-finite loss or gradient."""
        if self.per_round:
            self._round.see(loss)
            return
        code = 0
        if loss is not None and not _all_finite([loss.detach()]):
            code = LOSS
        elif self.checks_gradients and not gradients_finite(self.strategy.module):
            code = GRADIENT
        if code:
            raise NonFiniteError(f"non-finite {WHAT[code]} in step {self.strategy.steps + 1} on rank "
                                 f"{self.strategy.rank} (--on-nonfinite stop)")

    def before_step(self) -> bool:
        """Before each ``step()``: when it would commit, check the round (agreed across workers, or on this
        worker alone: :attr:`agrees`) and apply the policy. Returns True when the round was dropped (do not call
        ``step()``)."""
        if not self.per_round or self.strategy.round_closes is not True:
            return False
        code = self._round.close(self.strategy.module, self.checks_gradients)
        if self.agrees:
            codes = self.agree(code, idle=True)
        else:  # stop, local rounds: raise here, alone; the peers fail on their next collective
            codes = [code if r == self.strategy.rank else 0 for r in range(self.strategy.world_size)]
        if not any(codes):
            self._consecutive = 0
            return False
        step = self.strategy.steps + 1  # the step this round would have committed
        ranks = [r for r, c in enumerate(codes) if c]
        what = " or ".join(WHAT[c] for c in sorted({c for c in codes if c}))
        where = f"non-finite {what} in step {step} on {_ranks(ranks)}"
        if self.policy == "stop":
            # alone: its peers may have committed their own (finite) step
            committed = "was committed" if self.agrees else f"was committed on {_ranks(ranks)}"
            raise NonFiniteError(f"{where} (--on-nonfinite stop); nothing of step {step} {committed}")
        self._consecutive += 1
        if self._consecutive > self.limit:
            raise NonFiniteError(f"{where}: {self._consecutive} rounds in a row (--on-nonfinite skip gives up "
                                 f"after {self.limit}, --nonfinite-skip-limit); nothing of step {step} was committed")
        self.strategy.discard_round()
        self.skipped += 1
        self.skipped_since_commit += 1
        return True

    def committed(self) -> int:
        """After a committed step: the rounds skipped before it (reset)."""
        n, self.skipped_since_commit = self.skipped_since_commit, 0
        return n

    # ------------------------------------------------------------------ checkpoints and the end of the run
    def check_state(self, state: dict[str, Any], step: int) -> None:
        """Before writing a checkpoint of ``state`` (this worker's): raise on every worker, naming the ranks
        and the first non-finite entries, when any worker's state holds a NaN or an infinity. Call it inside
        ``strategy.paused()``, like the save."""
        bad = nonfinite_entries(state)
        codes = self.agree(1 if bad else 0)
        if any(codes):
            ranks = [r for r, c in enumerate(codes) if c]
            mine = f" (here: {', '.join(bad)})" if bad else ""
            raise NonFiniteError(f"the state after step {step} is not finite on {_ranks(ranks)}{mine}; "
                                 "no checkpoint of it is written")

    def check_parameters(self, also: Callable[[torch.nn.Module], list[float]] | None = None) -> list[list[float]]:
        """At the end of the run: raise on every worker when the committed parameters are not finite on any
        (the optimizer step itself can overflow, e.g. a huge ``--lr`` times the weight decay). ``also``: numbers of
        the committed parameters that ride along in the same agreement (the replica check,
        :mod:`quietsync.train.replicas`); returned, every worker's by rank."""
        strategy = self.strategy
        with strategy.paused():
            with strategy.committed_params() as module:
                ok = parameters_finite(module)
                extra = also(module) if also is not None else []
            rows = strategy.transport.agree_rows([0 if ok else 1, *extra])
        codes = [int(r[0]) for r in rows]
        if any(codes):
            ranks = [r for r, c in enumerate(codes) if c]
            raise NonFiniteError(f"the committed parameters after step {strategy.steps} are not finite on "
                                 f"{_ranks(ranks)}; the run is not exported")
        return [r[1:] for r in rows]

    def agree(self, code: int, idle: bool = False) -> list[int]:
        """Every worker's ``code`` (0: all finite), by rank; every worker gets the same list. With ``idle`` its
        wait counts as the strategy's idle time (in the step loop; elsewhere the caller pauses the accounting)."""
        transport = self.strategy.transport
        if idle:
            with self.strategy.waiting("nonfinite_agree"):
                rows = transport.agree_rows([code])
        else:
            rows = transport.agree_rows([code])
        return [int(r[0]) for r in rows]

    def close(self) -> None:
        """Nothing of its own to tear down: its agreements ran on the transport's control group."""
