"""Who trains, and how the step is dealt and committed: the one interface the training loop asks.

The step loop (:func:`quietsync.train.loop.train_steps`) is written once. What differs between the trainer's
modes is answered by a :class:`Membership`:

* :class:`~quietsync.train.world.FixedWorld` -- a static world (every worker from start to end), and
  :class:`~quietsync.train.world.ElasticWorld` -- torchrun's elastic world (``--elastic``: torchrun restarts the
  whole world at a new size; between restarts the world is fixed, so the step loop runs as in a fixed world and
  only the agreement on where to resume differs);
* :class:`~quietsync.train.replica_loop.TorchftQuorum` -- one replica group under a torchft quorum
  (``--fault-tolerance torchft``: replicas leave and return while the others train).

The questions, in the order the loop asks them (fixed/elastic world | torchft quorum):

* who am I, who prints: ``rank``, rank 0 prints (``speaks``) | the rank in the nominal job; no worker prints
  during the loop (the lead prints the closing line after it);
* a fresh start (the evaluation before step 1): no ``--resume`` | step 0, not healed at the join;
* the position ``--max-steps`` counts: the lr schedule's (a step in flight included) | the window dealer's;
* before a step: nothing | a round start when one is due (joiners heal there);
* the step's micro-batches: the worker's stream, until the strategy commits | the windows dealt for this step;
* the commit: ``--on-nonfinite`` agreed, then ``step()`` | the vote, then ``step()`` (retried among survivors);
  a dropped round's windows are given back and dealt again;
* after a commit: nothing | alone, settle and tick the quorum (a round boundary for joiners);
* the record's own fields: ``windows`` (audit) | members, position, heals, retries, commits, round phases;
* tokens: fed by this worker | the windows the quorum committed;
* after a step: the checkpoint when due | nothing (a returning replica heals from a live peer);
* the run's close: the parameters checked (finite, and the same on every worker) | the totals over the replicas and
  a last round (joiners see the end);
* a failure: named with the newest checkpoint | a vote met outside a step stops every replica.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch

COMMITTED, OPEN, DROPPED = "committed", "open", "dropped"
"""What :meth:`Membership.commit` answers after a micro-batch: the step committed, it is still open (feed the next
micro-batch), or its round was dropped on every worker (``--on-nonfinite skip``: start the step again)."""


"""Placed in :meth:`Membership.micro_batches` for a micro-batch that holds no data of this worker: the loop calls
:meth:`Membership.abstain` instead of a forward/backward (a torchft replica's first step after it healed)."""
ABSTAIN = object()

STEP_SUMS = ("compute_s", "comm_s", "idle_s", "bytes_sent", "bytes_recv")
"""Per-step record keys the loop sums over steps, and every membership over workers, for the summary."""


class Membership(Protocol):
    """What the step loop asks of the mode it runs in (module docstring). One object per worker and run."""

    rank: int
    """This worker's rank in the job (its records' file, its progress bar)."""
    speaks: bool
    """Whether this worker prints during the loop (the start line, evaluations, the progress bar)."""
    fresh: bool
    """Whether the run starts here (then the loop evaluates before the first step)."""
    guard: Any
    """The ``--on-nonfinite`` policy: ``see(loss)`` after each micro-batch, ``committed()`` (the rounds dropped
    since the last committed step) and ``skipped`` (all rounds dropped)."""

    @property
    def ended(self) -> bool:
        """Whether the run ended without this worker (it has nothing left to do: the loop returns None)."""
        ...

    def position(self, strategy: Any) -> float:
        """The steps ``--max-steps`` counts now (a step the strategy has in flight included)."""
        ...

    def begin_step(self, strategy: Any) -> None:
        """Before each step (and before :attr:`ended` and :meth:`position` are read for it)."""
        ...

    def micro_batches(self, strategy: Any) -> Iterator[torch.Tensor]:
        """The micro-batches of the next step, on the host; the loop stops reading when :meth:`commit` answers
        anything but :data:`OPEN`."""
        ...

    def abstain(self, strategy: Any) -> torch.Tensor | None:
        """A micro-batch of :data:`ABSTAIN`: counted in the strategy's open step with nothing computed; its loss."""
        ...

    def fed(self, strategy: Any, index: int, loss: torch.Tensor | None) -> torch.Tensor | None:
        """After micro-batch ``index`` of the step went forward and backward: the loss the loop goes on with."""
        ...

    def commit(self, strategy: Any, index: int) -> str:
        """``strategy.step()`` after micro-batch ``index``, under this mode's commit rules: :data:`COMMITTED`,
        :data:`OPEN` or :data:`DROPPED`."""
        ...

    def after_commit(self, strategy: Any) -> None:
        """Right after a committed step, before it is logged."""
        ...

    def busy(self) -> None:
        """The loop's own long work goes on between steps (after each batch of an evaluation): under torchft, the
        stall watch counts from here, so a long evaluation is not taken for a hang."""
        ...

    def step_tokens(self, fed: int) -> int:
        """The ``tokens`` of the step just committed (``fed``: this worker's tokens fed since the last one)."""
        ...

    def tokens_total(self, fed: int) -> int:
        """The ``tokens_total`` of records and evaluations (``fed``: this worker's tokens fed in the run)."""
        ...

    def record(self, record: dict[str, Any]) -> None:
        """Add this mode's fields to the record of the step just committed."""
        ...

    def finish(self, strategy: Any) -> bool:
        """The run's end on this worker: ``strategy.finish()`` (whether it committed a step)."""
        ...

    def after_step(self, strategy: Any, stopping: bool, tokens_fed: int) -> None:
        """After each committed step's record and evaluation (``stopping``: the run ends with it)."""
        ...

    def close(self, strategy: Any, result: dict[str, Any]) -> dict[str, Any]:
        """After the last step and the final evaluation (``result``: the loop's result so far): what this mode
        adds to it."""
        ...

    def failure(self, error: Exception, strategy: Any) -> Exception | None:
        """The error to raise instead of ``error`` (raised from None), or None to raise ``error`` itself."""
        ...


__all__ = ["ABSTAIN", "COMMITTED", "DROPPED", "OPEN", "STEP_SUMS", "Membership"]
