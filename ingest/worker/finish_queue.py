"""Finishing documents beside the decode loop: a thread of the worker finishes each document whose chunks are all
done (ingest.worker.finish: grades, outputs, PDF/A, the move to the archive), one at a time, while the loop keeps the
engine stepping.

Nothing is lost when the process is killed half-way: a document is marked done only by ``Finisher.finish``, the one
place that writes its end to the ledger, after its outputs are written; until then its chunks are all done and it
is not, which is exactly what ``finish_ready`` looks for (at the worker's start and whenever it is idle) and finishes
again. The error a finish meets (a full disk: the machine's trouble; a bug) is raised on the worker's thread by its
next ``check()``, where the worker handles it as it always did. Leaving ``with`` finishes what is queued first (the
loop stopped normally) or only what is in hand (it stopped on an error).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from loguru import logger

from ingest.worker.finish import Finisher


class FinishQueue:
    def __init__(self, finisher: Finisher):
        self.finisher = finisher
        self._jobs: deque[tuple] = deque()
        self._running: tuple | None = None
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closing = False
        self._thread: threading.Thread | None = None

    # -- what the worker asks for ------------------------------------------------------------------
    def finish(self, doc_id: int) -> None:
        """Finish this document (its chunks are all done)."""
        self._put(("finish", doc_id))

    def finish_ready(self) -> None:
        """Finish the documents whose chunks are all done but that are not finished (a crash in between)."""
        self._put(("ready",))

    def rewrite_after_rerun(self, run_id: int, doc_ids: list[int]) -> None:
        """``Finisher.rewrite_after_rerun``, here."""
        self._put(("rerun", run_id, tuple(doc_ids)))

    def check(self) -> None:
        """Raise the error the last finishes met, if any (the first of them; the others are in the log)."""
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    @property
    def busy(self) -> bool:
        with self._cond:
            return bool(self._jobs) or self._running is not None

    def wait(self, timeout: float) -> None:
        """Until nothing is queued or being finished, or ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: not self._jobs and self._running is None, timeout)

    def _queued(self, doc_id: int) -> bool:
        with self._cond:
            return ("finish", doc_id) in self._jobs

    def _put(self, job: tuple) -> None:
        with self._cond:
            if job not in self._jobs:  # asked twice before it started: once is enough
                self._jobs.append(job)
                self._cond.notify_all()

    # -- the thread ----------------------------------------------------------------------------------
    def _work(self, job: tuple) -> Callable[[], object]:
        kind, *args = job
        if kind == "finish":
            return lambda: self.finisher.finish(*args)
        if kind == "ready":  # those queued to be finished are left to their own turn (else: finished twice)
            return lambda: self.finisher.finish_ready(skip=self._queued)
        return lambda: self.finisher.rewrite_after_rerun(args[0], list(args[1]))

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closing)
                if not self._jobs:
                    return
                job = self._running = self._jobs.popleft()
            try:
                self._work(job)()
            except Exception as e:  # noqa: BLE001 - raised on the worker's thread (``check``)
                logger.opt(exception=e).debug("finishing {}: {}: {}", job, type(e).__name__, e)
                with self._cond:
                    self._error = self._error or e
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def __enter__(self) -> FinishQueue:
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="finish", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        with self._cond:
            if exc_type is not None:  # a failing worker: what is queued waits for the next start (finish_ready)
                self._jobs.clear()
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
