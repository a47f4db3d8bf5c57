"""The suite passes in any order: what one test leaves in its process does not reach the next (the autouse
fixture of tests/conftest.py). Checked here on a pair that once failed in that order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.long
@pytest.mark.timeout(180)
def test_a_trainer_built_with_fp16_leaves_the_next_accelerator_at_its_own_precision():
    """A ``QuietTrainer`` built with ``fp16=True`` (refused for cdp) set 🤗 Accelerate's process-wide state to fp16,
    and the next test's ``QuietAccelerator(strategy="cdp")`` in the same process read it back and was refused."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    first = "tests/test_trainer.py::test_trainer_takes_its_default_clipping_and_refuses_what_it_cannot_do"
    then = ("tests/test_accelerate.py::"
            "test_accelerator_backward_is_refused_for_a_strategy_that_owns_its_schedule_naming_forward_backward")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:xdist",
                           "-p", "no:cacheprovider", first, then], cwd=ROOT, capture_output=True, text=True,
                          timeout=170)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
