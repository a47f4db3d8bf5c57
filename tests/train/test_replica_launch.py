"""The replica group launcher's one-line report of the protocol's own stops (train/replica_launch.py): the line
names the replica group once, with no traceback."""

from __future__ import annotations

import types

import pytest


@pytest.mark.parametrize("where", ["in-process", "under-torchrun"])
@pytest.mark.parametrize("stop", ["NoQuorum", "FellBehind", "HealFailed"])
def test_a_protocol_stop_is_said_in_one_line_naming_the_replica_group_once(monkeypatch, capsys, stop, where):
    """A worker run in this process reaches the launcher as the launch's WorkerFailed (its cause the stop); under
    torchrun, the launch runs the worker as it is, and the stop comes as raised."""
    from quietsync.cli import launch as launch_module
    from quietsync.cli.launch import WorkerFailed
    from quietsync.faults import quorum
    from quietsync.train import replica_launch

    error = getattr(quorum, stop)("quietsync: replica group 1: the Lighthouse at h:1 formed no quorum; it stops")

    def fails(*args, **kwargs):
        if where == "under-torchrun":
            raise error
        raise WorkerFailed(0, "Traceback (most recent call last): ...") from error

    monkeypatch.setattr(launch_module, "launch", fails)
    cfg = types.SimpleNamespace(model="tiny")
    assert replica_launch.run_one_replica_group(cfg, None, 1, 2, "127.0.0.1:1", 1) == 1
    err = capsys.readouterr().err
    assert err == ("quietsync train: error: replica group 1: the Lighthouse at h:1 formed no quorum; it stops\n"), err
