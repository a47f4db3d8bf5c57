"""Metrics outputs besides the JSONL files: TensorBoard, CSV and Weights & Biases (``--log-with``).

:class:`~quietsync.train.metrics.MetricsWriter` hands every record it writes to the JSONL file to each
sink as well, *flattened* (:func:`flatten`): nested keys are joined with ``/``, ``bytes_by_group`` is
spelled ``bytes`` (``bytes/replicate/sent``), and the keys of an evaluation record are prefixed with
``eval/`` (``eval/loss``, ``eval/perplexity``); ``step`` and ``rank`` stay as they are.

Who writes what (under ``--out``):

* ``csv``: every worker, ``metrics-rank{R}.csv``, the same rows as its JSONL (one column per flat key;
  the header grows, and the file is rewritten, when a record brings a new key);
* ``tensorboard``: rank 0 only, event files under ``tensorboard/`` (``tensorboard --logdir OUT``);
* ``wandb``: rank 0 only, one run of project ``$WANDB_PROJECT`` (default ``quietsync``) with the job's
  config, files under ``wandb/``; ``WANDB_MODE=offline`` logs without a network (``wandb sync`` later).

On ``--resume`` each sink is rebuilt from the records the JSONL keeps (TensorBoard hides its earlier
events, so a crashed run's steps past the checkpoint do not show twice; W&B starts a new run). Under
``--fault-tolerance torchft`` a replica that restarts continues its sinks (no step is taken back there): its CSV
rows follow the earlier ones, its TensorBoard events go to a new file beside the earlier ones, and a restarted
rank 0 starts a new W&B run.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "LOGGERS", "MetricsSink", "CSVSink", "TensorBoardSink", "WandbSink", "flatten", "parse_log_with",
    "open_sinks", "csv_path", "TENSORBOARD_DIR",
]

LOGGERS = ("tensorboard", "csv", "wandb")
"""Names ``--log-with`` accepts."""

_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""Logger name -> the import it needs (``csv`` needs none)."""

TENSORBOARD_DIR = "tensorboard"
"""Sub-folder of ``--out`` holding the TensorBoard event files."""

_RENAMES = {"bytes_by_group": "bytes"}
"""Top-level record keys with a shorter flat name."""

_IDENTITY = ("step", "rank")
"""Keys kept unprefixed in every flat record (the others of an eval record get ``eval/``)."""


@runtime_checkable
class MetricsSink(Protocol):
    """Where flat metric records go besides the JSONL."""

    def log(self, record: dict[str, Any], step: int) -> None:
        """Take one flat record (:func:`flatten`) of committed step ``step``."""

    def close(self) -> None:
        """Flush and release the output (idempotent)."""


