"""Fault tolerance without restarts, on torchft (``--fault-tolerance torchft``; ``pip install 'quietsync[ft]'``).

A job is ``--nodes`` **replica groups** (a node each, ``W`` workers); each is a torchft replica. They meet at the
job's Lighthouse (started by the local launcher, or ``quietsync lighthouse`` on a cluster), which forms a quorum of
the replicas present at every round boundary. When a replica dies, the others go on at their next commit without a
restart and without a reload; when it comes back, it heals from a live peer -- the strategy's state, the data
position, the schedule -- and joins at the next quorum. The modules:

* :mod:`.support` -- which strategies run, and what each does with a missing replica's share (as each declares);
* :mod:`.flags` -- the flag checks, one line each, before any worker starts;
* :mod:`.lighthouse` -- the quorum server (``quietsync lighthouse``);
* :mod:`.replica_group` -- the replicate dimension's process group that torchft reconfigures;
* :mod:`.transport` -- quietsync's transport of one replica group (the replicate dimension metered, emulated,
  committed);
* :mod:`.quorum` -- torchft's Manager and the round/commit/retry protocol;
* :mod:`.peer_checkpoint` -- how a healing replica receives a peer's state (through the transport);
* :mod:`.heal` -- what it takes of the peer's strategy and what it starts empty;
* :mod:`.inject` -- deterministic ``SIGKILL`` points (and holds) for tests and benchmarks.

This package sits between the strategies and the trainer. The trainer's side is in :mod:`quietsync.train`: the
data policy (:mod:`~quietsync.train.window_dealer`: windows dealt to the replicas present, given back when one is
lost), a replica group's worker in the trainer's one loop (:mod:`~quietsync.train.replica_loop`: its set-up and
its membership), its ``--on-nonfinite`` policy
(:mod:`~quietsync.train.replica_nonfinite`: the verdict at the commit vote) and the launchers
(:mod:`~quietsync.train.replica_launch`).

``torchft`` is imported only by the modules that use it (the flag checks and :mod:`.support` need nothing).
"""

import os

os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum and commit at info (read at import)

from .support import policies, refusal, refusals  # noqa: E402

__all__ = ["policies", "refusal", "refusals"]
