"""Checkpoints are read safely: a crafted pickle is refused before it can run code; a truncated or foreign
file gets one clear error naming it; a real checkpoint round-trips."""

from __future__ import annotations

import os
import pickle
import re

import pytest
import torch

from quietsync.train.checkpoint import load_checkpoint, rank_file, save_checkpoint


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    folder = tmp_path / "checkpoints" / "step-0000001"
    folder.mkdir(parents=True)
    torch.save({"strategy": _Exploit(str(marker))}, rank_file(folder, 0))
    with pytest.raises(ValueError, match="refusing to load checkpoint .*rank0.pt"):
        load_checkpoint(folder, 0)
    assert not marker.exists()
    # the same file loaded the unsafe way would have run the command: the test can fail
    torch.load(rank_file(folder, 0), weights_only=False)
    assert marker.exists()


def _one_clear_error(path, match: str) -> str:
    """Loading ``path``'s folder raises one ValueError: one line, naming the file, matching ``match``."""
    with pytest.raises(ValueError) as e:
        load_checkpoint(path.parent, 1)
    message = str(e.value)
    assert str(path) in message, message
    assert "\n" not in message, message
    assert re.search(match, message), message
    return message


def test_truncated_and_foreign_files_get_one_clear_error(tmp_path):
    path = save_checkpoint(tmp_path, 3, 1, {"strategy": {"steps": torch.tensor(3)}, "data": [1, 2]})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _one_clear_error(path, "cannot be read")
    torch.save({"weights": torch.zeros(2)}, path)
    _one_clear_error(path, "not a quietsync checkpoint")
    path.write_bytes(pickle.dumps([1, 2, 3]))  # a pickle, not a torch file
    _one_clear_error(path, "refusing to load checkpoint|cannot be read|not a quietsync checkpoint")


def test_plain_checkpoint_round_trips(tmp_path):
    payload = {"strategy": {"steps": 2, "w": torch.arange(4.0)}, "rng": torch.get_rng_state(),
               "config": {"link": ["inter=1mbit"], "lr": 1e-3, "resume": None}}
    path = save_checkpoint(tmp_path, 2, 0, payload)
    got = load_checkpoint(path.parent, 0)
    assert got["strategy"]["steps"] == 2 and torch.equal(got["strategy"]["w"], payload["strategy"]["w"])
    assert got["config"] == payload["config"]


def test_a_checkpoint_write_that_failed_on_a_full_disk_is_put_down_to_it(tmp_path, monkeypatch):
    """torch's own error for a write cut short ("unexpected pos") says nothing of the disk: a write that failed
    with ENOSPC in its chain, or with almost nothing free, is named as a full --out."""
    import errno
    import shutil
    from collections import namedtuple

    from quietsync.train import checkpoint

    cut = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert checkpoint.out_of_space(tmp_path, 4, cut) is None  # plenty free here: another failure
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("write failed") from inner
    except RuntimeError as chained:
        said = checkpoint.out_of_space(tmp_path, 4, chained)
    assert said.startswith(f"--out {tmp_path}: no space left on its file system for the checkpoint of step 4")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10 << 20, 10 << 20, 1 << 20))
    assert "(1 MB free): free some, or save less often (--save-every)" in checkpoint.out_of_space(tmp_path, 4, cut)
