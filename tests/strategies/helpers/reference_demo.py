"""fp64 oracle of DeMo-SGD and decoupled AdamW with the DCT, random and striding replicators (paper 001,
after Peng et al. 2024), written from the papers' equations -- nothing here imports quietsync.

One **replicate group** of ``M`` members (DeMo: the workers; FlexDeMo: the nodes holding the same shard), each
with its own decoupled momentum ``δ_m`` over the same list of tensors. A step:

1. ``δ_m ← β δ_m + s g_m`` (``s`` = lr for DeMo-SGD, 1 for decoupled AdamW);
2. the replicator extracts ``q_m`` from ``δ_m`` and error feedback keeps the rest: ``δ_m ← δ_m − decoded(q_m)``;
3. the gathered parts are averaged and decoded into ``Q`` (the same on every member);
4. ``Q ← sign(Q)`` if asked; the base optimizer applies ``Q``:
   DeMo-SGD ``θ ← θ(1 − lr·wd) − lr·Q`` with sign, ``θ ← θ(1 − lr·wd) − Q`` without (``Q`` carries the lr);
   decoupled AdamW ``m ← β1 m + (1−β1) Q``, ``v ← β2 v + (1−β2) Q²``, ``θ ← θ(1 − lr·wd) − lr·m̂/(√v̂ + ε)``
   (Loshchilov & Hutter; the moments stay local, paper 001 "Decoupled AdamW").

Replicators (each ``extract`` is pure):

* **dct** (DeMo): every tensor viewed as a matrix ``(shape[0], rest)`` when both sides exceed 1, else as a vector;
  cut into ``chunk × chunk`` blocks (``chunk``-long for vectors), a dimension shorter than the chunk giving one
  block of its own size and a longer one padded with zeros to a multiple of the block; an orthonormal DCT-II
  per block; the ``k`` largest-magnitude coefficients of every block are sent; decoding is the inverse DCT of
  the sparse block, padding dropped. The gathered coefficients are averaged **over the members that sent
  them** (DeMo's ``batch_decompress``).
* **random** / **striding**: values at positions every member knows without sending them; the average is the
  plain mean. Striding's positions (its docstring's rule, 0-based replication count ``t``, ``m`` values, stride
  ``s = n // m``): ``o_t + j s mod n`` with ``o_t = (t mod s) + m s ⌊t/s⌋ mod n``. Random positions come from a
  seeded generator whose draws are the library's business, so they are passed in (see the tests).

Every step also records how safe the fp32 run is from leaving this fp64 one: the smallest gap between the
``k``-th and ``k+1``-th magnitude in any block (relative to the block's largest), and the smallest magnitude of
a non-zero ``Q`` entry that a sign will see (relative to the largest) -- a tiny one would let fp32 rounding pick
another coefficient or flip a sign, and the comparison would not be fair.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

F64 = torch.float64


# ---------------------------------------------------------------------------------------------- DCT-II
def dct_matrix(n: int) -> torch.Tensor:
    """Orthonormal DCT-II, row k: ``sqrt((1 if k == 0 else 2) / n) · cos(π (i + ½) k / n)``."""
    i = torch.arange(n, dtype=F64) + 0.5
    k = torch.arange(n, dtype=F64)[:, None]
    scale = torch.full((n, 1), math.sqrt(2.0 / n), dtype=F64)
    scale[0] = math.sqrt(1.0 / n)
    return scale * torch.cos(math.pi * i[None, :] * k / n)


@dataclass(frozen=True)
class Blocking:
    """How one tensor of ``shape`` is cut into DCT blocks for a given chunk."""

    shape: tuple[int, ...]
    chunk: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def matrix(self) -> bool:
        return len(self.shape) >= 2 and self.shape[0] > 1 and self.numel // self.shape[0] > 1

    @property
    def dims(self) -> tuple[int, ...]:
        """The tensor as the DCT sees it: ``(rows, cols)`` or ``(n,)``."""
        return (self.shape[0], self.numel // self.shape[0]) if self.matrix else (self.numel,)

    @property
    def block(self) -> tuple[int, ...]:
        return tuple(min(self.chunk, d) for d in self.dims)

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(-(-d // b) for d, b in zip(self.dims, self.block))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Coefficients ``(blocks, block_numel)``, blocks in row-major order of the grid."""
        padded = torch.zeros(tuple(g * b for g, b in zip(self.grid, self.block)), dtype=F64)
        view = x.reshape(self.dims).to(F64)
        if self.matrix:
            padded[: self.dims[0], : self.dims[1]] = view
            (gr, gc), (br, bc) = self.grid, self.block
            blocks = padded.reshape(gr, br, gc, bc).permute(0, 2, 1, 3).reshape(gr * gc, br, bc)
            dr, dc = dct_matrix(br), dct_matrix(bc)
            return (dr @ blocks @ dc.T).reshape(gr * gc, br * bc)
        padded[: self.dims[0]] = view
        (g,), (b,) = self.grid, self.block
        return padded.reshape(g, b) @ dct_matrix(b).T

    def decode(self, coeffs: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`encode`: the tensor (``shape``), padding dropped."""
        if self.matrix:
            (gr, gc), (br, bc) = self.grid, self.block
            dr, dc = dct_matrix(br), dct_matrix(bc)
            blocks = dr.T @ coeffs.reshape(gr * gc, br, bc) @ dc
            full = blocks.reshape(gr, gc, br, bc).permute(0, 2, 1, 3).reshape(gr * br, gc * bc)
            return full[: self.dims[0], : self.dims[1]].reshape(self.shape)
        (b,) = self.block
        full = (coeffs @ dct_matrix(b)).reshape(-1)
        return full[: self.dims[0]].reshape(self.shape)


def ks_from_compression(shapes: Sequence[tuple[int, ...]], chunk: int, compression: float, value_bytes: int = 4,
                        grad_bytes: int = 4) -> list[int]:
    """``k`` per tensor when only a bandwidth is given (the library's documented rule): blocks of one shape,
    across all tensors, share ``k = round(compression · grad_bytes · real / (blocks · (value + position bytes)))``,
    clamped to ``[1, block_numel]``; positions travel in the smallest of uint8 / int16 / int32 that holds them."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for s in shapes:
        b = Blocking(tuple(s), chunk)
        if b.numel:
            acc = by_shape.setdefault(b.block, [0, 0])
            acc[0] += math.prod(b.grid)
            acc[1] += b.numel
    ks = {}
    for block, (blocks, real) in by_shape.items():
        numel = math.prod(block)
        pos = 1 if numel <= 256 else 2 if numel <= 2**15 else 4
        k = round(compression * real * grad_bytes / (blocks * (value_bytes + pos)))
        ks[block] = max(1, min(numel, k))
    return [ks[Blocking(tuple(s), chunk).block] if math.prod(s) else 0 for s in shapes]


def transfer_round(x: torch.Tensor, transfer: torch.dtype) -> torch.Tensor:
    """``x`` as it travels in ``transfer`` (fp32 / bf16 / fp16), back in fp64."""
    return x.to(transfer).to(F64)


# ---------------------------------------------------------------------------------------------- replicators
@dataclass
class Margins:
    """The smallest relative top-k gap and relative |Q| under a sign seen so far (1.0: none seen)."""

    topk_gap: float = 1.0
    sign: float = 1.0


@dataclass
class DCTReference:
    """DeMo's top-k DCT replicator over ``shapes`` (``ks``: coefficients per block, per tensor)."""

    shapes: Sequence[tuple[int, ...]]
    chunk: int
    ks: Sequence[int]
    transfer: torch.dtype = torch.float32
    mean_over: str = "senders"
    """``senders`` (DeMo) or ``all`` (a wrong rule, for tests that show the oracle can tell)."""
    margins: Margins = field(default_factory=Margins)

    def extract(self, delta: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per tensor: ``(mask, values)`` of the sent coefficients, both ``(blocks, block_numel)``."""
        out = []
        for shape, k, d in zip(self.shapes, self.ks, delta):
            coeffs = Blocking(tuple(shape), self.chunk).encode(d)
            mag = coeffs.abs()
            order = mag.sort(dim=1, descending=True)
            if k < coeffs.shape[1]:
                gap = (order.values[:, k - 1] - order.values[:, k]) / order.values[:, 0].clamp_min(1e-300)
                self.margins.topk_gap = min(self.margins.topk_gap, float(gap.min()))
            mask = torch.zeros_like(coeffs, dtype=torch.bool)
            mask.scatter_(1, order.indices[:, :k], True)
            out.append((mask, torch.where(mask, transfer_round(coeffs, self.transfer), torch.zeros_like(coeffs))))
        return out

    def sent(self, q: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """What one member's message decodes to (for its error feedback)."""
        return [Blocking(tuple(s), self.chunk).decode(v) for s, (_, v) in zip(self.shapes, q)]

    def average(self, qs: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> list[torch.Tensor]:
        out = []
        for i, shape in enumerate(self.shapes):
            total = sum(q[i][1] for q in qs)
            count = sum(q[i][0].to(F64) for q in qs)
            mean = total / count.clamp_min(1) if self.mean_over == "senders" else total / len(qs)
            out.append(Blocking(tuple(shape), self.chunk).decode(mean))
        return out


@dataclass
class PositionsReference:
    """Values at known flat positions of the concatenated tensors (random / striding); plain mean."""

    shapes: Sequence[tuple[int, ...]]
    positions: Callable[[int], torch.Tensor]
    """Flat positions of replication ``t`` (0-based), the same for every member."""
    transfer: torch.dtype = torch.float32
    count: int = 0

    def extract(self, delta: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.positions(self.count)
        flat = torch.cat([d.reshape(-1) for d in delta])
        return idx, transfer_round(flat[idx], self.transfer)

    def _dense(self, idx: torch.Tensor, vals: torch.Tensor) -> list[torch.Tensor]:
        flat = torch.zeros(sum(math.prod(s) for s in self.shapes), dtype=F64)
        flat[idx] = vals
        return [t.reshape(s) for t, s in zip(flat.split([math.prod(s) for s in self.shapes]), self.shapes)]

    def sent(self, q: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
        return self._dense(*q)

    def average(self, qs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        self.count += 1
        idx = qs[0][0]
        assert all(torch.equal(q[0], idx) for q in qs), "members must agree on the positions"
        return self._dense(idx, torch.stack([q[1] for q in qs]).mean(0))


def striding_positions(n: int, m: int) -> Callable[[int], torch.Tensor]:
    """Paper 001's Striding as the library documents it: ``m`` positions ``o_t + j·s mod n``, ``s = n // m``,
    ``o_t = (t mod s) + m·s·⌊t/s⌋ mod n``."""
    s = n // m

    def positions(t: int) -> torch.Tensor:
        offset = (t % s + m * s * (t // s)) % n
        return (offset + s * torch.arange(m)) % n

    return positions


def values_count(n: int, compression: float, value_bytes: int = 4, grad_bytes: int = 4) -> int:
    """Values sent per step by random / striding at ``compression`` (bytes sent / bytes of the fp32 gradient)."""
    return max(1, min(n, int(compression * n * grad_bytes // value_bytes)))


def is_stratified(idx: torch.Tensor, n: int, m: int) -> bool:
    """Whether ``idx`` has exactly one position in each of the ``m`` strata of width ``n // m`` of the buffer
    rotated by some offset (the random replicator's documented stratified draw)."""
    if idx.numel() != m or idx.unique().numel() != m:
        return False
    s = n // m
    for rot in range(n):
        strata = ((idx - rot) % n) // s
        if bool((strata < m).all()) and strata.unique().numel() == m:
            return True
    return False


# ---------------------------------------------------------------------------------------------- optimizers
@dataclass
class Base:
    """The base optimizer of a decoupled step (``sgd``: DeMo-SGD, ``adamw``: decoupled AdamW) for one member's
    tensors; ``wds``: decoupled weight decay per tensor."""

    kind: str
    lr: float
    wds: Sequence[float]
    sign: bool
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    step_count: int = 0
    m: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)

    @property
    def delta_scale(self) -> float:
        return self.lr if self.kind == "sgd" else 1.0

    def apply(self, theta: list[torch.Tensor], update: list[torch.Tensor]) -> list[torch.Tensor]:
        q = [u.sign() if self.sign else u for u in update]
        decayed = [t * (1 - self.lr * wd) for t, wd in zip(theta, self.wds)]
        if self.kind == "sgd":
            return [t - (self.lr * u if self.sign else u) for t, u in zip(decayed, q)]
        b1, b2 = self.betas
        if not self.m:
            self.m = [torch.zeros_like(t) for t in theta]
            self.v = [torch.zeros_like(t) for t in theta]
        self.step_count += 1
        self.m = [b1 * m + (1 - b1) * u for m, u in zip(self.m, q)]
        self.v = [b2 * v + (1 - b2) * u * u for v, u in zip(self.v, q)]
        bc1, bc2 = 1 - b1**self.step_count, 1 - b2**self.step_count
        return [t - self.lr * (m / bc1) / ((v / bc2).sqrt() + self.eps) for t, m, v in zip(decayed, self.m, self.v)]


@dataclass
class DecoupledGroup:
    """One replicate group: every member's momentum, the shared θ (members apply the same ``Q``, so their θ and
    Adam moments stay equal: one copy), the replicator and the base optimizer."""

    theta: list[torch.Tensor]
    members: int
    replicator: DCTReference | PositionsReference
    base: Base
    beta: float
    error_feedback: bool = True
    """False: a wrong implementation (the sent part stays in the momentum), for tests that show the oracle
    can tell."""
    margins: Margins = field(default_factory=Margins)
    deltas: list[list[torch.Tensor]] = field(init=False)

    def __post_init__(self) -> None:
        self.theta = [t.to(F64).clone() for t in self.theta]
        self.deltas = [[torch.zeros_like(t) for t in self.theta] for _ in range(self.members)]
        if isinstance(self.replicator, DCTReference):
            self.replicator.margins = self.margins

    def step(self, grads: list[list[torch.Tensor]]) -> None:
        """One decoupled step; ``grads[m]``: member m's gradient of every tensor."""
        s = self.base.delta_scale
        qs = []
        for m in range(self.members):
            self.deltas[m] = [self.beta * d + s * g.to(F64) for d, g in zip(self.deltas[m], grads[m])]
            q = self.replicator.extract(self.deltas[m])
            if self.error_feedback:
                self.deltas[m] = [d - x for d, x in zip(self.deltas[m], self.replicator.sent(q))]
            qs.append(q)
        update = self.replicator.average(qs)
        if self.base.sign:
            flat = torch.cat([u.reshape(-1) for u in update]).abs()
            nonzero = flat[flat > 1e-12 * float(flat.max())]
            if nonzero.numel():
                self.margins.sign = min(self.margins.sign, float(nonzero.min() / nonzero.max()))
        self.theta = self.base.apply(self.theta, update)
