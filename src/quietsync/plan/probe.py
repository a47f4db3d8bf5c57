"""The link probe: measure the real network between the launched workers and fit alpha-beta links to it.

Run by every worker of the job (it is made of collectives), over a transport **without** link emulation, so it
sees the network as it is — a loopback, a cluster's Ethernet, or a kernel-shaped link (``tc tbf``) that the
transport knows nothing about. Per link kind it measures

* ``inter`` (workers on different nodes): all-reduces over the ``replicate`` group and point-to-point
  exchanges around it (each worker sends to the next node's worker while receiving from the previous one's);
* ``intra`` (inside a node): the same over the ``shard`` group;

over a sweep of message sizes (doubling from ``min_bytes`` until one transfer takes ``max_op_s`` or the size
reaches ``max_bytes``), each size ``repeats`` times after a warm-up, keeping the median of the slowest worker.
Then :func:`~quietsync.plan.fit.fit_link` fits ``α`` and ``β`` to all samples of a kind.
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
    seconds: float = 0.0
    """How long the probe took."""


def _timed(transport: Transport, group: str, op: Callable[[], None], repeats: int) -> float:
    """Median over ``repeats`` of the slowest worker's seconds for ``op`` (after one untimed run)."""
    op()
    times = []
    for _ in range(repeats):
        transport.barrier(group)
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
            numel = max(1, size // 4)
            buf = torch.zeros(numel, dtype=torch.float32, device=transport.device)
            out = torch.empty_like(buf)
            nbytes = numel * 4

            def reduce(buf: torch.Tensor = buf, group: str = group) -> None:
                transport.all_reduce(buf, group, name="probe/all_reduce")

            def ring(buf: torch.Tensor = buf, out: torch.Tensor = out, group: str = group, right: int = (me + 1) % n,
                     left: int = (me - 1) % n) -> None:
                transport.exchange(buf, right, out, left, group, name="probe/exchange")

            t_ar = _timed(transport, group, reduce, repeats)
            messages, sent = traffic("all_reduce", nbytes, n)
            samples.append(Sample("all_reduce", messages, sent, t_ar))
            t_p2p = _timed(transport, group, ring, repeats)
            samples.append(Sample("exchange", 1, nbytes, t_p2p))
            if max(t_ar, t_p2p) >= max_op_s:
                break
            size *= 2
        result.samples[kind] = samples
        result.fits[kind] = fit_link(samples)
    result.seconds = time.perf_counter() - start
    return result
