"""``--profile-steps A:B``: ``torch.profiler`` over committed steps A to B, as a Chrome trace per worker.

quietsync labels its phases with ``torch.profiler.record_function`` (:func:`quietsync.events.label`):
``quietsync/forward``, ``quietsync/backward``, ``quietsync/step``, ``quietsync/optimizer_step``,
``quietsync/comm/<kind>`` (issuing a collective) and ``quietsync/comm/wait``, so the profile shows them around
torch's own operators. The profiler records CPU activity, plus CUDA kernels when the worker runs on a GPU.
It starts before the first micro-batch of step A and stops right after step B commits (before that step's
evaluation or checkpoint), then each worker writes ``OUT/profile-rank{R}.json``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a profiler starts (the config imports this module)
    import torch


def parse_profile_steps(spec: str) -> tuple[int, int]:
    """``"A:B"`` → ``(A, B)``, committed steps ``1 <= A <= B``; ValueError (one line) otherwise."""
    first, sep, last = spec.partition(":")
    try:
        a, b = int(first), int(last)
    except ValueError:
        a = b = 0
    if not sep or not 1 <= a <= b:
        raise ValueError(f"profile_steps must look like A:B with committed steps 1 <= A <= B, got {spec!r}")
    return a, b


class StepProfiler:
    """Runs ``torch.profiler`` over committed steps ``A..B`` of one worker (a no-op without a spec).

    Args:
        spec: ``"A:B"`` (see :func:`parse_profile_steps`) or None.
        out: the run's output folder.
        rank: this worker's rank (names the file).
        device: the worker's device (CUDA activities are recorded on a GPU).
    """

    def __init__(self, spec: str | None, out: str | os.PathLike, rank: int, device: torch.device) -> None:
        self.steps = parse_profile_steps(spec) if spec else None
        self.path = Path(out) / f"profile-rank{rank}.json"
        self.device = device
        self._prof: Any = None
        self._done = False

    def before_micro_batch(self, committed: int) -> None:
        """Call before each micro-batch with the committed step count: starts the profiler when the next
        step to commit is A (or later, up to B, after a resume)."""
        if self.steps is None or self._prof is not None or self._done:
            return
        a, b = self.steps
        if a - 1 <= committed < b:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.start()

    def after_commit(self, committed: int) -> None:
        """Call after each committed step: stops the profiler and writes the file once step B committed."""
        if self._prof is not None and self.steps is not None and committed >= self.steps[1]:
            self.close()

    def close(self) -> Path | None:
        """Stop a running profiler and write ``profile-rank{R}.json`` (returns its path); idempotent."""
        if self._prof is None:
            return None
        prof, self._prof, self._done = self._prof, None, True
        prof.stop()
        prof.export_chrome_trace(str(self.path))
        return self.path
