"""``zero1``: ZeRO-1 on flat buffers — the sharded substrate ACCO, DPU and WP run on.

Each worker keeps optimizer state for only its ``1/n`` of the parameters. A step is:

1. accumulate ``accumulation`` micro-batches into the flat gradient buffer (local, no communication);
2. **reduce-scatter** the buffer: each worker receives the summed gradient of its shard, divided by the
   global micro-batch count;
3. the optimizer (any torch optimizer, original parameter groups kept) steps the fp32 master shard;
4. **all-gather** the updated shards into the flat parameter buffer the model's parameters view.

Everything is blocking here (the main thread idles during 2–4); ACCO overlaps the same jobs with
computation. Equal to DDP with the same optimizer up to float rounding (tested), with the communication
of a ring all-reduce split into its two halves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ..flat import DTypePolicy, FlatParams, parse_dtype
from ..sharded import ShardedOptimizer
from .base import Strategy, StrategyConfig
from .registry import register


@dataclass
class Zero1Config(StrategyConfig):
    """Knobs of the ``zero1`` strategy."""

    accumulation: int = 1
    """Micro-batches per step on each worker (gradient accumulation)."""
    reduce_dtype: str = "float32"
    """dtype of gradients on the wire: float32, bfloat16 or float16."""

    def __post_init__(self) -> None:
        if not isinstance(self.accumulation, int) or self.accumulation < 1:
            raise ValueError(f"accumulation must be an integer >= 1, got {self.accumulation!r}")
        parse_dtype(self.reduce_dtype, "reduce_dtype")


class ShardedBase(Strategy):
    """Flat parameter/gradient buffers + a sharded optimizer over the ``world`` group (shared by ZeRO-1 and
    the overlapping strategies built on it)."""

    group = "world"

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        n = self.transport.group_size(self.group)
        reduce_dtype = parse_dtype(getattr(self.config, "reduce_dtype", "float32"), "reduce_dtype")
        self.flat = FlatParams(self.param_groups, pad_to=n, policy=DTypePolicy(reduce_dtype=reduce_dtype))
        # Replicas start identical: rank 0's parameters win, as in DDP.
        self.transport.broadcast(self.flat.data, src=0, group=self.group, name="init_params")
        self.sharded = ShardedOptimizer(self.flat, self.optimizer_factory, self.optimizer_kwargs,
                                        self.transport.group_rank(self.group), n)
        self.optimizer = self.sharded.optimizer
        self._reset_step_accounting()  # the initial broadcast is set-up, not step 1's traffic

    def reduce_scatter_grads(self, grads: torch.Tensor, divisor: float, name: str = "grads") -> None:
        """``sharded.grad`` ← (Σ over workers of ``grads``, this worker's shard) / ``divisor``."""
        policy = self.flat.policy
        wire = grads if grads.dtype == policy.reduce_dtype else grads.to(policy.reduce_dtype)
        out = self.sharded.grad if self.sharded.grad.dtype == policy.reduce_dtype else torch.empty_like(
            self.sharded.grad, dtype=policy.reduce_dtype)
        self.transport.reduce_scatter(out, wire, self.group, name=f"reduce_scatter/{name}")
        if out is not self.sharded.grad:
            self.sharded.grad.copy_(out)
        self.sharded.grad.div_(divisor)

    def all_gather_params(self, source: torch.Tensor | None = None, name: str = "params") -> None:
        """The flat parameter buffer ← every worker's ``source`` shard (default: its master shard)."""
        src = self.sharded.master if source is None else source
        send = src.to(self.flat.dtype) if src.dtype != self.flat.dtype else src.clone()
        self.transport.all_gather(self.flat.data, send, self.group, name=f"all_gather/{name}")

    def memory_report(self) -> dict[str, int]:
        """Bytes held by each buffer this strategy owns."""
        def size(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        opt_state = sum(size(v) for st in self.optimizer.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor))
        return {"params": size(self.flat.data), "master_shard": size(self.sharded.master),
                "grad_shard": size(self.sharded.grad), "optimizer_state": opt_state}

    def _sharded_state(self) -> dict[str, Any]:
        return {"params": self.flat.data.clone(), "sharded": self.sharded.state_dict()}

    def _load_sharded_state(self, state: dict[str, Any]) -> None:
        if state["params"].numel() != self.flat.data.numel():
            raise ValueError("checkpoint parameters do not match this model's layout")
        with torch.no_grad():
            self.flat.data.copy_(state["params"])
        self.sharded.load_state_dict(state["sharded"])


@register("zero1", Zero1Config)
class Zero1(ShardedBase):
    """Blocking ZeRO-1; see the module docstring."""

    config: Zero1Config

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.grads = self.flat.new_grad_buffer()
        self.flat.attach_grads(self.grads)
        self._round = 0

    def _backward(self, loss: torch.Tensor) -> None:
        if not self.flat.grads_attached_to(self.grads):
            raise RuntimeError(
                "parameter .grad tensors were replaced (e.g. by zero_grad(set_to_none=True)); the strategy "
                "owns the gradients — do not zero them yourself"
            )
        loss.backward()
        self._round += 1

    def _step(self) -> bool:
        if self._round < self.config.accumulation:
            return False
        n = self.transport.group_size(self.group)
        with self._idle("reduce_scatter"):
            self.reduce_scatter_grads(self.grads, n * self.config.accumulation)
        t0 = time.perf_counter()
        self.sharded.step(self._lr_scale(self.steps))
        self._add_compute(time.perf_counter() - t0)
        with self._idle("all_gather"):
            self.all_gather_params()
        self.grads.zero_()
        self._round = 0
        self._commit()
        return True

    def memory_report(self) -> dict[str, int]:
        return {**super().memory_report(), "grads": self.grads.numel() * self.grads.element_size()}

    def _state(self) -> dict[str, Any]:
        return {**self._sharded_state(), "grads": self.grads.clone(), "round": self._round}

    def _load_state(self, state: dict[str, Any]) -> None:
        self._load_sharded_state(state)
        self.grads.copy_(state["grads"])
        self._round = int(state["round"])
