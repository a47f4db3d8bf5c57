"""``--fault-tolerance torchft`` refuses what it cannot do in one line, before anything starts (exit 2): strategies
whose replicas do not meet only at commits, flags that need agreement outside the quorum, replica groups of several
workers for strategies whose state is per worker, a Lighthouse nobody answers at."""

from __future__ import annotations

import re

import pytest

from quietsync.commands.main import main
from quietsync.faults.support import policies, refusals
from tests.distributed import free_port
from tests.train._run import refused

FT = ["--fault-tolerance", "torchft"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--strategy", "cdp", *FT], "--fault-tolerance torchft does not support --strategy cdp: its workers pass every "
                                 "micro-batch's activations and gradients around a ring"),
    (["--strategy", "acco", *FT], "--fault-tolerance torchft does not support --strategy acco: its update of one "
                                  "step is computed while the next step's gradients accumulate"),
    (["--strategy", "diloco", "--elastic", *FT], "--elastic and --fault-tolerance torchft are two ways to survive "
                                                 "lost nodes: choose one"),
    (["--strategy", "localsgd", "--nproc", "4", "--nodes", "2", *FT],
     "--strategy localsgd keeps its state per worker, so under --fault-tolerance torchft it runs with one worker per "
     "replica group; got 2"),
    (["--strategy", "diloco", "--nproc", "4", "--nodes", "2", *FT], "diloco --inner ddp or zero1 runs several"),
    (["--strategy", "ddp", "--nproc", "1", *FT], "needs at least 2 replica groups (--nodes, default one per "
                                                 "worker), got 1"),
    (["--strategy", "ddp", "--replica-group", "0", "--nodes", "2", *FT], "--replica-group needs --lighthouse"),
    (["--strategy", "ddp", "--lighthouse", "h:1"], "--lighthouse needs --fault-tolerance torchft"),
    (["--strategy", "ddp", "--no-async-join"], "--no-async-join needs --fault-tolerance torchft"),
    (["--strategy", "ddp", "--replica-restarts", "2"], "--replica-restarts needs --fault-tolerance torchft"),
    (["--strategy", "ddp", "--precision", "fp16", *FT], "--precision fp16 is not supported with --fault-tolerance"),
    (["--strategy", "ddp", "--save-every", "5", *FT], "--save-every is not supported with --fault-tolerance torchft"),
    (["--strategy", "ddp", "--on-replicas-differ", "heal"], "--on-replicas-differ heal needs --fault-tolerance "
     "torchft"),
    (["--strategy", "ddp", "--on-replicas-differ", "heal", *FT], "--on-replicas-differ heal needs "
     "--check-replicas-every N"),
    (["--strategy", "ddp", "--on-replicas-differ", "stop", *FT], "--on-replicas-differ stop is not supported with "
     "--fault-tolerance torchft"),
    (["--strategy", "ddp", "--check-replicas-every", "-1"], "--check-replicas-every must be an integer >= 0, got -1"),
    (["--strategy", "ddp", "--batch-policy", "global", *FT], "--batch-policy global is not supported with"),
    (["--strategy", "ddp", "--comm-hook", "powersgd", *FT], "--comm-hook powersgd is not supported with"),
    (["--strategy", "ddp", "--lighthouse", "nowhere", *FT], "--lighthouse must be HOST:PORT"),
    (["--strategy", "ddp", "--lighthouse", "127.0.0.1:99999", *FT], "with a port in [1, 65535], got '127.0.0.1:99999'"),
    (["--strategy", "diloco", "--on-nonfinite", "skip", *FT], "--on-nonfinite skip is not supported by --strategy "
     "diloco with --fault-tolerance torchft (localsgd and diloco take their inner steps alone between commits"),
    (["--strategy", "demo", "--on-nonfinite", "skip", *FT], "--on-nonfinite skip is not supported by --strategy demo "
     "with --fault-tolerance torchft (demo folds a round's gradient into its decoupled momentum"),
])
def test_bad_combinations_are_one_line_and_start_nothing(flags, message, monkeypatch, capsys):
    assert message in refused(monkeypatch, capsys, *flags)


def test_an_unreachable_lighthouse_is_one_line_before_any_worker_starts(monkeypatch, capsys, tmp_path):
    port = free_port()
    line = refused(monkeypatch, capsys, "--strategy", "ddp", *FT, "--replica-group", "0", "--nodes", "2", "--nproc",
                   "1", "--lighthouse", f"127.0.0.1:{port}", "--out", str(tmp_path / "run"))
    assert line.startswith(f"quietsync train: error: --lighthouse 127.0.0.1:{port}: no Lighthouse answered "), line
    assert "quietsync lighthouse" in line
    # the time it took beside the limit (a closed port refuses at once: not "within 10s")
    took = re.search(r", after (\d+\.\d) s; the check waits up to 10 s\)", line)
    assert took and float(took.group(1)) < 10, line


def test_every_strategy_is_supported_or_refused_once():
    from quietsync.strategies import available

    # signsgd: the example's, where it is imported (it declares its own policy)
    assert (set(policies()) | set(refusals())) - {"signsgd"} == set(available()) - {"signsgd"}
    assert not set(policies()) & set(refusals())


def test_the_lighthouse_command_refuses_a_bad_value_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["lighthouse", "--heartbeat-timeout-ms", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "quietsync lighthouse: error: --heartbeat-timeout-ms must be an integer >= 1, got 0" in err