def parse_log_with(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"tensorboard,csv"`` (or a list of names) -> ``("tensorboard", "csv")``, checked.

    Raises ``ValueError("log_with ...")`` (one line) for a name not in :data:`LOGGERS` or one whose
    package is not installed.
    """
    if value is None:
        return ()
    parts = value.split(",") if isinstance(value, str) else list(value)
    names: list[str] = []
    for part in parts:
        name = str(part).strip().lower()
        if not name:
            continue
        if name not in LOGGERS:
            raise ValueError(f"log_with must be a comma list of {', '.join(LOGGERS)}; got {str(part).strip()!r}")
        package = _PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            raise ValueError(f"log_with {name} needs the {package} package: pip install {package}")
        if name not in names:
            names.append(name)
    return tuple(names)


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):  # tensors, numpy arrays and scalars
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return value


def _flatten_into(out: dict[str, Any], key: str, value: Any) -> None:
    value = _plain(value)
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten_into(out, f"{key}/{k}", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten_into(out, f"{key}/{i}", v)
    else:
        out[key] = value


def flatten(record: dict[str, Any]) -> dict[str, Any]:
    """One JSONL record as ``{"a/b/c": scalar}`` (see the module docstring for the names)."""
    prefix = "eval/" if record.get("event") == "eval" else ""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if key == "event":
            continue
        name = key if key in _IDENTITY else prefix + _RENAMES.get(key, key)
        _flatten_into(out, name, value)
    return out


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of a flat record, without ``step`` and ``rank``."""
    return {
        k: float(v) for k, v in record.items()
        if k not in _IDENTITY and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def csv_path(out: str | os.PathLike, rank: int) -> Path:
    """``OUT/metrics-rank{rank}.csv``."""
    return Path(out) / f"metrics-rank{rank}.csv"


class CSVSink:
    """``metrics-rank{R}.csv``: one row per record, one column per flat key (empty where a row has none).

    Each row is written and flushed as it comes. A record that brings a new key rewrites the file under the
    grown header (the rows so far read back from it). With ``append`` a file already there is continued under
    its own header (a replica restarted under ``--fault-tolerance torchft``: its earlier steps stay); otherwise
    the file starts empty."""

    def __init__(self, path: str | os.PathLike, append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns: list[str] = []
        self._f: io.TextIOWrapper | None = None
        if append and self.path.exists() and self.path.stat().st_size:  # an empty file has no header to go on under
            with open(self.path, encoding="utf-8", newline="") as f:
                self.columns = next(csv.reader(f), [])
            self._f = open(self.path, "a", encoding="utf-8", newline="")
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                cut = f.read(1) != b"\n"
            if cut:  # a process killed mid-row: its partial row stays, short, on its own line
                self._f.write("\n")
        else:
            self._rewrite([])

    @staticmethod
    def _cell(value: Any) -> Any:
        return "" if value is None else value

    def _rows(self) -> list[dict[str, Any]]:
        """The rows written so far (their cells as the text written)."""
        if self._f is not None:
            self._f.flush()  # the rows read back include the last one written
        with open(self.path, encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        if self._f is not None:
            self._f.close()
        self._f = open(self.path, "w", encoding="utf-8", newline="")
        writer = csv.writer(self._f)
        if self.columns:
            writer.writerow(self.columns)
            for row in rows:
                writer.writerow([self._cell(row.get(c)) for c in self.columns])
        self._f.flush()

    def log(self, record: dict[str, Any], step: int) -> None:
        row = dict(record)
        row.setdefault("step", step)
        new = [k for k in row if k not in self.columns]
        if new:
            rows = self._rows() if self.columns else []
            self.columns += new
            self._rewrite([*rows, row])
            return
        assert self._f is not None
        csv.writer(self._f).writerow([self._cell(row.get(c)) for c in self.columns])
        self._f.flush()

    def close(self) -> None:
        if self._f is not None and not self._f.closed:
            self._f.close()


class TensorBoardSink:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package).

    ``resume=True`` marks the event stream so that TensorBoard hides what earlier writers logged in the
    same folder (the kept records are then logged again).
    """

    def __init__(self, log_dir: str | os.PathLike, resume: bool = False, config: dict[str, Any] | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(str(self.log_dir), purge_step=0 if resume else None)
        if config:
            import json

            # a code block: TensorBoard renders text as Markdown
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def log(self, record: dict[str, Any], step: int) -> None:
        for key, value in _scalars(record).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run (needs the ``wandb`` package; ``WANDB_MODE=offline`` works without a network)."""

    def __init__(self, out: str | os.PathLike, config: dict[str, Any] | None = None) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "quietsync"), dir=str(out), config=config or {},
            name=Path(out).resolve().name,
        )
        self._closed = False

    def log(self, record: dict[str, Any], step: int) -> None:
        self.run.log(_scalars(record), step=step)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.run.finish()


def open_sinks(
    names: str | Iterable[str] | None,
    out: str | os.PathLike,
    rank: int,
    *,
    resume: bool = False,
    append: bool = False,
    config: dict[str, Any] | None = None,
) -> list[MetricsSink]:
    """The sinks of ``--log-with`` for worker ``rank`` (TensorBoard and W&B on rank 0 only); ``append``: continue
    what a previous process of this worker wrote (a CSV file under its header, TensorBoard's events beside it)."""
    chosen = parse_log_with(names if names is None or isinstance(names, str) else list(names))
    sinks: list[MetricsSink] = []
    try:
        for name in chosen:
            if name == "csv":
                sinks.append(CSVSink(csv_path(out, rank), append=append))
            elif name == "tensorboard" and rank == 0:
                sinks.append(TensorBoardSink(Path(out) / TENSORBOARD_DIR, resume=resume, config=config))
            elif name == "wandb" and rank == 0:
                sinks.append(WandbSink(out, config=config))
    except BaseException:
        for sink in sinks:  # those opened before the failure (a W&B run) are not left open
            sink.close()
        raise
    return sinks
