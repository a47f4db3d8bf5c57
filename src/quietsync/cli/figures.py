"""Figures the command line writes (``loss.png``, ``compare.png``, ``plan.png``, timelines): matplotlib on the
file-only Agg backend, imported on first use (training needs no plots; matplotlib comes with the ``train``
extra), at one resolution."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

DPI = 110
"""Resolution of every figure quietsync writes."""


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend (imported on first use: training needs no plots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, out: str | os.PathLike, name: str) -> Path:
    """Write ``fig`` to ``out/name``, close it, return the path."""
    path = Path(out) / name
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)  # pyplot keeps every figure alive until it is closed
    return path
