"""Calibration: what one micro-batch and one optimizer step of the user's model cost on this device.

:func:`calibrate` times, on the model and micro-batch given, the forward and the backward of one micro-batch,
the optimizer step (AdamW by default) over all parameters, a device memory copy, and — for each decoupled
setting asked for — the decoupled optimizer's whole step (momentum, the replicator's extraction and error
feedback, decoding, sign, base rule) with its collective answered locally by :class:`Loopback`, so the codec's
own computation is measured without the network. Each is warmed up, then repeated; the median is kept. The
activation memory of one micro-batch is measured with :class:`~quietsync.activation_memory.ActivationMeter`
(autograd's saved tensors at their peak).

Calibrate under the conditions of the run: with all workers of a machine calibrating at once (as ``quietsync
plan`` does in its launched workers) the cores are shared as they will be in training.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..activation_memory import ActivationMeter
from ..cost.compute import ComputeProfile

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


class Loopback:
    """A :class:`~quietsync.transport.Collectives` answering locally for a group of ``n`` identical workers:
    an all-reduce leaves the tensor as it is (the average of n equal tensors), an all-gather repeats this
    worker's input n times. For timing a replicator's computation without a network."""

    def __init__(self, n: int, device: torch.device | str = "cpu") -> None:
        self.n = n
        self.device = torch.device(device)

    def group_size(self, group: str) -> int:
        return self.n

    def group_rank(self, group: str) -> int:
        return 0

    def all_reduce(self, tensor: torch.Tensor, group: str = "world", op: str = "sum", async_op: bool = False,
                   name: str = "all_reduce") -> _Done:
        if op == "sum":
            tensor.mul_(self.n)  # n equal tensors sum to n times one; avg, max and min leave it as it is
        return _Done()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: str = "world", async_op: bool = False,
                   name: str = "all_gather") -> _Done:
        output.view(self.n, -1).copy_(input.reshape(1, -1).expand(self.n, -1))
        return _Done()

    def all_gather_uneven(self, tensor: torch.Tensor, group: str = "world",
                          name: str = "all_gather_uneven") -> list[torch.Tensor]:
        return [tensor.reshape(-1).clone() for _ in range(self.n)]


class _Done:
    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        # CUDA runs asynchronously: wait before and after, so only fn's own work is timed
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)  # the median: one stray slow repeat does not move it


def time_micro_batch(model: torch.nn.Module, batch: Any, loss_fn: LossFn, *, warmup: int = 2, repeats: int = 5
                     ) -> tuple[float, float, int]:
    """``(forward seconds, backward seconds, activation bytes)`` of one micro-batch (medians of ``repeats``
    after ``warmup``; gradients are left accumulated in ``.grad``)."""
    device = next(model.parameters()).device
    # parameters autograd saves for backward are weights, not activations: left out of the peak
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    meter = ActivationMeter(exclude=lambda t: t.untyped_storage().data_ptr() in params,
                            device=device if device.type == "cuda" else None)
    fwd, bwd, peak = [], [], 0
    for i in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        meter.reset_peak()
        with meter.track():
            loss = loss_fn(model, batch)
        _sync(device)
        t1 = time.perf_counter()
        peak = max(peak, meter.peak)
        loss.backward()
        _sync(device)
        t2 = time.perf_counter()
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd), peak


def time_optimizer(params: Sequence[torch.nn.Parameter], optimizer: Callable[..., torch.optim.Optimizer],
                   optimizer_kwargs: dict[str, Any], *, warmup: int = 2, repeats: int = 5) -> float:
    """Median seconds of one optimizer step over ``params`` (on copies: the model is not changed)."""
    copies = [p.detach().clone().requires_grad_(True) for p in params]
    for c in copies:
        c.grad = torch.randn_like(c) * 1e-3  # a gradient on every copy: the optimizer skips parameters without one
    opt = optimizer(copies, **optimizer_kwargs)
    return _median_time(opt.step, copies[0].device, warmup, repeats)


def time_decoupled(params: Sequence[torch.nn.Parameter], n: int, *, base: str = "sgd", warmup: int = 2,
                   repeats: int = 5, **replicator_knobs: Any) -> float:
    """Median seconds of one decoupled optimizer step (DeMo-SGD or decoupled AdamW) over copies of ``params``
    with the replicator of ``replicator_knobs`` exchanging over :class:`Loopback` (``n`` workers)."""
    from ..optim import DecoupledAdamW, DeMoSGD
    from ..wire.replicators import make_replicator

    copies = [p.detach().clone().requires_grad_(True) for p in params]
    for c in copies:
        c.grad = torch.randn_like(c) * 1e-3
    name = replicator_knobs.pop("replicator")
    rep = make_replicator(name, **replicator_knobs)
    cls = DecoupledAdamW if base == "adamw" else DeMoSGD
    opt = cls(copies, lr=1e-4, replicator=rep, transport=Loopback(n, copies[0].device), group="world")
    return _median_time(opt.step, copies[0].device, warmup, repeats)


def time_copy(nbytes: int, device: torch.device | str, *, warmup: int = 1, repeats: int = 5) -> float:
    """Median seconds per byte of a device memory copy of ``nbytes``."""
    device = torch.device(device)
    n = max(1, nbytes // 4)
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    return _median_time(lambda: b.copy_(a), device, warmup, repeats) / (4 * n)


def calibrate(model: torch.nn.Module, batch: Any, loss_fn: LossFn, *,
              optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
              optimizer_kwargs: dict[str, Any] | None = None,
              codecs: dict[str, dict[str, Any]] | None = None, codec_group: int = 2,
              warmup: int = 2, repeats: int = 5) -> ComputeProfile:
    """Measure a :class:`~quietsync.cost.compute.ComputeProfile` for ``model`` on ``batch`` on this device.

    Args:
        model: the model, on its device, in train mode (its gradients are zeroed afterwards).
        batch: one micro-batch, as ``loss_fn`` takes it.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        optimizer, optimizer_kwargs: the optimizer the strategies run (AdamW, lr 1e-3 by default).
        codecs: decoupled settings to time, ``{key: {"replicator": ..., "compression": ..., "base": ...}}``
            (keys as :func:`~quietsync.cost.compute.codec_key` makes them).
        codec_group: workers the replicators' collective gathers from (all-gathers grow with it).
        warmup, repeats: untimed and timed repetitions of each measurement.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters")
    device = params[0].device
    fwd, bwd, activations = time_micro_batch(model, batch, loss_fn, warmup=warmup, repeats=repeats)
    model.zero_grad(set_to_none=True)
    opt = time_optimizer(params, optimizer, optimizer_kwargs or {"lr": 1e-3}, warmup=warmup, repeats=repeats)
    elements = sum(p.numel() for p in params)
    codec_s = {}
    for key, knobs in (codecs or {}).items():
        knobs = dict(knobs)  # a copy: popping "base" must not change the caller's codecs
        base = knobs.pop("base", "sgd")
        codec_s[key] = time_decoupled(params, codec_group, base=base, warmup=warmup, repeats=repeats, **knobs)
    copy_s = time_copy(elements * params[0].element_size(), device)
    return ComputeProfile(forward_s=fwd, backward_s=bwd, optimizer_s_per_element=opt / elements, elements=elements,
                          codec_s=codec_s, copy_s_per_byte=copy_s, activation_bytes=activations,
                          source=f"calibrated on {device.type}" + (f" ({torch.cuda.get_device_name(device)})"
                                                                   if device.type == "cuda" else ""))
