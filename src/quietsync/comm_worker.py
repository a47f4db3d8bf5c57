"""The communication worker: a background thread that runs communication + optimizer jobs while the
main thread computes.

Overlapping strategies (ACCO, DPU, WP) hand it a job — "reduce-scatter these gradients, step the sharded
optimizer, all-gather the parameters" — and keep computing micro-batches until :meth:`Job.done` says it
finished. Jobs run one at a time, in submission order.

* **Errors** raised in a job are kept and re-raised in the main thread at its next :meth:`CommWorker.submit`,
  :meth:`Job.wait` or :meth:`CommWorker.check`, with the worker's traceback chained.
* **CUDA**: the worker owns a side stream. At submit time an event is recorded on the caller's current
  stream and the job's stream waits on it (so the job sees the gradients the main stream produced), and a
  completion event is recorded after the job; :meth:`Job.wait` makes the caller's stream wait on that event
  — no host synchronisation per micro-batch. :meth:`Job.done` polls the event without blocking.
* **Shutdown** (:meth:`close`) drains nothing silently: it waits for the running job, then stops the thread.
* **Context**: a job runs in a copy of the submitter's :mod:`contextvars` context as it was at submit (as
  ``asyncio`` runs a callback), so what the main thread had set when it launched the work -- e.g. the data a
  commit holds (:mod:`quietsync.train.window_dealer`) -- is what the job sees, whenever it runs.
"""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch


class CommWorkerError(RuntimeError):
    """A job on the communication worker failed; ``__cause__`` is the original exception."""


class Job:
    """A submitted job: poll with :meth:`done`, collect the result with :meth:`wait`."""

    def __init__(self, worker: CommWorker, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self._worker = worker
        self._fn, self._args, self._kwargs = fn, args, kwargs
        self._context = contextvars.copy_context()
        """The submitter's context at submit; the job runs in it."""
        self._finished = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._ready_event: Any = None  # CUDA event recorded on the caller's stream at submit
        self._done_event: Any = None  # CUDA event recorded on the side stream after the job
        self.t_submit = time.perf_counter()
        self.t_start = 0.0
        self.t_end = 0.0

    def done(self) -> bool:
        """Whether the job finished (never blocks)."""
        if not self._finished.is_set():
            return False
        # on CUDA the thread returning is not enough: the side stream may still run the job's kernels
        return self._done_event is None or self._done_event.query()

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for the job; re-raise its error; on CUDA order the caller's stream after it."""
        limit = self._worker.timeout_s if timeout is None else timeout
        if not self._finished.wait(limit):
            raise TimeoutError(f"communication job {self._fn.__name__} did not finish within {limit:g}s")
        if self._error is not None:
            self._worker._error_seen = True  # collected here, so check() does not raise it a second time
            raise CommWorkerError(f"communication job {self._fn.__name__} failed: {self._error}") from self._error
        if self._done_event is not None:
            torch.cuda.current_stream(self._worker.device).wait_event(self._done_event)
        return self._result


class CommWorker:
    """One background thread (and, on CUDA, one side stream) that runs jobs in order.

    Args:
        device: where the jobs' tensors live; a CUDA device gives the worker its own stream.
        timeout_s: how long :meth:`Job.wait` waits before raising (collectives have their own timeout).
        name: thread name, for debuggers and profilers.
    """

    def __init__(self, device: torch.device | str = "cpu", timeout_s: float = 600.0, name: str = "quietsync-comm"
                 ) -> None:
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._failed: Job | None = None
        self._error_seen = False
        self._closed = False
        # daemon: a job stuck in a collective cannot keep the interpreter from exiting
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Job:
        """Queue ``fn(*args, **kwargs)`` behind the jobs already submitted."""
        self.check()
        if self._closed:
            raise RuntimeError("CommWorker is closed")
        job = Job(self, fn, args, kwargs)
        if self.stream is not None:
            job._ready_event = torch.cuda.Event()
            job._ready_event.record(torch.cuda.current_stream(self.device))
        self._queue.put(job)
        return job

    def check(self) -> None:
        """Re-raise, once, the error of a failed job the caller has not collected yet."""
        failed = self._failed
        if failed is not None and not self._error_seen:
            self._error_seen = True
            raise CommWorkerError(
                f"communication job {failed._fn.__name__} failed: {failed._error}"
            ) from failed._error

    @property
    def busy(self) -> bool:
        """Whether a job is queued or running."""
        return self._queue.unfinished_tasks > 0  # counts the running job too: _run calls task_done after it

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued jobs, then stop the thread. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(self.timeout_s if timeout is None else timeout)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if self._failed is not None:  # after a failure, later jobs are skipped, not run on bad state
                    job._error = RuntimeError("skipped: an earlier communication job failed")
                    job._finished.set()
                    continue
                job.t_start = time.perf_counter()
                try:
                    if self.stream is not None:
                        with torch.cuda.stream(self.stream):
                            self.stream.wait_event(job._ready_event)
                            job._result = job._context.run(job._fn, *job._args, **job._kwargs)
                            job._done_event = torch.cuda.Event()
                            job._done_event.record(self.stream)
                    else:
                        job._result = job._context.run(job._fn, *job._args, **job._kwargs)
                except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                    job._error = exc
                    self._failed = job
                job.t_end = time.perf_counter()
                job._finished.set()
            finally:
                self._queue.task_done()
