"""Every GPU path of quietsync checked in one command, on one CUDA device: ``python -m quietsync.gpu_check``
(``make gpu-check``).

It runs the suite's ``gpu``-marked tests; every strategy on the device through ``quietsync train`` in bf16 against
fp32 and against the CPU; DeMo's codec on the device against an fp64 oracle and the reference implementation;
the planner's calibration against a timed run; ``--compile`` against eager; and the CUDA allocator's peak beside
each strategy's ``memory_report()``. It writes ``gpu-check.md`` and ``gpu-check.json`` and exits non-zero on any
failure. Without a CUDA device it refuses in one line (``--device cpu`` runs the same harness on the CPU, to check
the harness itself).
"""

from .report import Check, Report, Tolerance, compare_trajectories, compare_values, trajectory_gap

__all__ = ["Check", "Report", "Tolerance", "compare_trajectories", "compare_values", "trajectory_gap"]
