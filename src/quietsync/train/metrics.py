"""Per-step metrics files, the run summary and the summary table.

Files under ``--out`` (schema documented in ``docs/train.md``):

* ``metrics-rank{R}.jsonl``: one JSON object per committed step of worker ``R`` (:data:`STEP_FIELDS`), and an
  ``{"event": "eval", ...}`` object (:data:`EVAL_FIELDS`) whenever evaluation runs;
* ``summary.json``: the run as a whole (:data:`SUMMARY_FIELDS`), written by rank 0.

With ``--log-with`` the same records also go, flattened, to TensorBoard, CSV or W&B
(:mod:`quietsync.train.sinks`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .sinks import MetricsSink

STEP_FIELDS = (
    "step", "rank", "loss", "lr", "tokens", "tokens_total", "micro_batches", "compute_s", "comm_s", "idle_s",
    "bytes_sent", "bytes_recv", "bytes_by_group", "slow_sleep_s", "time_s",
)
"""Keys of every per-step record (``extra`` is added when the strategy reports strategy-specific numbers)."""

EVAL_FIELDS = ("event", "step", "rank", "loss", "perplexity", "tokens_total", "eval_s", "time_s")
"""Keys of every ``{"event": "eval"}`` record."""

SUMMARY_FIELDS = (
    "strategy", "world_size", "nodes", "model", "parameters", "steps", "stopped_by", "budgets", "micro_batches",
    "tokens", "wall_s",
    "setup_s", "tokens_per_s", "first_eval_loss", "last_eval_loss", "eval", "bytes_sent", "bytes_recv",
    "bytes_by_group", "bytes_sent_per_step", "compute_s", "comm_s", "idle_s", "compute_fraction",
    "memory_bytes", "cuda_peak_bytes", "links", "slow_worker", "config", "strategy_config", "replicas",
)
"""Keys of ``summary.json`` (``memory_bytes``: rank 0's ``memory_report()`` at the end of training;
``cuda_peak_bytes``: the CUDA allocator's peak on rank 0's device, None on the CPU; ``replicas``: whether the
workers' committed parameters ended the same, :mod:`quietsync.train.replicas`)."""


def _jsonable(value: Any) -> Any:
    """JSON form of what strategies may put in ``StepMetrics.extra`` (tensors, numpy scalars, tuples)."""
    if hasattr(value, "tolist"):  # torch tensors, numpy arrays and scalars
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)


