"""``--on-nonfinite stop|skip`` under ``--fault-tolerance torchft``: a NaN or infinite loss or gradient never
becomes a committed step or an exported model, on any replica.

The plain trainer's contract (:mod:`quietsync.train.nonfinite`), kept with torchft's commit protocol:

* **Each replica checks its own round** before it steps: the round's micro-batch losses and this worker's
  gradients (``p.grad``), as the plain trainer does (gradients are not checked under fp16, which torchft mode
  refuses anyway). With several workers in a replica group they agree inside the group (one all-reduce of a flag,
  as the plain trainer's guard does), so the group has one verdict.
* **The replicas agree at the commit vote.** A finite round steps as usual; a round that is not finite does not
  step: its replica runs the vote at once (:meth:`~quietsync.faults.quorum.ReplicaQuorum.vote`). Every unit the
  quorum commits begins with that vote, so the others learn it at their next unit -- the step's gradient average
  (ddp, zero1, demo, flexdemo: the same step) or the next outer sync (localsgd, diloco: up to ``H`` inner steps
  later; the replica that saw it waits in the vote meanwhile, at most ``--timeout-s``). No replica runs the
  unit's collectives, each reports the error to torchft (``report_error``) so its ``should_commit`` is False, and
  every replica gets the same :class:`~quietsync.faults.quorum.RoundDropped`.
* **stop**: every replica raises :class:`~quietsync.train.nonfinite.NonFiniteError` naming the step and the
  replica group(s); its process exits with :data:`NONFINITE_EXIT`, which the local launcher does not restart
  (a restarted replica would heal and train into the same values again).
* **skip** (ddp and zero1: their step's first exchange comes before any state changes, so a dropped round leaves
  nothing behind): every replica drops the round (``Strategy.discard_round``: no commit, the lr schedule does not
  advance); its data windows are given back and dealt again, the window dealer's rule for an uncommitted step
  (:meth:`~quietsync.train.window_dealer.WindowDealer.drop`); after ``--nonfinite-skip-limit`` dropped rounds in a
  row the next one stops as above. demo and flexdemo fold the round's gradient into their decoupled momentum
  before their exchange, localsgd and diloco take their inner steps alone between commits: a round dropped at
  the vote would leave the other replicas' share of it behind, so ``skip`` is refused for them.

At the end of the run the committed parameters are checked on every replica and agreed with the run's totals
(:func:`finite_and_fingerprint`): a run whose parameters are not finite stops before its summary and export. torchft
runs write no checkpoints (``--save-every`` is refused).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import cause_chain
from ..faults.quorum import ReplicaQuorum, RoundDropped
from .nonfinite import WHAT, NonFiniteError, RoundCheck, parameters_finite
from .replicas import fingerprint_of

NONFINITE_EXIT = 3
"""Exit status of a replica group's process (and of the local launcher) stopped by a non-finite value."""


class ReplicaNonFinite:
    """The policy around one worker's step loop under torchft (module docstring).

    Args:
        policy: ``"stop"`` or ``"skip"``.
        strategy: the worker's strategy.
        quorum: the worker's quorum (its vote carries the verdict).
        limit: with ``skip``, the most rounds in a row that are dropped; the next one stops.
    """

    def __init__(self, policy: str, strategy: Any, quorum: ReplicaQuorum, limit: int = 10) -> None:
        self.policy, self.strategy, self.quorum, self.limit = policy, strategy, quorum, int(limit)
        self.skipped = 0
        """Rounds dropped so far (by this replica's count: those it took part in)."""
        self.skipped_since_logged = 0
        self._consecutive = 0
        self._round = RoundCheck()

    def see(self, loss: torch.Tensor | None) -> None:
        """After each micro-batch: note whether its loss is finite (on its device, no sync)."""
        self._round.see(loss)

    def round_finite(self) -> bool:
        """Before the round's ``step()``: whether the round is finite in the whole replica group. When it is not,
        the verdict is set for the vote and the caller runs :meth:`vote` instead of stepping."""
        code = self._round.close(self.strategy.module)
        transport = self.quorum.transport
        if transport.workers > 1:  # one verdict per replica group (its workers feed different micro-batches)
            flag = torch.tensor([code], dtype=torch.int64, device=transport.device)
            with self.strategy.waiting("nonfinite_agree"):
                transport.all_reduce(flag, "shard", op="max", name="nonfinite_agree")
            code = int(flag)
        if code:
            self.quorum.verdict = (code, self.strategy.steps + 1)
        return not code

    def vote(self) -> None:
        """This replica's round is not finite: meet the others at their next unit (raises
        :class:`RoundDropped` on every replica)."""
        self.quorum.vote()
        raise RuntimeError("the non-finite vote committed")  # unreachable: the verdict drops the unit

    def dropped(self, e: RoundDropped) -> None:
        """Every replica, after the vote found a round that is not finite: raise under ``stop`` (and past the skip
        limit); else drop the open round (the caller gives its windows back)."""
        where = "; ".join(f"non-finite {WHAT.get(code, 'value')} in step {step} on replica group {k}"
                          for k, (code, step) in sorted(e.verdicts.items()))
        if self.policy == "stop":
            raise NonFiniteError(f"{where} (--on-nonfinite stop); no replica committed it") from None
        self._consecutive += 1
        if self._consecutive > self.limit:
            raise NonFiniteError(f"{where}: {self._consecutive} rounds in a row (--on-nonfinite skip gives up after "
                                 f"{self.limit}, --nonfinite-skip-limit); no replica committed it") from None
        self.strategy.discard_round()
        self.skipped += 1
        self.skipped_since_logged += 1

    def committed(self) -> int:
        """After a committed step: the rounds dropped since the last one logged (reset)."""
        self._consecutive = 0
        n, self.skipped_since_logged = self.skipped_since_logged, 0
        return n


def finite_and_fingerprint(strategy: Any) -> tuple[float, list[float]]:
    """1.0 when this worker's committed parameters are not finite, else 0.0 (summed into the run's totals, so
    every replica learns it from the same all-reduce), and their fingerprint
    (:func:`~quietsync.train.replicas.fingerprint_of`: whether the replicas end the same)."""
    with strategy.paused(), strategy.committed_params() as module:
        return 0.0 if parameters_finite(module) else 1.0, fingerprint_of(strategy, module)


def dropped_in(e: BaseException) -> RoundDropped | None:
    """The :class:`RoundDropped` ``e`` is, or was raised from (a unit run on a communication thread)."""
    return next((x for x in cause_chain(e) if isinstance(x, RoundDropped)), None)


__all__ = ["NONFINITE_EXIT", "ReplicaNonFinite", "dropped_in", "finite_and_fingerprint"]
