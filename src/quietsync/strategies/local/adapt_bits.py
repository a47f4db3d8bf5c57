"""``--adapt`` of DiLoCo's pseudo-gradient bits: the candidate dtypes, and one fragment's exchange whose dtype can
change during the run (:class:`SwitchedExchange`).

**The residual across a change.** Each fragment keeps **one** error-feedback residual ``e`` (pseudo-gradient
units, fp32), whichever dtype is current: every low-bit candidate's error feedback works on that same buffer
(``a = e + Δ`` is quantized, ``e ← a − decode``), so a change between low-bit dtypes carries what the old one still
owed into the next sync, quantized by the new one. A change to a dtype without error feedback (fp32, bf16, int8)
sends ``Δ + e`` at its next sync and leaves ``e = 0`` (nothing owed is lost, it is sent at the higher precision);
a change from such a dtype to a low-bit one starts from that ``e`` (0 after a dense sync). Without
``pseudo_grad_error_feedback`` there is no residual and a change only changes the codec of the next sync.

The codec's own state (a stochastic rounding's generator) is each candidate's own and kept across changes.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ...wire.exchange import Exchange
from ...wire.packed import LOWBIT_PSEUDO_GRAD_DTYPES, PackedExchange

BITS = {"fp32": 32, "bf16": 16, "int8": 8, "fp4": 4, "fp4_e3m0": 4, "int4": 4, "int2": 2}
"""Bits per value of each pseudo-gradient dtype (what the candidates are ordered by)."""
ADAPT_KNOBS = ("H", "bits")
"""The knobs ``adapt_knobs`` may name: H (sync_every), bits (pseudo_grad_dtype)."""
DEFAULT_LOWER = ("fp4", "int2")
"""The default candidates below the configured dtype (Streaming DiLoCo sends 4-bit outer gradients; SparseLoCo
2-bit values)."""


def parse_knobs(text: str) -> tuple[str, ...]:
    """The knobs of ``adapt_knobs`` (comma-separated), checked (raises ValueError naming the allowed values)."""
    knobs = tuple(k.strip() for k in text.split(",") if k.strip())
    if "tau" in knobs or "fragments" in knobs:
        raise ValueError("adapt_knobs must be H and/or bits: tau and fragments are not adapted (a change of either "
                         "would move the merge of the fragment in flight or the staggered launches, which have no step "
                         f"where every fragment just synced), got {text!r}")
    bad = [k for k in knobs if k not in ADAPT_KNOBS]
    if not knobs or bad or len(set(knobs)) != len(knobs):
        raise ValueError(f"adapt_knobs must be a comma-separated list of {', '.join(ADAPT_KNOBS)} (each once), "
                         f"got {text!r}")
    return knobs


def bits_candidates(cfg: Any) -> tuple[str, ...]:
    """The candidate pseudo-gradient dtypes of ``cfg`` (an outer config with ``adapt``), most bits first, checked.

    Default: the configured dtype, then those of :data:`DEFAULT_LOWER` with fewer bits."""
    dtype = cfg.pseudo_grad_dtype
    if cfg.adapt_pseudo_grad_dtype.strip():
        values = tuple(v.strip() for v in cfg.adapt_pseudo_grad_dtype.split(","))
    else:
        values = (dtype, *(d for d in DEFAULT_LOWER if BITS[d] < BITS.get(dtype, 0)))
    bad = [v for v in values if v not in BITS]
    if bad:
        raise ValueError(f"adapt_pseudo_grad_dtype must be dtypes among {', '.join(BITS)}, comma-separated, "
                         f"got {cfg.adapt_pseudo_grad_dtype!r}")
    if len(set(values)) != len(values) or any(BITS[a] < BITS[b] for a, b in zip(values, values[1:])):
        raise ValueError(f"adapt_pseudo_grad_dtype must list each dtype once, most bits first (e.g. fp32,bf16,fp4), "
                         f"got {cfg.adapt_pseudo_grad_dtype!r}")
    if dtype not in values:
        raise ValueError(f"adapt_pseudo_grad_dtype must include pseudo_grad_dtype ({dtype}), got {','.join(values)}")
    if cfg.pseudo_grad_replicator != "none":
        raise ValueError(f"adapt_knobs bits needs pseudo_grad_replicator none (a replicator's residual is in its own "
                         f"units), got {cfg.pseudo_grad_replicator!r}")
    if cfg.outer == "sparseloco":
        raise ValueError("adapt_knobs bits needs outer sgd (SparseLoCo's decayed accumulator is tied to its top-k "
                         "codec), got outer 'sparseloco'")
    return values


class SwitchedExchange:
    """One fragment's pseudo-gradient exchange under ``--adapt`` bits: one exchange per candidate dtype, the
    ``current`` one used, one residual shared (module docstring).

    Args:
        exchanges: the exchange of each candidate dtype (built as a static run of that dtype builds it).
        current: the dtype used now.
        numel, device: the fragment's elements and where the residual lives.
        error_feedback: keep the shared residual (``pseudo_grad_error_feedback``).
    """

    packed_residual = True
    """A logical checkpoint names the residual as a packed exchange's (as a static low-bit run does)."""

    def __init__(self, exchanges: dict[str, Exchange], current: str, numel: int, device: torch.device,
                 error_feedback: bool) -> None:
        self.exchanges, self.current = exchanges, current
        self._residual = torch.zeros(numel, dtype=torch.float32, device=device) if error_feedback else None
        for e in exchanges.values():
            if isinstance(e, PackedExchange) and e.feedback is not None:
                e.feedback.residual = self._residual  # every low-bit codec works on the one residual

    @property
    def residual(self) -> torch.Tensor | None:
        return self._residual

    def average(self, x: torch.Tensor) -> torch.Tensor:
        e = self.exchanges[self.current]
        if self._residual is not None and e.residual is None:
            # a dtype without error feedback sends what the low-bit ones still owed and owes nothing after
            x = x + self._residual.to(x.device)
            self._residual.zero_()
        return e.average(x)

    def payload_bytes(self) -> int:
        return self.exchanges[self.current].payload_bytes()

    def state_dict(self) -> dict[str, Any]:
        return {"dtype": self.current, "exchanges": {d: e.state_dict() for d, e in self.exchanges.items()},
                "residual": None if self._residual is None else self._residual.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if sorted(state["exchanges"]) != sorted(self.exchanges):
            raise ValueError(f"checkpoint adapt_pseudo_grad_dtype candidates {sorted(state['exchanges'])} do not "
                             f"match this run's {sorted(self.exchanges)}")
        for d, e in self.exchanges.items():
            e.load_state_dict(state["exchanges"][d])
        if self._residual is not None and state["residual"] is not None:
            self._residual.copy_(state["residual"])
        self.current = str(state["dtype"])


def switched_exchange(config: Any, build: Any, numel: int, device: torch.device) -> SwitchedExchange:
    """The :class:`SwitchedExchange` of one fragment: ``build(cfg)`` makes the exchange of a static run of ``cfg``
    (one per candidate dtype, error feedback on the low-bit ones when configured)."""
    exchanges = {}
    for d in bits_candidates(config):
        each = copy.copy(config)  # a static run's config at this dtype (no re-check: the candidates are checked)
        each.pseudo_grad_dtype = d
        each.pseudo_grad_error_feedback = bool(config.pseudo_grad_error_feedback and d in LOWBIT_PSEUDO_GRAD_DTYPES)
        exchanges[d] = build(each)
    return SwitchedExchange(exchanges, config.pseudo_grad_dtype, numel, device,
                            bool(config.pseudo_grad_error_feedback))


__all__ = ["ADAPT_KNOBS", "BITS", "SwitchedExchange", "bits_candidates", "parse_knobs", "switched_exchange"]
