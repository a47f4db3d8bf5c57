"""The trainer's bridge to the data room (:mod:`quietsync.train.job_data`): a job's ``--dataset`` is prepared once
into ``--cache-dir``, under a lock, and reused."""

from __future__ import annotations

import threading

import pytest

from quietsync.train import job_data
from quietsync.train.config import TrainConfig

from .conftest import synthetic_text

pytestmark = pytest.mark.timeout(60)


def test_the_implicit_prepare_is_done_by_one_process_under_a_lock(tmp_path, monkeypatch):
    """Workers that start together: one prepares, the others wait for its index and map the same folder."""
    (tmp_path / "t.txt").write_text(synthetic_text(400))
    cfg = TrainConfig(dataset=str(tmp_path / "t.txt"), vocab_size=300, cache_dir=str(tmp_path / "cache"),
                      model="tiny")
    real = job_data.prepare
    calls = []

    def counted(*args, **kwargs):
        calls.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(job_data, "prepare", counted)
    folders = []
    threads = [threading.Thread(target=lambda: folders.append(job_data.job_folder(cfg))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(folders)) == 1 and len(folders) == 3
    assert not list((tmp_path / "cache").glob("*.lock"))
    assert job_data.job_folder(cfg) == folders[0] and len(calls) == 1  # later runs reuse it
