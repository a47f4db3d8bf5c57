"""Local worker spawning: torchrun-like environment, and one failing worker ends the job with its error."""

from __future__ import annotations

import time

import pytest

from quietsync.cli.launch import WorkerFailed, launch
from tests.distributed import interruptible
from tests.train import _workers

pytestmark = pytest.mark.timeout(90)


def test_spawned_workers_get_a_torchrun_environment(tmp_path, monkeypatch):
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert launch(_workers.record_env, (str(tmp_path),), nproc=2) is None
    envs = sorted((tmp_path / f"env-{r}").read_text().split() for r in range(2))
    assert envs[0][:5] == ["0", "2", "0", "2", "127.0.0.1"] and envs[1][:5] == ["1", "2", "1", "2", "127.0.0.1"]
    assert envs[0][5] == envs[1][5] and int(envs[0][5]) > 0


def test_one_failing_worker_terminates_the_others(tmp_path, monkeypatch):
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as e:
        launch(_workers.fail_on_rank_one, (str(tmp_path),), nproc=2)
    assert time.monotonic() - t0 < 60  # rank 0 (sleeping 120 s) was terminated
    assert e.value.rank == 1
    assert "rank one broke on purpose" in str(e.value) and "Traceback" in e.value.details


def test_in_process_when_single_or_under_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert launch(lambda x: x + 1, (1,), nproc=1) == 2
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert launch(lambda x: x * 3, (2,), nproc=4) == 6  # under torchrun: run unchanged, --nproc ignored


def test_a_single_worker_in_process_fails_as_a_worker_process_does(monkeypatch):
    """One worker runs in the launcher's process, but its error reaches the caller as a worker process's would:
    WorkerFailed for worker 0, its traceback in the details, the error in the one line; Ctrl-C stays Ctrl-C and
    under torchrun the error is the worker's own."""
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)

    def broken():
        raise ValueError("broke on purpose")

    with pytest.raises(WorkerFailed) as e:
        launch(broken, (), nproc=1)
    assert e.value.rank == 0 and str(e.value) == "worker 0 failed: ValueError: broke on purpose"
    assert "Traceback" in e.value.details

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        launch(interrupted, (), nproc=1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="broke on purpose"):
        launch(broken, (), nproc=1)


def test_the_worker_that_failed_first_is_blamed(monkeypatch, tmp_path):
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(WorkerFailed) as e:
        launch(_workers.root_cause_on_rank_one_then_slow_cleanup, (str(tmp_path),), nproc=2)
    assert e.value.rank == 1 and "the real cause on rank one" in str(e.value)


def test_sigint_to_the_launcher_stops_every_worker(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    code = ("import sys; from quietsync.cli.launch import launch; from tests.train import _workers\n"
            "try:\n    launch(_workers.sleep_forever, (sys.argv[1],), nproc=2)\n"
            "except KeyboardInterrupt:\n    sys.exit(130)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env, preexec_fn=interruptible)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int(p.read_text()) for p in tmp_path.glob("pid-*")]
    assert len(pids) == 2
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    assert time.monotonic() - t0 < 15

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    while any(alive(p) for p in pids) and time.monotonic() - t0 < 15:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


@pytest.mark.skipif(__import__("shutil").which("ss") is None, reason="needs ss (iproute2)")
def test_local_workers_listen_on_loopback_only(tmp_path, monkeypatch):
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("QUIETSYNC_TEST_OUT", str(tmp_path))
    launch(_workers.listening_addresses, (), nproc=2)
    for r in range(2):
        addresses = (tmp_path / f"listen-{r}").read_text().split()
        assert addresses, "expected gloo's own sockets"
        assert all(a.startswith(("127.0.0.1:", "[::1]:")) for a in addresses), addresses


def test_stopping_a_worker_that_ends_between_the_check_and_the_signal_is_no_error():
    """``stop_workers`` sees a worker alive, and it exits before the signal is sent (a worker ending on its own error
    while the launcher stops the others): the stop goes on instead of raising ProcessLookupError."""
    import subprocess
    import sys

    from quietsync.cli.launch import stop_workers

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()

    class JustEnded:  # alive when asked first, gone by the time it is signalled
        pid = gone.pid

        def __init__(self) -> None:
            self.asked = 0

        def is_alive(self) -> bool:
            self.asked += 1
            return self.asked == 1

        def join(self, timeout: float | None = None) -> None:
            pass

        def kill(self) -> None:
            raise AssertionError("killed a worker that was no longer alive")

    stop_workers([JustEnded()], grace_s=0.1)
