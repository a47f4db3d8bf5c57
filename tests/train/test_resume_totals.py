"""A resumed run's summary counts the whole run, as an unbroken run of the same steps does.

The bytes sent and received (total and per group) are the unbroken run's: the steps before the checkpoint are
counted from their kept records, the set-up traffic (the start's broadcast) once, by the process that resumed, as
the unbroken run counts its own once. The resumed run also counts what it really sent to agree on where to
resume (a few int64s in the world group): it differs from the unbroken run by that, under 1 KB.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(300)


def test_a_resumed_run_counts_the_bytes_of_the_steps_before_its_checkpoint(tmp_path):
    from ._run import small_job, train

    job = [*small_job(tmp_path), "--save-every", "3"]
    whole = train(*job, "--max-steps", "6", "--out", str(tmp_path / "whole"), timeout=240)
    assert whole.returncode == 0, whole.stderr[-3000:]
    half = train(*job, "--max-steps", "3", "--out", str(tmp_path / "parts"), timeout=240)
    assert half.returncode == 0, half.stderr[-3000:]
    rest = train(*job, "--max-steps", "6", "--out", str(tmp_path / "parts"), "--resume", timeout=240)
    assert rest.returncode == 0, rest.stderr[-3000:]
    a = json.loads((tmp_path / "whole" / "summary.json").read_text())
    b = json.loads((tmp_path / "parts" / "summary.json").read_text())
    assert b["steps"] == a["steps"] == 6
    assert a["bytes_sent"] > 1_000_000  # 6 steps of the tiny model's gradients: megabytes
    assert set(b["bytes_by_group"]) == set(a["bytes_by_group"]) == {"world"}
    for d in ("sent", "recv"):
        extra = b["bytes_by_group"]["world"][d] - a["bytes_by_group"]["world"][d]
        assert 0 <= extra < 1024, (d, a["bytes_by_group"], b["bytes_by_group"])
    assert b["bytes_sent"] == b["bytes_by_group"]["world"]["sent"]  # the table's total is the groups' sum
