"""Strategy flags whose allowed values depend on the model are refused before any worker starts: one line
naming the flag and the allowed range, exit status 2 (the launcher builds the model on the meta device)."""

from __future__ import annotations

import pytest

from ._run import refused, small_job

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("flags,expect", [
    (["--strategy", "diloco", "--sync-every", "64", "--fragments", "32"],
     "--fragments must be <= the 30 parameter tensors of --model tiny (a fragment holds whole tensors), got 32"),
    (["--strategy", "cdp", "--stages", "6"],
     "--stages must be <= the 5 segments this model can be cut into (transformer.wte, transformer.h.0, "
     "transformer.h.1, transformer.ln_f, lm_head), got 6"),
    (["--strategy", "cdp", "--partition", "manual", "--manual-stages", "transformer.h.7"],
     "--manual-stages names unknown segments ['transformer.h.7']; segments are transformer.wte, transformer.h.0, "
     "transformer.h.1, transformer.ln_f, lm_head"),
    (["--strategy", "cdp", "--stages", "3"], "--stages must be a multiple of the 2 workers, got 3"),
])
def test_structure_dependent_flags_are_one_line_before_workers(tmp_path, monkeypatch, capsys, flags, expect):
    line = refused(monkeypatch, capsys, *small_job(tmp_path), *flags, "--out", str(tmp_path / "out"))
    assert line == f"quietsync train: error: {expect}"


def test_values_the_model_allows_pass_the_check(tmp_path):
    from quietsync.strategies import get
    from quietsync.train.config import TrainConfig
    from quietsync.train.model_check import model_problem

    cfg = TrainConfig(strategy="diloco", model="tiny", vocab_size=300)
    assert model_problem(cfg, get("diloco")[1](sync_every=30, fragments=30), 2) is None
    cfg = TrainConfig(strategy="cdp", model="tiny", vocab_size=300)
    assert model_problem(cfg, get("cdp")[1](stages=4), 2) is None
    assert model_problem(cfg, get("cdp")[1](partition="manual", manual_stages="transformer.h.1"), 2) is None
