"""PowerSGD and half-precision DDP communication hooks that talk through the transport.

PyTorch ships these as DDP communication hooks (``torch.distributed.algorithms.ddp_comm_hooks``), but they
call ``torch.distributed`` themselves, so their bytes would bypass the meter and the link emulation. These
are quietsync's own, written from the algorithm (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization", Algorithm 1 with error feedback, one power iteration per step,
warm start) and matching PyTorch's hook step for step, so a run with either gives the same parameters
(``tests/strategies/baselines/test_powersgd.py`` checks that against PyTorch's hook on a plain process group). The
``ddp`` strategy uses them with ``comm_hook = powersgd | fp16 | bf16``.

**PowerSGD**, for every gradient bucket of ``n`` workers (after ``start_iter`` plain all-reduce iterations):

1. ``M ← g + e`` (error feedback: ``e`` is what the previous step's compression of this bucket lost);
2. each parameter's gradient viewed as a matrix ``(shape[0], rest)`` is compressed iff
   ``(rows + cols)·r·min_compression_rate < rows·cols`` (``r = min(rows, cols, rank)``): vectors (biases,
   norms) and small matrices travel uncompressed, all of them in one all-reduce (averaged);
3. per compressed matrix ``M``: ``P ← M Q`` (``Q`` from the previous step, orthogonalised: warm start; at the
   first compressed step, and every step without warm start, drawn from N(0, 1) with a seed every worker
   derives from ``seed`` in the same order); all-reduce the ``P``s (summed); orthogonalise each ``P``
   (Gram–Schmidt for ``r ≤ 2``, else a QR factorisation); ``Q ← Mᵀ P``; all-reduce the ``Q``s and divide by
   ``n``; the gradient becomes ``P Qᵀ``;
4. ``e ← M − (what the bucket now holds)`` -- for uncompressed tensors that is the local minus the average,
   exactly as PyTorch's hook keeps it.

Bytes per compressed step and bucket: one all-reduce of ``Σ rows·r`` (P) and one of ``Σ cols·r`` (Q) fp32
elements, plus one of the uncompressed elements (skipped when there are none) -- :meth:`PowerSGDState.bucket_bytes`.

**fp16 / bf16 compression** (:func:`cast_hook`): the bucket travels as ``buffer.to(dtype) / n`` in an
all-reduce and is copied back into the fp32 bucket.

The compressed step's three all-reduces run on one thread per hook, bucket after bucket in the order DDP hands
them over (so every worker issues them in the same order, which continuations of gloo futures would not
guarantee), overlapping the rest of the backward; the warm-up all-reduce is issued asynchronously like
DDP's own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ...transport import Transport
from ...validate import check_choice, check_float, check_int
from ..parts.part import Part

__all__ = ["PowerSGDState", "powersgd_hook", "cast_hook", "CAST_HOOK_DTYPES", "orthogonalize"]

CAST_HOOK_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Orthonormalise the columns of every matrix of a ``(batch, rows, r)`` stack in place (``r ≤ rows``).

    Gram–Schmidt for ``r ≤ 2`` or half precision (column by column: normalise, then remove its projection from
    the columns after it; ``epsilon`` is added to each norm against all-zero columns), else ``torch.linalg.qr``
    (its ``Q``), as PyTorch's PowerSGD hook decides.
    """
    if matrices.dim() != 3 or matrices.shape[2] > matrices.shape[1]:
        raise ValueError(f"need (batch, rows, r) with r <= rows, got {tuple(matrices.shape)}")
    r = matrices.shape[2]
    if r <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(r):
            col = matrices[:, :, i: i + 1]
            norm = torch.norm(col, dim=1, keepdim=True)
            col /= norm + epsilon if epsilon else norm
            if i + 1 < r:
                rest = matrices[:, :, i + 1:]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
        return
    q, _ = torch.linalg.qr(matrices)
    matrices.copy_(q)


