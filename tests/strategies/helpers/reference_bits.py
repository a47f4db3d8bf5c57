"""Single-process references for low-bit DiLoCo and SparseLoCo, written from the papers' equations and the
formats' definitions with plain torch — nothing here calls quietsync.

* Streaming DiLoCo with 4-bit outer gradients (Douillard et al. 2025): every replica's pseudo-gradient of a
  fragment is quantized (E2M1 levels ±{0, .5, 1, 1.5, 2, 3, 4, 6} times a per-block absmax scale stored as
  bfloat16, rounded up), the decoded values are averaged in fp32, the outer Nesterov SGD steps on the mean.
* SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706, the algorithm box): per replica r and outer step t,
  ``e_r ← β·e_r + Δ_r``; ``Δ̂_r = Q(TopK(e_r))``; ``e_r ← e_r − Δ̂_r``; ``Δ = (1/R)·Σ_r Δ̂_r``;
  ``θ ← θ − α·Δ``. TopK keeps the k largest magnitudes of every chunk (chunks inside each tensor), Q is the
  2-bit mid-rise quantizer (levels ±0.5, ±1.5 times the chunk's absmax/1.5 scale in bfloat16, rounded up).

Replicas: ``world`` model copies, replica r trains on ``micro_batch(s, r, 0)`` (one micro-batch per step).
"""

from __future__ import annotations

import copy
import math
import struct
from collections.abc import Callable

import torch

from tests.strategies.helpers.common import flat_params, loss_fn, micro_batch, param_groups, tiny_model

E2M1 = torch.tensor(sorted({s * m for m in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0) for s in (1, -1)}))
INT2 = torch.tensor([-1.5, -0.5, 0.5, 1.5])


def bf16_up(x: float) -> float:
    """The smallest bfloat16 value >= x (x >= 0, an fp32 value)."""
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    if bits & 0xFFFF:
        bits = (bits & 0xFFFF0000) + 0x10000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def quantize_blocks(x: torch.Tensor, levels: torch.Tensor, block: int) -> torch.Tensor:
    """Nearest level of every element of flat fp32 ``x``, per ``block`` elements an absmax scale."""
    out = torch.empty_like(x)
    qmax = float(levels.abs().max())
    for b in range(0, x.numel(), block):
        xb = x[b: b + block]
        s = bf16_up(float(xb.abs().max() / qmax))
        if s == 0.0:
            out[b: b + block] = 0.0
            continue
        grid = levels * s
        out[b: b + block] = grid[(xb[:, None] - grid[None, :]).abs().argmin(1)]
    return out


def topk_chunks(x: torch.Tensor, sizes: list[int], chunk: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, mask)``: the k largest magnitudes of every chunk of every tensor (tensors of ``sizes``
    laid end to end in ``x``), values in chunk order; ``mask`` the flat positions chosen."""
    values, positions, at = [], [], 0
    for n in sizes:
        for c in range(0, n, chunk):
            part = x[at + c: at + min(c + chunk, n)]
            kk = min(k, part.numel())
            order = part.abs().argsort(descending=True)[:kk]
            values.append(part[order])
            positions.append(order + at + c)
            if kk < k:  # the padded chunk's zeros fill the rest (they decode to 0 wherever they land)
                values.append(torch.zeros(k - kk))
                positions.append(torch.full((k - kk,), -1))
        at += n
    return torch.cat(values), torch.cat(positions)


def _inner(model: torch.nn.Module, opt: torch.optim.Optimizer, s: int, r: int) -> None:
    opt.zero_grad()
    loss_fn(model, micro_batch(s, r, 0)).backward()
    opt.step()


def reference_packed_diloco(world: int, sync_every: int, steps: int, make_opt: Callable, fragments: list[list[int]],
                            *, quantize: Callable[[torch.Tensor], torch.Tensor] | None = None,
                            sparseloco: dict | None = None, outer_lr: float = 0.7, outer_momentum: float = 0.9
                            ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """DiLoCo over flat fragments with a quantized exchange (``quantize``: Δ_r ↦ what arrives) or SparseLoCo
    (``sparseloco``: ``{"beta", "density", "chunk"}``); τ = 0. Returns every replica's flat parameters and, for
    SparseLoCo, every replica's residual per fragment."""
    base = tiny_model()
    models = [copy.deepcopy(base) for _ in range(world)]
    opts = [make_opt(param_groups(m)) for m in models]
    params = [list(p for g in param_groups(m) for p in g["params"]) for m in models]
    F = len(fragments)
    sizes = [[params[0][i].numel() for i in frag] for frag in fragments]
    theta = [torch.cat([params[0][i].detach().reshape(-1).clone() for i in frag]) for frag in fragments]
    buf: list[torch.Tensor | None] = [None] * F
    resid = [[torch.zeros_like(t) for t in theta] for _ in range(world)]
    for s in range(1, steps + 1):
        for r in range(world):
            _inner(models[r], opts[r], s - 1, r)
        for f in range(F):
            if s % sync_every != ((f + 1) * sync_every // F) % sync_every:
                continue
            with torch.no_grad():
                arrived = []
                for r in range(world):
                    local = torch.cat([params[r][i].detach().reshape(-1) for i in fragments[f]])
                    delta = theta[f] - local
                    if sparseloco is None:
                        arrived.append(quantize(delta) if quantize is not None else delta)
                        continue
                    e = resid[r][f]
                    e.mul_(sparseloco["beta"]).add_(delta)
                    chunk = min(sparseloco["chunk"], max(sizes[f]))
                    k = min(chunk, max(1, round(sparseloco["density"] * chunk)))
                    values, pos = topk_chunks(e, sizes[f], chunk, k)
                    q = quantize_blocks(values, INT2, k)
                    sent = torch.zeros_like(e)
                    keep = pos >= 0
                    sent[pos[keep]] = q[keep]
                    e.sub_(sent)
                    arrived.append(sent)
                mean = torch.stack(arrived).sum(0) / world
                if sparseloco is not None:
                    theta[f].add_(mean, alpha=-outer_lr)
                else:  # torch SGD's Nesterov momentum: b ← μ·b + g (b = g at first); step g + μ·b
                    buf[f] = mean.clone() if buf[f] is None else buf[f].mul(outer_momentum).add(mean)
                    theta[f].add_(mean.add(buf[f], alpha=outer_momentum), alpha=-outer_lr)
                for r in range(world):
                    for i, piece in zip(fragments[f], theta[f].split(sizes[f])):
                        params[r][i].copy_(piece.view_as(params[r][i]))
    return [flat_params(m) for m in models], resid


def hand_payload(kind: str, sizes: list[int], *, block: int = 64, chunk: int = 0, density: float = 0.0) -> int:
    """Bytes of one worker's packed pseudo-gradient of a fragment of tensors of ``sizes``."""
    n = sum(sizes)
    if kind in ("fp4", "int4"):
        return 2 * math.ceil(n / block) + math.ceil(n / 2)
    if kind == "int2":
        return 2 * math.ceil(n / block) + math.ceil(n / 4)
    assert kind == "sparseloco-int2"
    chunk = min(chunk, max(sizes))
    k = min(chunk, max(1, round(density * chunk)))
    chunks = sum(math.ceil(s / chunk) for s in sizes)
    pos = 1 if chunk <= 256 else 2
    return 2 * chunks + math.ceil(chunks * k / 4) + chunks * k * pos  # a bf16 scale per chunk, codes, positions
