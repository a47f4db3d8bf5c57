"""Whether the workers end a run with the same committed parameters, bit for bit.

Every strategy commits parameters that are the same on every worker: the replicated ones (a sharded parameter is
each worker's own part and is left out; the built-in strategies gather theirs whole for the check) -- except with
a setting its declaration says keeps them apart (``apart``: ``demo --replicate-every 2``, ``--replicator none``),
where nothing is compared (:func:`fingerprint_of`). At the end of a run each worker takes a fingerprint of its committed
parameters (:func:`fingerprint_row`), and the fingerprints cross in the agreement that already checks that they are
finite (:meth:`~quietsync.train.nonfinite.NonFiniteGuard.check_parameters`): a few numbers per worker, no extra
collective.
:func:`verdict` says which workers differ from the others.

They differ when a worker's memory or arithmetic went wrong (a flipped bit that nothing else noticed), or when the
workers' math libraries round differently: on CPUs of two vendors, MKL's vector ``sqrt`` (in AdamW) differs in the
last bit, so DDP's replicas do; GPUs of two generations can do the same in their matrix products. The run then says
which ranks differ, and its summary records it; its checkpoint and export are rank 0's, as always.

``--check-replicas-every N`` runs the same check every N committed steps, and ``--on-replicas-differ stop`` stops
every worker at a check that finds a difference (:class:`ReplicasDiffer`). Under torchft the fingerprints ride in the
all-reduce of the run's totals instead, each at its worker's slot of the nominal job (:func:`slots`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

_MODULUS = 2**52 - 47
"""The fingerprint's numbers are taken modulo this prime, below 2**53 so that they cross the control group's float64
exactly, and odd so that no change of one bit (a power of two times a parameter's place) is a multiple of it."""

_CHUNK = 2**24
"""Elements summed at a time: the products' temporary stays at most 128 MiB."""

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}
"""The integer type that reads a parameter's bits for the sums: at most 32 bits wide (an 8-byte element as two), so
that a chunk's sum in int64 is exact and any one changed bit changes it."""


