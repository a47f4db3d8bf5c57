"""Deterministic failures for tests and benchmarks: a replica process kills itself (``SIGKILL``, as ``kill -9``
does: no clean-up, its connections closed by the kernel) at a named point of the torchft protocol.

``QUIETSYNC_FT_KILL=POINT:N`` in a replica process's environment kills it the N-th time it reaches ``POINT``:

* ``exchange`` -- inside a collective over the replicas, after it was issued on the peers' side (they are waiting
  in it: "mid-step" for ddp/zero1/demo, "mid-outer-sync" for localsgd/diloco);
* ``heal_send`` -- while sending its state to a replica that heals from it (after the length, before the bytes);
* ``step`` -- after the N-th step's micro-batches were computed, before its exchange.

``QUIETSYNC_FT_KILL_GROUP=K`` confines ``QUIETSYNC_FT_KILL`` to replica group K under the local launcher
(``--nodes`` groups on one machine), which hands its environment to every group it starts
(:func:`group_environment`): the others never see the kill. Each incarnation of group K counts afresh, so one
started again dies again at the same point (a test runs it out of ``--replica-restarts``).

``QUIETSYNC_FT_HOLD=step:N:PATH`` (several, comma-separated) makes a replica wait at the top of its N-th step
(before the step's quorum; N = 0: before its first quorum) until the file ``PATH`` exists (at most
:data:`HOLD_LIMIT_S`): a test starts every replica in the first quorum, or holds the survivors until a restarted
replica is up, so the run cannot end before it rejoins, whatever the machine's load. ``heal_send:N:PATH`` holds a
heal source the N-th time it sends its state (after the length, before the bytes: the joiner waits in the
transfer). A replica that reaches a hold creates ``PATH.waiting`` first, so a test acts once it is there.

``QUIETSYNC_FT_HOLD_GROUP=K`` confines ``QUIETSYNC_FT_HOLD`` to replica group K under the local launcher, as
``QUIETSYNC_FT_KILL_GROUP`` does the kill: one replica group hangs at a step -- its main thread waits, its heartbeats
go on, as a stuck data loader's would -- while the others run.

``QUIETSYNC_FT_READY=PATH`` makes a replica create the file ``PATH`` when it is about to ask for its first quorum
(its model and strategy built): a test releases the survivors once a restarted replica is there, not merely
started.

``QUIETSYNC_FT_NONFINITE=WHAT:N`` (``loss`` or ``gradient``) makes the first micro-batch of a replica's N-th step
(the first time it computes it) non-finite: its loss times NaN (the gradients stay finite), or its gradients
(``p.grad``) times NaN -- what ``--on-nonfinite`` must catch before the step commits.

``QUIETSYNC_PAUSE=N:DIR`` makes each worker of ``quietsync train`` (a fixed or torchrun world), once its N-th step
is committed and saved, write its pid to ``DIR/rank{R}.pid`` and wait until ``DIR/go-rank{R}`` exists (at most
:data:`HOLD_LIMIT_S`): a test knows which process is which worker, and signals one at a known point of the run
while the others wait there, whatever the machine's load.

``QUIETSYNC_KILL_MID_WRITE=RANK:STEP:MARKER`` makes the worker of rank ``RANK`` (a fixed or torchrun world), once it
has written its rank file of the checkpoint of step ``STEP`` under its temporary name, cut that file to half its
bytes and die (``SIGKILL``), as a worker killed in the middle of the write leaves it; it first creates the file
``MARKER``, and does nothing where ``MARKER`` exists, so the worker restarted in its place writes that checkpoint
whole.

``QUIETSYNC_FLIP_BIT=RANK:STEP[:MARKER]`` makes the worker of rank ``RANK`` (any world), once its step ``STEP`` is
committed, flip one bit of its parameters, as a memory error would: what the replica check
(``--check-replicas-every``) must name. With ``MARKER`` it first creates that file, and does nothing where it exists:
a run restarted from an earlier checkpoint passes that step again without the error.

Nothing happens without the variables (one dictionary lookup per point).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

KILL_ENV = "QUIETSYNC_FT_KILL"
KILL_GROUP_ENV = "QUIETSYNC_FT_KILL_GROUP"
HOLD_ENV = "QUIETSYNC_FT_HOLD"
HOLD_GROUP_ENV = "QUIETSYNC_FT_HOLD_GROUP"
READY_ENV = "QUIETSYNC_FT_READY"
NONFINITE_ENV = "QUIETSYNC_FT_NONFINITE"
PAUSE_ENV = "QUIETSYNC_PAUSE"
MID_WRITE_ENV = "QUIETSYNC_KILL_MID_WRITE"
FLIP_ENV = "QUIETSYNC_FLIP_BIT"
HOLD_LIMIT_S = 300.0
POINTS = ("exchange", "heal_send", "step")
HOLD_POINTS = ("step", "heal_send")

_counts: dict[str, int] = {}


def _target() -> tuple[str, int] | None:
    spec = os.environ.get(KILL_ENV, "")
    if not spec:
        return None
    point, _, count = spec.partition(":")
    if point not in POINTS or not count.isdigit() or int(count) < 1:
        raise ValueError(f"{KILL_ENV} must be POINT:N with POINT in {', '.join(POINTS)} and N >= 1, got {spec!r}")
    return point, int(count)


def reached(point: str) -> None:
    """Count ``point``; if it is the configured one, the N-th time, die at once with SIGKILL."""
    target = _target()
    if target is None or target[0] != point:
        return
    _counts[point] = _counts.get(point, 0) + 1
    if _counts[point] == target[1]:
        os.kill(os.getpid(), signal.SIGKILL)


def group_environment(environ: dict[str, str], group: int) -> dict[str, str]:
    """The environment the local launcher gives replica group ``group``: ``environ``, less ``QUIETSYNC_FT_KILL``
    where ``QUIETSYNC_FT_KILL_GROUP`` names another group, and less ``QUIETSYNC_FT_HOLD`` where
    ``QUIETSYNC_FT_HOLD_GROUP`` does."""
    out = environ
    for confine, confined in ((KILL_GROUP_ENV, KILL_ENV), (HOLD_GROUP_ENV, HOLD_ENV)):
        only = environ.get(confine, "")
        if not only:
            continue
        if not only.isdigit():
            raise ValueError(f"{confine} must be a replica group's index, got {only!r}")
        if int(only) != group:
            out = {k: v for k, v in out.items() if k != confined}
    return out


def reached_heal_send() -> None:
    """A heal source is about to send its state: count it, hold there if configured, die there if configured."""
    # a count of its own: reached() counts a point only when a kill targets it
    _counts["hold:heal_send"] = _counts.get("hold:heal_send", 0) + 1
    if os.environ.get(HOLD_ENV):
        hold(_counts["hold:heal_send"], "heal_send")
    reached("heal_send")


def hold(step: int, point: str = "step") -> None:
    """At the top of step ``step`` (1-based; 0: before joining the first quorum), or the ``step``-th time a heal
    source sends (``point="heal_send"``), wait for the file of a configured hold there
    (``QUIETSYNC_FT_HOLD=step:N:PATH[,heal_send:M:PATH2...]``), after creating ``PATH.waiting``."""
    spec = os.environ.get(HOLD_ENV, "")
    for part in filter(None, spec.split(",")):
        kind, _, rest = part.partition(":")
        count, _, path = rest.partition(":")
        if kind not in HOLD_POINTS or not count.isdigit() or not path:
            raise ValueError(f"{HOLD_ENV} must be POINT:N:PATH[,POINT:M:PATH...] with POINT in "
                             f"{', '.join(HOLD_POINTS)}, got {spec!r}")
        if kind != point or step != int(count):
            continue
        with open(path + ".waiting", "a"):
            pass
        deadline = time.monotonic() + HOLD_LIMIT_S  # bounded: a test that never releases it cannot hang the replica
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)


def pause(step: int, rank: int) -> None:
    """After committed step ``step`` (and its checkpoint): if ``QUIETSYNC_PAUSE=N:DIR`` names this step, write this
    process's pid to ``DIR/rank{rank}.pid`` (whole: written, then renamed) and wait for ``DIR/go-rank{rank}``."""
    spec = os.environ.get(PAUSE_ENV, "")
    if not spec:
        return
    count, _, folder = spec.partition(":")
    if not count.isdigit() or not folder:
        raise ValueError(f"{PAUSE_ENV} must be N:DIR (a step and a folder), got {spec!r}")
    if step != int(count):
        return
    part = os.path.join(folder, f".rank{rank}.pid")
    with open(part, "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(part, os.path.join(folder, f"rank{rank}.pid"))
    go = os.path.join(folder, f"go-rank{rank}")
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.05)