class PowerSGDState(Part):
    """Knobs and per-bucket state of :func:`powersgd_hook` (one object for all buckets of one DDP model).

    Args:
        rank: ``r``, the rank of the approximation of each compressed matrix.
        start_iter: iterations of plain all-reduce before compression starts (≥ 2 with error feedback or warm
            start: DDP rebuilds its buckets after the first iteration).
        min_compression_rate: a matrix is compressed iff ``(rows + cols)·r·rate < rows·cols``.
        error_feedback: keep what compression lost and add it to the next gradient.
        warm_start: start each power iteration from the previous step's ``Q``.
        orthogonalization_epsilon: added to column norms in Gram–Schmidt (0: exact normalisation).
        seed: seeds the draws of the initial ``Q``s (every worker must use the same seed).
    """

    def __init__(self, rank: int = 1, start_iter: int = 1000, min_compression_rate: float = 2.0,
                 error_feedback: bool = True, warm_start: bool = True, orthogonalization_epsilon: float = 0.0,
                 seed: int = 0, names: Mapping[int, str] | None = None) -> None:
        check_int("powersgd_rank", rank, 1)
        check_int("powersgd_start_iter", start_iter, 0)
        if (error_feedback or warm_start) and start_iter < 2:
            raise ValueError(f"powersgd_start_iter must be >= 2 with error feedback or warm start (DDP rebuilds "
                             f"its buckets after the first iteration), got {start_iter}")
        check_float("min_compression_rate", min_compression_rate, 0)
        check_float("orthogonalization_epsilon", orthogonalization_epsilon, 0)
        check_int("seed", seed, 0)
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = float(min_compression_rate)
        self.error_feedback = bool(error_feedback)
        self.warm_start = bool(warm_start)
        self.epsilon = float(orthogonalization_epsilon)
        self.seed = seed
        self.rng = np.random.RandomState(seed)
        self.iter = 0
        """Completed iterations (counted when the last bucket of an iteration is done)."""
        self.errors: dict[int, torch.Tensor] = {}
        self.ps: dict[int, torch.Tensor] = {}
        self.qs: dict[int, torch.Tensor] = {}
        self.names = dict(names) if names is not None else None
        """``{id(parameter): name}``: with it, :meth:`state_dict` keeps residuals and ``Q`` per parameter."""
        self.layouts: dict[int, _Layout] = {}
        self._loaded_errors: dict[str, torch.Tensor] = {}
        self._loaded_qs: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ which tensors are compressed
    def plan(self, shapes: list[torch.Size]) -> tuple[list[int], list[int]]:
        """``(compressed, uncompressed)``: indices into ``shapes`` (one bucket's gradients, in bucket order)."""
        compressed, plain = [], []
        for i, shape in enumerate(shapes):
            rows, cols = _matrix_shape(shape)
            r = min(rows, cols, self.rank)
            if (rows + cols) * r * self.min_compression_rate < rows * cols:
                compressed.append(i)
            else:
                plain.append(i)
        return compressed, plain

    def bucket_bytes(self, shapes: list[torch.Size], element_size: int = 4) -> dict[str, int]:
        """Bytes put into each all-reduce of one compressed step of a bucket of ``shapes``:
        ``{"uncompressed": ..., "P": ..., "Q": ...}``."""
        compressed, plain = self.plan(shapes)
        p = q = 0
        for i in compressed:
            rows, cols = _matrix_shape(shapes[i])
            r = min(rows, cols, self.rank)
            p, q = p + rows * r, q + cols * r
        un = sum(int(np.prod(shapes[i])) for i in plain)
        return {"uncompressed": un * element_size, "P": p * element_size, "Q": q * element_size}

    # ------------------------------------------------------------------ part protocol
    def state_dict(self) -> dict[str, Any]:
        """Iteration count, the seed generator's state, and every parameter's residual and warm-start ``Q`` by
        parameter name -- so a resumed run, whose DDP may lay its buckets out differently before it rebuilds
        them, continues exactly (needs ``names``)."""
        if self.names is None and (self.errors or self.qs):
            raise ValueError("PowerSGDState needs names (id(parameter) -> name) to save its residuals")
        errors, qs = self._per_parameter()
        _, keys, pos, has_gauss, cached = self.rng.get_state()
        return {
            "iter": self.iter,
            "errors": errors,
            "qs": qs,
            "rng": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                    "cached": float(cached)},
        }

    def _per_parameter(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Every parameter's residual and ``Q`` (copies), from the buckets and from a checkpoint not used yet."""
        errors, qs = dict(self._loaded_errors), dict(self._loaded_qs)
        for index, layout in self.layouts.items():
            if index in self.errors:
                for key, at, n in layout.params:
                    errors[key] = self.errors[index][at: at + n].detach().clone()
            if index in self.qs:
                for key, at, n in layout.qs:
                    qs[key] = self.qs[index][at: at + n].detach().clone()
        return errors, qs

    def _unbucket(self) -> None:
        """DDP laid its buckets out anew (it rebuilds them after the first iteration, also after a resume):
        keep the state per parameter until each new bucket takes its pieces back."""
        self._loaded_errors, self._loaded_qs = self._per_parameter()
        self.errors, self.ps, self.qs, self.layouts = {}, {}, {}, {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iter = int(state["iter"])
        self.errors, self.ps, self.qs, self.layouts = {}, {}, {}, {}
        self._loaded_errors = {str(k): v.clone() for k, v in state["errors"].items()}
        self._loaded_qs = {str(k): v.clone() for k, v in state["qs"].items()}
        rng = state["rng"]
        self.rng.set_state(("MT19937", rng["keys"].numpy().astype(np.uint32), int(rng["pos"]), int(rng["has_gauss"]),
                            float(rng["cached"])))

    def memory_report(self) -> dict[str, int]:
        def size(d: dict[int, torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in d.values())

        return {"powersgd_error": size(self.errors), "powersgd_pq": size(self.ps) + size(self.qs)}

    def _count(self, bucket: Any) -> None:
        if bucket.is_last():
            self.iter += 1

    def _restore(self, index: int, keys: list[str], sizes: list[int], device: torch.device, dtype: torch.dtype,
                 loaded: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """A bucket's flat tensor put back together from a checkpoint's per-parameter pieces (None: not all
        there, e.g. the checkpoint was written before compression started)."""
        if not keys or any(k not in loaded for k in keys):
            return None
        out = torch.cat([loaded[k].reshape(-1) for k in keys]).to(device=device, dtype=dtype)
        if out.numel() != sum(sizes):
            raise ValueError(f"checkpoint PowerSGD state of bucket {index} does not match this model's parameters")
        for k in keys:
            del loaded[k]
        return out


@dataclass
class _Layout:
    """Where each parameter of one bucket sits: ``(name, offset, numel)`` in the bucket (``params``) and in its
    ``Q`` memory (``qs``, compressed parameters only)."""

    params: list[tuple[str, int, int]]
    qs: list[tuple[str, int, int]]


def _matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """``(rows, cols)`` of a gradient viewed as ``(shape[0], rest)`` (a scalar is ``(1, 1)``)."""
    if len(shape) == 0:
        return 1, 1
    rows = int(shape[0])
    return rows, int(np.prod(shape[1:])) if len(shape) > 1 else 1


class _Serial:
    """One thread that runs the buckets' communication in the order the hook saw the buckets.

    DDP hands buckets to the hook in index order on every worker, but a continuation of a gloo future runs on
    whichever thread completes it: collectives issued from continuations of different buckets could reach
    the process group in a different order on different workers (a mismatched collective). Running each
    bucket's all-reduces from one FIFO thread keeps the order and still overlaps them with the backward.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[[], torch.Tensor], device: torch.device) -> torch.futures.Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quietsync-powersgd")
        fut: torch.futures.Future = torch.futures.Future(devices=[device] if device.type == "cuda" else None)

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to DDP through the future
                fut.set_exception(exc)

        self._pool.submit(run)
        return fut

    def close(self) -> None:
        """Stop the thread (after the jobs queued); a later bucket starts a new one."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def powersgd_hook(transport: Transport, state: PowerSGDState, group: str = "world"
                  ) -> Callable[[Any, Any], torch.futures.Future]:
    """A DDP communication hook running PowerSGD (module docstring) through ``transport`` over ``group``.

    Register with ``ddp.register_comm_hook(None, powersgd_hook(transport, state))``.
    """
    n = transport.group_size(group)
    serial = _Serial()

    def hook(_unused: Any, bucket: Any) -> torch.futures.Future:
        buf = bucket.buffer()
        if state.iter < state.start_iter:  # warm-up: the plain averaged all-reduce
            state._count(bucket)
            buf.div_(n)
            work = transport.all_reduce(buf, group, async_op=True, name="ddp_bucket/powersgd")
            return work.get_future().then(lambda f: (f.value(), buf)[1])

        index = bucket.index()
        device, dtype = buf.device, buf.dtype
        grads = bucket.gradients()
        keys = [state.names[id(p)] for p in bucket.parameters()] if state.names is not None else []
        if keys and index in state.layouts and [k for k, _, _ in state.layouts[index].params] != keys:
            state._unbucket()
        # 1. error feedback
        kept: torch.Tensor | None = None
        if state.error_feedback:
            if index not in state.errors:
                restored = state._restore(index, keys, [g.numel() for g in grads], device, dtype,
                                          state._loaded_errors)
                state.errors[index] = restored if restored is not None else torch.zeros(
                    buf.numel(), device=device, dtype=dtype)
            buf.add_(state.errors[index])
            kept = buf.detach().clone()

        # 2. which gradients are compressed
        compressed, plain = state.plan([g.shape for g in grads])
        plain_grads = [grads[i] for i in plain]
        by_shape: dict[tuple[int, int], list[int]] = {}
        for i in compressed:  # grouped by shape, in order of first appearance (the P/Q memory layout)
            by_shape.setdefault(_matrix_shape(grads[i].shape), []).append(i)
        order = [i for ids in by_shape.values() for i in ids]
        ordered = [grads[i].view(*_matrix_shape(grads[i].shape)) for i in order]
        ranks = [min(m.shape[0], m.shape[1], state.rank) for m in ordered]
        p_len = sum(m.shape[0] * r for m, r in zip(ordered, ranks))
        q_len = sum(m.shape[1] * r for m, r in zip(ordered, ranks))
        if keys and index not in state.layouts:
            offsets = [0]
            for g in grads:
                offsets.append(offsets[-1] + g.numel())
            q_at = [0]
            for m, r in zip(ordered, ranks):
                q_at.append(q_at[-1] + m.shape[1] * r)
            state.layouts[index] = _Layout(
                [(keys[i], offsets[i], grads[i].numel()) for i in range(len(grads))],
                [(keys[i], q_at[j], q_at[j + 1] - q_at[j]) for j, i in enumerate(order)])

        # 3. P and Q memory: reused (warm start) or drawn afresh
        if state.warm_start and index not in state.qs:
            restored = state._restore(index, [keys[i] for i in order] if keys else [],
                                      [m.shape[1] * r for m, r in zip(ordered, ranks)], device, dtype,
                                      state._loaded_qs)
            if restored is not None:
                state.ps[index] = torch.empty(p_len, device=device, dtype=dtype)
                state.qs[index] = restored
        fresh = not state.warm_start or index not in state.ps
        if fresh:
            p_mem = torch.empty(p_len, device=device, dtype=dtype)
            q_mem = torch.empty(q_len, device=device, dtype=dtype)
            if state.warm_start:
                state.ps[index], state.qs[index] = p_mem, q_mem
        else:
            p_mem, q_mem = state.ps[index], state.qs[index]
        p_views, q_views, pi, qi = [], [], 0, 0
        for m, r in zip(ordered, ranks):
            rows, cols = m.shape
            p_views.append(p_mem[pi: pi + rows * r].view(1, rows, r))
            q_views.append(q_mem[qi: qi + cols * r].view(1, cols, r))
            pi, qi = pi + rows * r, qi + cols * r
        if fresh:
            gen = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
            for q in q_views:
                q.copy_(torch.randn(*q.shape, generator=gen, dtype=dtype))
        for q in q_views:
            orthogonalize(q, state.epsilon)
        for m, q, p in zip(ordered, q_views, p_views):
            torch.bmm(m.unsqueeze(0), q, out=p)

        def communicate() -> torch.Tensor:
            """The bucket's three all-reduces and what runs between them (on the bucket-ordered thread)."""
            if plain_grads:  # uncompressed tensors: one averaged all-reduce
                flat_plain = torch.cat([g.reshape(-1) for g in plain_grads])
                transport.all_reduce(flat_plain, group, name="ddp_bucket/powersgd/uncompressed")
                flat_plain.div_(n)
                at = 0
                for g in plain_grads:
                    g.copy_(flat_plain[at: at + g.numel()].view_as(g))
                    at += g.numel()
            if p_len:
                transport.all_reduce(p_mem, group, name="ddp_bucket/powersgd/P")  # summed: P is orthogonalised
            for p in p_views:
                orthogonalize(p, state.epsilon)
            for m, p, q in zip(ordered, p_views, q_views):
                torch.bmm(m.t().unsqueeze(0), p, out=q)
            if q_len:
                transport.all_reduce(q_mem, group, name="ddp_bucket/powersgd/Q")
            q_mem.div_(n)
            for m, p, q in zip(ordered, p_views, q_views):
                torch.bmm(p, q.transpose(1, 2), out=m.unsqueeze(0))
            if kept is not None:
                state.errors[index] = kept - buf
            state._count(bucket)
            return buf

        return serial.submit(communicate, device)

    hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    hook.close = serial.close  # type: ignore[attr-defined]
    return hook


def cast_hook(transport: Transport, dtype: str, group: str = "world") -> Callable[[Any, Any], torch.futures.Future]:
    """A DDP communication hook averaging each bucket in ``dtype`` (``fp16`` or ``bf16``) through ``transport``:
    ``buffer.to(dtype) / n`` is all-reduced (summed) and copied back into the bucket."""
    check_choice("comm_hook dtype", dtype, CAST_HOOK_DTYPES)
    wire_dtype = CAST_HOOK_DTYPES[dtype]
    n = transport.group_size(group)

    def hook(_unused: Any, bucket: Any) -> torch.futures.Future:
        buf = bucket.buffer()
        wire = buf.to(wire_dtype).div_(n)
        work = transport.all_reduce(wire, group, async_op=True, name=f"ddp_bucket/{dtype}")

        def decompress(f: torch.futures.Future) -> torch.Tensor:
            f.value()
            buf.copy_(wire)
            return buf

        return work.get_future().then(decompress)

    hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return hook