def _replicated(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as a plain tensor when every worker holds all of it (a DTensor only when replicated), else None."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return t
    if all(p.is_replicate() for p in placements):
        return t.to_local()
    return None


def fingerprint_row(module: torch.nn.Module) -> list[float]:
    """Two numbers of the replicated parameters' bits (read as integers of at most 32 bits) -- ``sum_i (i + 1) *
    sum(bits_i)`` over the parameters ``i``, exact, and ``sum_i sum(bits_i * (bits_i >> 7))``, whose products wrap,
    both modulo a prime below 2**52 -- so that any one changed bit changes the first; ``[-1, -1]`` when no parameter is
    replicated (a fully sharded model). The sums stay on the parameters' device until one copy to the host."""
    firsts: list[torch.Tensor] = []
    seconds: list[torch.Tensor] = []
    weights: list[int] = []
    for i, p in enumerate(module.parameters()):
        t = _replicated(p.detach())
        if t is None or t.element_size() not in _BITS:
            continue
        bits = t.contiguous().view(_BITS[t.element_size()]).reshape(-1)
        for part in bits.split(_CHUNK):  # a bounded temporary, even for a large embedding on a full GPU
            firsts.append(part.sum(dtype=torch.int64))
            seconds.append((part * (part >> 7)).sum(dtype=torch.int64))  # wraps: still the same on equal bits
            weights.append(i + 1)
    if not firsts:
        return [-1.0, -1.0]
    device = firsts[0].device
    sums = torch.stack([x.to(device) for x in firsts + seconds]).tolist()  # one host copy, not two per parameter
    first = sum(w * x for w, x in zip(weights, sums[: len(weights)]))
    return [float(first % _MODULUS), float(sum(sums[len(weights):]) % _MODULUS)]


def apart(strategy: Any) -> str | None:
    """Why ``strategy``'s workers hold parameters of their own with its config (its declaration's ``apart``: e.g.
    ``demo --replicate-every 2``), so there is nothing to compare; None when every worker commits the same ones."""
    rule = type(strategy).declaration.apart
    return rule(strategy.config) if rule is not None else None


def fingerprint_of(strategy: Any, module: torch.nn.Module) -> list[float]:
    """:func:`fingerprint_row` of ``strategy``'s committed ``module``, or the row of nothing replicated (``[-1, -1]``,
    so nothing is compared) where its setting keeps the workers' parameters :func:`apart`."""
    return [-1.0, -1.0] if apart(strategy) else fingerprint_row(module)


def with_why(found: dict[str, Any], strategy: Any) -> dict[str, Any]:
    """A verdict, with ``why`` nothing was compared where the strategy's setting keeps the parameters apart."""
    why = None if found["checked"] else apart(strategy)
    return {**found, "why": why} if why else found


def verdict(rows: list[list[float]]) -> dict[str, Any]:
    """From every worker's :func:`fingerprint_row` (by rank): ``{"checked": False}`` when nothing is replicated,
    else ``{"checked": True, "differ": [ranks]}`` -- the workers outside the largest group of equal fingerprints
    (on a tie, the group that holds rank 0 counts as the largest)."""
    marks = [tuple(r) for r in rows]
    if not marks or marks[0] == (-1.0, -1.0):
        return {"checked": False}
    counts = Counter(marks)
    most = max(counts.values())
    common = marks[0] if counts[marks[0]] == most else next(m for m in marks if counts[m] == most)
    return {"checked": True, "differ": [rank for rank, m in enumerate(marks) if m != common]}


def _who(differ: list[int]) -> str:
    return f"rank {differ[0]}" if len(differ) == 1 else "ranks " + ", ".join(map(str, differ))


class ReplicasDiffer(RuntimeError):
    """Raised on every worker (``--on-replicas-differ stop``) when a replica check finds workers that differ: every
    worker holds the same verdict, so all stop at the same point."""


def stop_message(differ: list[int], step: int, agreed: int | None) -> str:
    """What ``--on-replicas-differ stop`` says: who differs, after which step, and the last check where all agreed
    (``agreed``; None: no check before this one), whose checkpoints hold parameters every worker shared."""
    since = (f"the last check where every worker agreed was after step {agreed}: resume from a checkpoint no newer "
             "than it" if agreed is not None else "no earlier check")
    return (f"after step {step} the committed parameters of {_who(differ)} differ from the other workers' "
            f"(--on-replicas-differ stop); {since}")


def heal_message(group: int, step: int) -> str:
    """What a replica group says when it leaves to heal (``--on-replicas-differ heal``)."""
    return (f"after step {step} the committed parameters of replica group {group} differ from the other groups' "
            f"(--on-replicas-differ heal): it leaves, and heals from a live peer when started again")


def slots(row: list[float], slot: int, count: int) -> list[float]:
    """This worker's :func:`fingerprint_row` at its ``slot`` of ``count``, as ``[present, first, second]`` per slot and
    zeros in the others: summed over the workers (one all-reduce, a slot has one writer, so the float64 sum is
    exact), every worker reads every present worker's fingerprint. Under torchft, where the workers present at the
    end are not known before it, a slot is a worker of the nominal job."""
    out = [0.0] * (3 * count)
    out[3 * slot: 3 * slot + 3] = [1.0, *row]
    return out


def verdict_of_slots(summed: list[float]) -> dict[str, Any]:
    """:func:`verdict` over the present slots of :func:`slots`' sum; ``differ`` names slots (the job's ranks)."""
    present = [k for k in range(len(summed) // 3) if summed[3 * k] > 0]
    found = verdict([summed[3 * k + 1: 3 * k + 3] for k in present])
    if found.get("differ"):
        found["differ"] = [present[i] for i in found["differ"]]
    return found


def verdict_of_marks(marks: dict[int, tuple[int, int, int]], replica: int, workers: int,
                     local_rank: int) -> dict[str, Any] | None:
    """Under torchft, a periodic check's verdict from a vote's fingerprints (replica group -> ``(step, first,
    second)`` of the worker at this worker's place in each group): among the groups that sent one for this worker's
    own step, ``{"checked": True, "differ": [job ranks], "step": step}``; None when this worker sent none."""
    if replica not in marks:
        return None
    step = marks[replica][0]
    groups = sorted(k for k, m in marks.items() if m[0] == step)
    found = verdict([[float(marks[k][1]), float(marks[k][2])] for k in groups])
    return {"checked": True, "differ": [groups[i] * workers + local_rank for i in found["differ"]], "step": step}


def warning(differ: list[int], step: int, kept: str = "the checkpoint and the export are rank 0's") -> str:
    """The line a run prints when its workers' committed parameters differ at its end (``kept``: whose parameters
    the run keeps)."""
    return (f"quietsync train: warning: after step {step} the committed parameters of {_who(differ)} differ from the "
            f"other workers' (a flipped bit, or workers whose math libraries round differently: mixed CPU vendors or "
            f"GPU generations); {kept}")
