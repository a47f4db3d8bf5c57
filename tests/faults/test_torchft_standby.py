"""``--standby PATH``: a replica group's standby has imported, opened the data, built and warmed the model and the
strategy before its replica dies; activated (the file appears), it only joins the Lighthouse, heals and trains --
nothing of its start-up is left on the return's path. Its run is audited like any return."""

from __future__ import annotations

import pytest

import quietsync.faults  # noqa: F401  (before torchft: its Rust log level is read at import)
from tests.train._run import refused

from .torchft_replicas import KILLED, Replicas, audit, job_flags, records, wait_exit

torchft = pytest.importorskip("torchft")

FT = ["--fault-tolerance", "torchft"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--standby", "go", *FT], "--standby needs --replica-group K and one worker (--nproc 1): it stands by for one "
                               "replica group's single worker, got no --replica-group"),
    (["--standby", "go"], "--standby needs --fault-tolerance torchft"),
    (["--standby", "/no/such/folder/go", *FT, "--replica-group", "0", "--nodes", "2", "--nproc", "1",
      "--lighthouse", "127.0.0.1:1"], "its folder /no/such/folder does not exist, so the file could never be created"),
    (["--standby", ".", *FT, "--replica-group", "0", "--nodes", "2", "--nproc", "1", "--lighthouse", "127.0.0.1:1"],
     "--standby must name a file whose creation activates the standby, got '.'"),
])
def test_a_standby_without_one_replica_group_is_refused_in_one_line(flags, message, monkeypatch, capsys):
    assert message in refused(monkeypatch, capsys, "--strategy", "ddp", *flags)


@pytest.mark.timeout(240)
def test_a_standby_takes_over_a_dead_replica_with_its_start_up_already_done(tmp_path):
    out = tmp_path / "run"
    replicas = Replicas(tmp_path, 2, job_flags(tmp_path, out, "--strategy", "ddp", "--max-steps", "24"))
    activate = tmp_path / "activate"
    try:
        go = f"step:0:{tmp_path / 'go'}"
        back = tmp_path / "back"
        r0 = replicas.start(0, {"QUIETSYNC_FT_HOLD": f"{go},step:10:{back}"})
        r1 = replicas.start(1, {"QUIETSYNC_FT_KILL": "step:5", "QUIETSYNC_FT_HOLD": go})
        replicas.go(tmp_path / "go", [0, 1])
        # the standby is started beside the job; it never heartbeats while it waits
        replicas.flags = [*replicas.flags, "--standby", str(activate)]
        standby = replicas.start(1)
        assert wait_exit(replicas, r1) == KILLED
        replicas.wait_text("replica1.1.log", "standing by")
        activate.write_text("")  # replica 1 died: the standby takes over
        replicas.wait_restarted(1)
        back.write_text("")
        assert wait_exit(replicas, r0) == 0, replicas.logs()
        assert wait_exit(replicas, standby) == 0, replicas.logs()
    finally:
        replicas.close()
    assert replicas.alive() == []

    returned = [r for r in records(out, 1) if "start" in r]
    assert len(returned) == 2  # the first incarnation's first step, the standby's
    marks = returned[-1]["start"]
    # imports, data, model, warm-up and strategy were done before the activation; after it, only the join
    assert marks["model"] < marks["warm"] < marks["standby"] < marks["activated"] <= marks["manager"] < marks["joined"]
    assert records(out, 1)[-1]["healed"] == 1
    committed, summary = audit(out, 2)
    assert len(set(committed)) == len(committed), "a window trained twice"
    assert sorted(committed + summary["windows_held"]) == list(range(summary["windows_dealt"])), "a window skipped"
    assert summary["final_members"] == [0, 1]
