"""The trainer's non-finite policy (``--on-nonfinite stop|skip``): a NaN or infinite loss or gradient never
becomes a committed step, a checkpoint, or a silent exit 0.

Where it is checked depends on when a strategy commits:

* **Strategies that commit a round of local micro-batches** (``Strategy.discards_rounds``: ddp, zero1, demo,
  flexdemo, localsgd, diloco). Each micro-batch's loss is checked locally; when the round is full (the next
  ``step()`` commits), the round's gradients are checked too and the workers **agree** on one flag per rank
  (a 1-element-per-rank all-reduce on a small gloo group of the trainer's own, not link-emulated, not
  counted as the algorithm's bytes) — so every worker takes the same decision before anything commits:
  ``stop`` raises :class:`NonFiniteError` on every worker naming the step and the ranks; ``skip`` drops the
  round on every worker (``Strategy.discard_round``: no commit, the lr schedule does not advance, the run
  still ends after ``--max-steps`` committed steps) and stops after ``limit`` consecutive skipped rounds.
* **Strategies that commit inside the step or their own schedule** (acco, dpu, wp, cdp): each micro-batch's
  loss is checked locally and a non-finite one raises at once, on that worker, before the micro-batch is
  handed to ``step()``; its peers fail on their next collective and the launcher names this worker (the
  first failure). No agreement collective is added: it would put a barrier into ACCO's overlap and deadlock
  CDP, whose workers commit at different time steps. ``skip`` is refused for them (at parse time).

In both cases nothing of the bad step is committed on the worker that saw it, and the trainer writes no
checkpoint after it (it also refuses to save non-finite parameters, whatever their origin).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

POLICIES = ("stop", "skip")
"""Values of ``--on-nonfinite``."""


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient under ``--on-nonfinite stop`` (or past the skip limit)."""


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def gradients_finite(module: torch.nn.Module) -> bool:
    """Whether every ``p.grad`` of ``module`` is finite (missing gradients count as finite)."""
    return all(_finite(p.grad) for p in module.parameters() if p.grad is not None)


def parameters_finite(module: torch.nn.Module) -> bool:
    """Whether every parameter of ``module`` is finite."""
    return all(_finite(p.detach()) for p in module.parameters())


class NonFiniteGuard:
    """Applies the policy around one worker's ``forward_backward`` / ``step`` loop (see the module docstring).

    Args:
        policy: ``"stop"`` or ``"skip"``.
        strategy: the worker's strategy.
        limit: consecutive skipped rounds after which ``skip`` stops too.
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
        self.skipped = 0
        """Rounds dropped so far."""
        self.skipped_since_commit = 0
        self._consecutive = 0
        self._bad: str | None = None  # what this worker saw since the last decision
        self._group = None
        world = strategy.world_size
        if strategy.discards_rounds and world > 1:
            import torch.distributed as dist

            timeout = datetime.timedelta(seconds=strategy.transport.timeout_s)
            self._group = dist.new_group(list(range(world)), backend="gloo", timeout=timeout)

    def see(self, loss: torch.Tensor | None) -> None:
        """After each ``forward_backward``: note (or, for strategies that commit inside the step, raise on) a
        non-finite micro-batch loss."""
        if loss is None or _finite(loss.detach()):
            return
        if not self.strategy.discards_rounds:
            raise NonFiniteError(
                f"non-finite loss ({float(loss)}) in step {self.strategy.steps + 1} on rank {self.strategy.rank} "
                f"(--on-nonfinite stop); the run stops before the step is committed"
            )
        self._bad = self._bad or f"loss {float(loss)}"

    def before_step(self) -> bool:
        """Before each ``step()``: when it would commit, agree across workers and apply the policy. Returns
        True when the round was dropped (do not call ``step()``)."""
        if self.strategy.round_closes is not True:
            return False
        if self._bad is None and not gradients_finite(self.strategy.module):
            self._bad = "gradient"
        bad_ranks = self._agree()
        self._bad = None
        if not bad_ranks:
            self._consecutive = 0
            return False
        step = self.strategy.steps + 1
        where = f"step {step} on rank{'s' if len(bad_ranks) > 1 else ''} {', '.join(map(str, bad_ranks))}"
        if self.policy == "stop":
            raise NonFiniteError(f"non-finite loss or gradient in {where} (--on-nonfinite stop); nothing of step "
                                 f"{step} was committed")
        self._consecutive += 1
        if self._consecutive > self.limit:
            raise NonFiniteError(f"non-finite loss or gradient in {where}: {self._consecutive} rounds in a row "
                                 f"(--on-nonfinite skip gives up after {self.limit})")
        self.strategy.discard_round()
        self.skipped += 1
        self.skipped_since_commit += 1
        return True

    def committed(self) -> int:
        """After a committed step: the rounds skipped before it (reset)."""
        n, self.skipped_since_commit = self.skipped_since_commit, 0
        return n

    def _agree(self) -> list[int]:
        """Ranks that saw a non-finite value in this round (every worker gets the same list)."""
        me = self.strategy.rank
        if self._group is None:
            return [me] if self._bad is not None else []
        import torch.distributed as dist

        flags = torch.zeros(self.strategy.world_size)
        flags[me] = 1.0 if self._bad is not None else 0.0
        dist.all_reduce(flags, group=self._group)
        return [r for r, f in enumerate(flags.tolist()) if f > 0]

    def close(self) -> None:
        if self._group is not None:
            import torch.distributed as dist

            try:
                dist.destroy_process_group(self._group)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
            self._group = None
