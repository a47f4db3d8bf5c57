"""The communication worker: jobs run in order off the main thread; errors surface in the main thread."""

import threading
import time

import pytest

from quietsync import CommWorker, CommWorkerError


def test_jobs_run_in_order_on_another_thread():
    worker = CommWorker()
    seen = []
    jobs = [worker.submit(lambda i=i: (seen.append(i), threading.current_thread().name)[1]) for i in range(5)]
    assert [j.wait() for j in jobs] == ["quietsync-comm"] * 5
    assert seen == list(range(5))
    worker.close()


def test_main_thread_keeps_running_while_a_job_runs():
    worker = CommWorker()
    gate = threading.Event()
    job = worker.submit(gate.wait, 5)
    assert not job.done()
    gate.set()
    assert job.wait() is True
    assert job.done()
    worker.close()


def test_an_exception_in_a_job_is_raised_in_the_main_thread():
    worker = CommWorker()

    def broken():
        raise ValueError("reduce-scatter exploded")

    job = worker.submit(broken)
    with pytest.raises(CommWorkerError, match="reduce-scatter exploded"):
        job.wait()
    worker.close()


def test_an_uncollected_failure_surfaces_at_the_next_call():
    worker = CommWorker()
    worker.submit(lambda: 1 / 0)
    time.sleep(0.2)
    with pytest.raises(CommWorkerError, match="division by zero"):
        worker.submit(lambda: None)
    worker.close()


def test_close_is_clean_and_idempotent():
    worker = CommWorker()
    job = worker.submit(time.sleep, 0.05)
    worker.close()
    assert job.done()
    worker.close()
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(lambda: None)