def finite_json(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, ±inf) replaced by None, so ``json.dumps(...,
    allow_nan=False)`` writes strict JSON (``NaN`` is not JSON; a diverged run's loss becomes ``null``)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """Strict JSON of a record or summary (non-finite floats become null; tensors and sets converted)."""
    # plain JSON first: tensors and numpy values become the floats finite_json can check
    plain = json.loads(json.dumps(value, default=_jsonable, allow_nan=True))
    return json.dumps(finite_json(plain), allow_nan=False, **kwargs)


def metrics_path(out: str | os.PathLike, rank: int) -> Path:
    """``OUT/metrics-rank{rank}.jsonl``."""
    return Path(out) / f"metrics-rank{rank}.jsonl"


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a JSONL file (a torn last line, from a crash, is skipped)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


class MetricsWriter:
    """Appends this worker's records to ``metrics-rank{R}.jsonl``, one flushed line each.

    With ``resume_step`` the file is first cut back to the records of steps ``<= resume_step`` (a crashed
    run may have logged steps after its last checkpoint); with ``append`` every record already there is kept
    as it is and the new ones follow (without reading or rewriting the file: a replica that restarts under
    ``--fault-tolerance torchft`` opens it while its peers wait for it); otherwise it starts empty. Every record
    written, the kept ones included (not the appended-to ones), is also handed flattened to each of ``sinks``
    (closed with the writer).
    """

    def __init__(
        self, out: str | os.PathLike, rank: int, resume_step: int | None = None,
        sinks: Sequence[MetricsSink] = (), append: bool = False,
    ) -> None:
        if append and resume_step is not None:
            raise ValueError("MetricsWriter: append keeps every record, resume_step cuts them back: give one")
        self.path = metrics_path(out, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        kept: list[dict[str, Any]] = []
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_jsonl(self.path) if int(r.get("step", 0)) <= resume_step]
        self.kept = kept
        """Records carried over from before the resume point."""
        self.sinks = list(sinks)
        """Other outputs fed the flattened records (``--log-with``)."""
        self._f = open(self.path, "a" if append else "w", encoding="utf-8")
        if append and self._f.tell() and not _ends_a_line(self.path):
            self._f.write("\n")  # a process killed mid-line: its partial record stays unreadable on its own line
        for record in kept:
            self._write(record)

    def _write(self, record: dict[str, Any]) -> None:
        self._f.write(dumps(record, separators=(",", ":")) + "\n")
        self._f.flush()  # to the OS now: a killed worker leaves every finished record
        if self.sinks:
            from .sinks import flatten

            flat = flatten(record)
            for sink in self.sinks:
                sink.log(flat, int(record["step"]))

    def step(self, record: dict[str, Any]) -> None:
        """Write one committed step (must hold every key of :data:`STEP_FIELDS`)."""
        missing = [k for k in STEP_FIELDS if k not in record]
        if missing:
            raise ValueError(f"step record lacks {missing}")
        self._write(record)

    def eval(self, step: int, loss: float, tokens_total: int, eval_s: float, time_s: float) -> dict[str, Any]:
        """Write an ``{"event": "eval"}`` record and return it."""
        record = {
            "event": "eval", "step": step, "rank": self.rank, "loss": loss,
            # capped: math.exp raises OverflowError past ~709 (a diverged loss)
            "perplexity": math.exp(min(loss, 50.0)), "tokens_total": tokens_total,
            "eval_s": eval_s, "time_s": time_s,
        }
        self._write(record)
        return record

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _ends_a_line(path: Path) -> bool:
    """Whether the (non-empty) file at ``path`` ends with a newline."""
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def knob_change(record: dict[str, Any]) -> dict[str, Any] | None:
    """The knob change ``--adapt`` made at this step record (its ``extra.adapt``: ``step``, ``knob``, ``old``,
    ``new``, ``why``), or None."""
    extra = record.get("extra")
    change = extra.get("adapt") if isinstance(extra, dict) else None
    return change if isinstance(change, dict) else None


def write_summary(out: str | os.PathLike, summary: dict[str, Any]) -> Path:
    """Write ``OUT/summary.json`` (atomically)."""
    path = Path(out) / "summary.json"
    tmp = path.with_name("summary.json.tmp")
    tmp.write_text(dumps(summary, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


_CHANGES_SHOWN = 4
"""Knob changes of ``--adapt`` the terminal's summary lists (summary.json keeps them all)."""


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as an aligned two-column table for the terminal."""
    first, last = summary.get("first_eval_loss"), summary.get("last_eval_loss")
    evals = f"{first:.3f} -> {last:.3f}" if first is not None and last is not None else "n/a"
    rows = [
        ("strategy", summary["strategy"]),
        ("workers x nodes", f"{summary['world_size']} workers, {summary['nodes']} node(s)"),
        ("model", f"{summary['model']} ({summary['parameters'] / 1e6:.2f} M parameters)"),
        ("steps / micro-batches", f"{summary['steps']} / {summary['micro_batches']}"),
        ("stopped by", str(summary.get("stopped_by"))),
        ("tokens", f"{summary['tokens']:,}"),
        ("wall time", f"{summary['wall_s']:.1f} s (+ {summary['setup_s']:.1f} s setup)"),
        ("throughput", f"{summary['tokens_per_s']:,.0f} tokens/s"),
        ("eval loss first -> last", evals),
        ("bytes sent / recv (total)", f"{_mb(summary['bytes_sent'])} / {_mb(summary['bytes_recv'])}"),
        ("bytes sent per step", _mb(summary["bytes_sent_per_step"]) + " (all workers)"),
        ("compute / comm / idle", "{:.1f} / {:.1f} / {:.1f} s (summed over workers)".format(
            summary["compute_s"], summary["comm_s"], summary["idle_s"])),
        ("compute-busy fraction", f"{summary['compute_fraction']:.1%}"),
    ]
    rows += list((summary.get("strategy_summary") or {}).items())  # what the strategy says it did
    changes = summary.get("adapt") or []
    if changes:  # --adapt's knob changes, the first few (every one is in metrics-rank0.jsonl and summary.json)
        knobs = {c["knob"] for c in changes}
        one = len(knobs) == 1
        shown = ", ".join(("" if one else f"{c['knob']} ") + f"{c['old']} -> {c['new']} (step {c['step']})"
                          for c in changes[:_CHANGES_SHOWN])
        more = f", and {len(changes) - _CHANGES_SHOWN} more" if len(changes) > _CHANGES_SHOWN else ""
        rows.append(("--adapt " + (knobs.pop() if one else "changes"), shown + more))
    if summary.get("memory_bytes"):
        rows.append(("buffers held (rank 0)", _mb(sum(summary["memory_bytes"].values()))))
    if summary.get("cuda_peak_bytes"):
        rows.append(("CUDA peak allocated (rank 0)", _mb(summary["cuda_peak_bytes"])))
    for group, v in sorted(summary.get("bytes_by_group", {}).items()):
        if v.get("sent") or v.get("recv"):
            rows.append((f"  bytes {group}", f"{_mb(v['sent'])} sent / {_mb(v['recv'])} recv"))
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(str(v)) for _, v in rows))
    return "\n".join([line] + [f"{k:<{width}} | {v}" for k, v in rows] + [line])
