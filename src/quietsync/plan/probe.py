"""The link probe: measure the real network between the launched workers and fit alpha-beta links to it.

Run by every worker of the job (it is made of collectives), over a transport **without** link emulation, so it
sees the network as it is — a loopback, a cluster's Ethernet, or a kernel-shaped link (``tc tbf``) that the
transport knows nothing about. Per link kind it measures

* ``inter`` (workers on different nodes): all-reduces, reduce-scatters and all-gathers over the ``replicate``
  group and point-to-point exchanges around it (each worker sends to the next node's worker while receiving
  from the previous one's);
* ``intra`` (inside a node): the same over the ``shard`` group;

over a sweep of message sizes (doubling from ``min_bytes`` until one transfer takes ``max_op_s`` or the size
reaches ``max_bytes``), each size ``repeats`` times after a warm-up, keeping the median of the slowest worker.
Then :func:`~quietsync.plan.fit.fit_link` fits ``α`` and ``β`` to all samples of a kind, and to each collective's
alone: a backend need not move every collective at the link's speed (gloo's CPU reduce-scatter takes as long as
an all-reduce of the same input), and the plan uses each collective's own fit.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..link import traffic
from ..transport import Transport
from .fit import Fit, Sample, fit_link

KIND_GROUPS = {"inter": "replicate", "intra": "shard"}
"""The group whose collectives measure each link kind."""


@dataclass
class ProbeResult:
    """What the probe measured: samples and the fitted link per kind (kinds the topology does not use are
    absent)."""

    samples: dict[str, list[Sample]] = field(default_factory=dict)
    fits: dict[str, Fit] = field(default_factory=dict)
    """One link per kind, fitted to all its samples."""
    by_kind: dict[str, dict[str, Fit]] = field(default_factory=dict)
    """Per link kind, a link fitted to each collective's samples alone (``all_reduce``, ``reduce_scatter``,
    ``all_gather``, ``p2p``)."""
    seconds: float = 0.0
    """How long the probe took."""


def _timed(transport: Transport, group: str, op: Callable[[], None], repeats: int) -> float:
    """Median over ``repeats`` of the slowest worker's seconds for ``op`` (after one untimed run)."""
    op()
    times = []
    for _ in range(repeats):
        transport.barrier(group)  # start together: no worker times a wait for a late peer
        t0 = time.perf_counter()
        op()
        if transport.device.type == "cuda":
            torch.cuda.synchronize(transport.device)
        times.append(time.perf_counter() - t0)
    mine = torch.tensor([statistics.median(times)], dtype=torch.float64, device=transport.device)
    transport.all_reduce(mine, group, op="max", name="probe/agree")
    return float(mine.item())


def probe(transport: Transport, *, min_bytes: int = 1 << 10, max_bytes: int = 1 << 24, max_op_s: float = 0.25,
          repeats: int = 5) -> ProbeResult:
    """Measure every link kind this topology uses (a collective: every worker calls it; see the module
    docstring). ``transport`` must not emulate links (its measurements would be the emulation's)."""
    if transport.links:
        raise ValueError("probe needs a transport without link emulation (links={})")
    result = ProbeResult()
    start = time.perf_counter()
    for kind, group in KIND_GROUPS.items():
        n = transport.group_size(group)
        if n < 2:
            continue
        me = transport.group_rank(group)
        samples: list[Sample] = []
        size = min_bytes
        while size <= max_bytes:
            numel = max(n, size // 4 // n * n)  # a multiple of n: reduce-scatter and all-gather split it evenly
            nbytes = numel * 4
            full = torch.zeros(numel, dtype=torch.float32, device=transport.device)
            other = torch.empty_like(full)
            part = torch.zeros(numel // n, dtype=torch.float32, device=transport.device)
            ops = {
                "all_reduce": lambda full=full, group=group: transport.all_reduce(full, group, name="probe/all_reduce"),
                "reduce_scatter": lambda full=full, part=part, group=group: transport.reduce_scatter(
                    part, full, group, name="probe/reduce_scatter"),
                "all_gather": lambda full=full, part=part, group=group: transport.all_gather(
                    full, part, group, name="probe/all_gather"),
                "p2p": lambda full=full, other=other, group=group, right=(me + 1) % n, left=(me - 1) % n:
                    transport.exchange(full, right, other, left, group, name="probe/exchange"),
            }
            slowest = 0.0
            for coll, op in ops.items():
                seconds = _timed(transport, group, op, repeats)
                messages, sent = (1, nbytes) if coll == "p2p" else traffic(coll, nbytes, n)
                samples.append(Sample(coll, messages, sent, seconds))
                slowest = max(slowest, seconds)
            if slowest >= max_op_s:
                break
            size *= 2
        result.samples[kind] = samples
        result.fits[kind] = fit_link(samples)
        result.by_kind[kind] = {c: fit_link([s for s in samples if s.kind == c]) for c in {s.kind for s in samples}}
    result.seconds = time.perf_counter() - start
    return result
