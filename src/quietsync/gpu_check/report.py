"""The GPU check's record: one :class:`Check` per thing checked (PASS, FAIL or SKIP, with its figure), the
tolerance rules they are judged by, and the writer of ``gpu-check.md`` / ``gpu-check.json``.

Nothing here needs a GPU: the report and the tolerance rules are unit-tested on CPU.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Status = Literal["PASS", "FAIL", "SKIP"]
STATUSES: tuple[str, ...] = ("PASS", "FAIL", "SKIP")


@dataclass
class Check:
    """One line of the report."""

    group: str
    """What kind of check: ``env``, ``tests``, ``train``, ``memory``, ``codec``, ``calibration``, ``compile``."""
    name: str
    """What was checked, e.g. ``zero1 bf16 vs fp32``."""
    status: Status
    """PASS, FAIL, or SKIP (not run here; ``figure`` says why)."""
    figure: str
    """The measured figure against its tolerance, or the reason for a SKIP / FAIL, in one line."""
    detail: dict[str, Any] = field(default_factory=dict)
    """Numbers behind the figure (losses, bytes, seconds), for the JSON."""
    seconds: float = 0.0
    """Wall time the check took."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:  # Literal is not enforced at runtime
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {self.status!r}")


@dataclass
class Report:
    """Everything one ``gpu_check`` run found, in order."""

    device: str
    """The device checked, as torch names it (``NVIDIA H100 80GB HBM3``), or ``cpu`` for a dry run."""
    versions: dict[str, str]
    """torch, CUDA, cuDNN, NCCL, Python, quietsync (and transformers) versions."""
    checks: list[Check] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    """Paths this run cannot check (they need two devices), one line each."""
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    seconds: float = 0.0
    """Wall time of the whole run."""

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        return check

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "FAIL"]

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in STATUSES}

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "versions": self.versions, "started": self.started,
                "seconds": round(self.seconds, 1), "counts": self.counts(), "ok": not self.failed,
                "checks": [asdict(c) for c in self.checks], "unchecked": self.unchecked}

    def to_markdown(self) -> str:
        counts = self.counts()
        lines = [f"# quietsync GPU check — {self.device}", "",
                 f"Run {self.started}, {self.seconds:.0f} s: **{counts['PASS']} passed, {counts['FAIL']} failed, "
                 f"{counts['SKIP']} skipped**.", "",
                 ", ".join(f"{k} {v}" for k, v in self.versions.items()), "",
                 "| group | check | result | figure | s |", "|---|---|---|---|---|"]
        for c in self.checks:
            figure = c.figure.replace("|", "\\|").replace("\n", " ")  # a '|' or newline would break the row
            lines.append(f"| {c.group} | {c.name} | {c.status} | {figure} | {c.seconds:.1f} |")
        if self.unchecked:
            lines += ["", "## Not checked here (needs two devices)", ""] + [f"- {u}" for u in self.unchecked]
        return "\n".join(lines) + "\n"

    def write(self, out: str | Path) -> tuple[Path, Path]:
        """Write ``gpu-check.md`` and ``gpu-check.json`` into ``out`` (created); return both paths."""
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        md, js = folder / "gpu-check.md", folder / "gpu-check.json"
        md.write_text(self.to_markdown())
        # default=str: a detail value json cannot encode is written as text instead of failing the report
        js.write_text(json.dumps(self.to_json(), indent=1, default=str) + "\n")
        return md, js


# ---------------------------------------------------------------------------------------------- tolerances

@dataclass(frozen=True)
class Tolerance:
    """``|a - b| <= atol + rtol * |b|`` (``b`` the reference), as ``torch.testing.assert_close`` reads it."""

    atol: float
    rtol: float = 0.0

    def gap(self, a: float, b: float) -> float:
        """How far ``a`` is from ``b``, as a fraction of what the tolerance allows (<= 1 passes; inf for NaN)."""
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.inf
        return abs(a - b) / (self.atol + self.rtol * abs(b))

    def holds(self, a: float, b: float) -> bool:
        return self.gap(a, b) <= 1.0

    def describe(self) -> str:
        parts = [f"{self.atol:g}"] + ([f"{self.rtol:g}·|ref|"] if self.rtol else [])
        return " + ".join(parts)


def trajectory_gap(a: Sequence[float], b: Sequence[float]) -> tuple[float, int]:
    """The largest ``|a[i] - b[i]|`` over the steps both have, and the step (1-based) where it is; ``(inf, i)``
    at the first non-finite value, ``(inf, 0)`` if either is empty."""
    n = min(len(a), len(b))
    if n == 0:
        return math.inf, 0
    worst, at = 0.0, 1
    for i in range(n):
        if not (math.isfinite(a[i]) and math.isfinite(b[i])):
            return math.inf, i + 1
        d = abs(a[i] - b[i])
        if d > worst:
            worst, at = d, i + 1
    return worst, at


def compare_values(group: str, name: str, value: float, reference: float, tol: Tolerance, what: str,
                   seconds: float = 0.0, **detail: Any) -> Check:
    """A check that ``value`` is within ``tol`` of ``reference`` (``what`` names the quantity)."""
    ok = tol.holds(value, reference)
    figure = f"{what} {value:.5g} vs {reference:.5g}: |Δ| {abs(value - reference):.3g} " \
             f"{'≤' if ok else '>'} {tol.describe()}"
    return Check(group, name, "PASS" if ok else "FAIL", figure, {"value": value, "reference": reference,
                                                                  "atol": tol.atol, "rtol": tol.rtol, **detail},
                 seconds)


def compare_trajectories(group: str, name: str, values: Sequence[float], reference: Sequence[float], atol: float,
                         what: str, seconds: float = 0.0, min_steps: int = 1, **detail: Any) -> Check:
    """A check that two per-step trajectories stay within ``atol`` of each other on every common step (and that
    both have at least ``min_steps`` steps)."""
    n = min(len(values), len(reference))
    gap, at = trajectory_gap(values, reference)
    ok = n >= min_steps and gap <= atol
    if n < min_steps:
        figure = f"{what}: {n} common steps, need {min_steps}"
    else:
        figure = f"{what} over {n} steps: max |Δ| {gap:.3g} (step {at}) {'≤' if ok else '>'} {atol:g}"
    return Check(group, name, "PASS" if ok else "FAIL", figure,
                 {"values": list(values), "reference": list(reference), "atol": atol, **detail}, seconds)