def mid_write(tmp: str | os.PathLike, step: int, rank: int) -> None:
    """``tmp`` holds this worker's whole rank file of step ``step``: if ``QUIETSYNC_KILL_MID_WRITE`` names this
    rank and step (and its marker is not there yet), leave the file half-written and die with SIGKILL."""
    spec = os.environ.get(MID_WRITE_ENV, "")
    if not spec:
        return
    who, _, rest = spec.partition(":")
    when, _, marker = rest.partition(":")
    if not who.isdigit() or not when.isdigit() or not marker:
        raise ValueError(f"{MID_WRITE_ENV} must be RANK:STEP:MARKER, got {spec!r}")
    if (int(who), int(when)) != (rank, step) or os.path.exists(marker):
        return
    with open(marker, "a"):
        pass
    os.truncate(tmp, os.path.getsize(tmp) // 2)
    os.kill(os.getpid(), signal.SIGKILL)


def flip_bit(step: int, rank: int, module: Any) -> None:
    """After committed step ``step``: if ``QUIETSYNC_FLIP_BIT=RANK:STEP[:MARKER]`` names this worker and step (and its
    marker is not there yet), flip bit 5 of the first element of ``module``'s first parameter (the live one), as a
    memory error would."""
    spec = os.environ.get(FLIP_ENV, "")
    if not spec:
        return
    who, _, rest = spec.partition(":")
    when, _, marker = rest.partition(":")
    if not who.isdigit() or not when.isdigit():
        raise ValueError(f"{FLIP_ENV} must be RANK:STEP or RANK:STEP:MARKER, got {spec!r}")
    if (int(who), int(when)) != (rank, step) or (marker and os.path.exists(marker)):
        return
    if marker:
        with open(marker, "a"):
            pass
    import torch  # here: the other points are read where torch is not imported

    p = next(module.parameters())
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[p.element_size()]
    with torch.no_grad():
        p.data.view(-1)[:1].view(bits).bitwise_xor_(1 << 5)


def ready() -> None:
    """About to ask for the first quorum: create the file named by ``QUIETSYNC_FT_READY``, if set."""
    path = os.environ.get(READY_ENV)
    if path:
        with open(path, "a"):
            pass


def poison(step: int, loss: Any, module: Any) -> Any:
    """The first time the first micro-batch of step ``step`` is computed, make it non-finite as
    ``QUIETSYNC_FT_NONFINITE=WHAT:N`` says (N = ``step``); returns the loss (times NaN for ``loss``)."""
    spec = os.environ.get(NONFINITE_ENV, "")
    if not spec:
        return loss
    what, _, count = spec.partition(":")
    if what not in ("loss", "gradient") or not count.isdigit() or int(count) < 1:
        raise ValueError(f"{NONFINITE_ENV} must be loss:N or gradient:N with N >= 1, got {spec!r}")
    # once per process: a dropped round (--on-nonfinite skip) is computed again under the same step number
    if step != int(count) or _counts.get(NONFINITE_ENV):
        return loss
    _counts[NONFINITE_ENV] = 1
    if what == "loss":
        return loss * float("nan")
    for p in module.parameters():
        if p.grad is not None:
            p.grad.mul_(float("nan"))
    return loss


__all__ = ["HOLD_ENV", "HOLD_GROUP_ENV", "HOLD_LIMIT_S", "HOLD_POINTS", "KILL_ENV", "KILL_GROUP_ENV", "NONFINITE_ENV",
           "PAUSE_ENV", "POINTS", "READY_ENV", "group_environment", "hold", "pause", "poison", "reached",
           "reached_heal_send", "ready"]
