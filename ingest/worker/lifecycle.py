"""One run's life, the same for ``uflash watch`` (one run per batch: until the queue runs dry), ``uflash run`` and
``uflash rerun``: the run is opened when the worker decodes its first chunk (loading the model) or when a file taken in
becomes nothing to decode (a refused file, a duplicate: ``RunHandle.taking_in``), the worker serves, the run is closed
when its work or the command ends (Ctrl+C and SIGTERM included), and its HTML report is written.

Every page records the run that produced it. A process killed outright leaves its run open and its chunks leased:
the next uflash worker on the same host finds its process gone (ingest.ledger.owners), takes its chunks over at once and
closes its run as crashed (db.runs: chunks still reserved for it, a re-run's, are cancelled). Later workers never
reuse an open run.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loguru import logger

import engine
from db.queue import end_leases_of_gone_owners
from db.runs import close_run, close_runs_of_gone_owners, describe_run, open_run
from db.session import Database
from ingest.config import Settings
from ingest.errors import ExitCode, ModelUnavailable, infrastructure_problem
from ingest.ledger.owners import is_gone
from ingest.logs import progress_bar
from ingest.worker.finish import Finisher
from ingest.worker.finish_queue import FinishQueue


class RunHandle:
    """The run of one command or one batch of a watcher: opened when it first decodes a chunk (``open``: the model is
    loaded, and the run records it) or takes in a file that becomes nothing to decode (``taking_in``: a refused file,
    a duplicate; the run records the configured mode and model until it decodes), closed once (``close``); a later use
    opens a new one. A watcher's intake takes files in while its worker decodes and closes runs: a file is recorded
    with its run while that run is held open (a lock), so no run is closed and reported before a file it took."""

    def __init__(self, db: Database, settings: Settings, owner: str, rerun: dict[str, Any] | None = None):
        self.db, self.settings, self.owner, self.rerun = db, settings, owner, rerun
        self.id: int | None = None
        self._described = False  # the run records what decodes in it (not only what is configured)
        self._lock = threading.RLock()

    def open(self, decoder: Callable[[], Any]) -> int:
        """This run, opened now if none is open, recording ``decoder()`` (loaded first, if it is not yet)."""
        if self.id is not None and self._described:
            return self.id
        d = decoder()  # loading the model takes a while: files are taken in meanwhile
        with self._lock:
            described = {**d.describe(), **(self.rerun or {})}
            if self.id is None:
                self.id = open_run(self.db, d.mode, d.model_name, engine.__version__, socket.gethostname(),
                                   self.owner, described)
            elif not self._described:
                describe_run(self.db, self.id, d.mode, d.model_name, described)
            self._described = True
            return self.id

    @contextmanager
    def taking_in(self) -> Iterator[int]:
        """The run a file taken in now belongs to, opened now if none is open, and held open until the file is
        recorded."""
        with self._lock:
            if self.id is None:
                path = Path(self.settings.model_path)
                self.id = open_run(self.db, self.settings.engine.mode, path.name if path.exists() else str(path),
                                   engine.__version__, socket.gethostname(), self.owner, dict(self.rerun or {}))
            yield self.id

    def reserved(self) -> int | None:
        """The run that chunks split off by this worker are reserved for (a re-run's), else None."""
        return self.id if self.rerun is not None else None

    def close(self) -> tuple[int | None, list[int]]:
        """Close the run, if one is open: its id (None: none was open) and the documents whose chunks still reserved
        for it were cancelled (a re-run stopped before its end: db.runs)."""
        with self._lock:
            run_id = self.id
            if run_id is None:
                return None, []
            docs = close_run(self.db, run_id)
            self.id, self._described = None, False  # only once closed: a ledger that failed to close it is asked again
        if docs:
            logger.warning("run {} stopped before it finished: its chunks left in {} document(s) are cancelled; "
                           "`uflash rerun` again picks their pages", run_id, len(docs))
        return run_id, docs


def take_over_from_the_gone(settings: Settings, db: Database, finisher: Finisher | FinishQueue) -> None:
    """Leases and runs of uflash processes on this host that are gone (killed, crashed, the machine rebooted): their
    chunks are taken over now rather than when the lease runs out (by the next claim, under db.queue's crash rule: not
    charged when they died in company), and their runs are closed as crashed (a re-run's chunks still reserved for it
    are cancelled, and the documents it re-decoded pages of are rewritten). A re-run on another host is known gone
    once its own chunk has waited on an ended lease for longer than a lease (db.runs)."""
    stale_before = time.time() - settings.worker.lease_seconds
    for run_id, docs in close_runs_of_gone_owners(db, is_gone, stale_before).items():
        logger.warning("run {} was left open by a uflash process that is gone: closed as crashed{}", run_id,
                       f"; its chunks left in {len(docs)} document(s) are cancelled" if docs else "")
        finisher.rewrite_after_rerun(run_id, docs)
    if n := end_leases_of_gone_owners(db, is_gone):
        logger.warning("{} chunk(s) leased by uflash processes that are gone: taken over now", n)


def serve_run(worker, stop: threading.Event, until: Callable[[], bool], report: Callable[[int], None],  # noqa: ANN001
              progress: tuple[str, int] | None = None, summary: Callable[[int | None], None] | None = None
              ) -> int | None:
    """One run: ``worker`` serves until ``until()`` holds or ``stop`` is set; its run is closed, ``summary(run id)``
    says what became of the work, and the run is ``report``ed (when it decoded something). ``progress`` (what,
    pages): a progress bar of the pages stored. Returns the run's id (None: it decoded nothing)."""
    bar = progress_bar(progress[1], progress[0], unit="page") if progress else None
    worker.on_pages = bar.update if bar is not None else None
    try:
        worker.serve(stop, until=until)
    finally:
        try:
            run_id = worker.close_run()
        finally:
            if bar is not None:
                bar.close()
    if summary is not None:
        summary(run_id)
    if run_id is not None:
        report(run_id)
    return run_id


def serve_batches(worker, stop: threading.Event, report: Callable[[int], None]) -> int | None:  # noqa: ANN001
    """``uflash watch``'s worker: one run per batch, from the first chunk it decodes until the queue runs dry (then the
    run is closed and reported, so a watcher that runs for weeks leaves one report per batch dropped into the inbox),
    until ``stop``. A missing model is waited out (intake goes on). Returns the run closed on stopping, if any."""
    while not stop.is_set():
        try:
            run_id = serve_run(worker, stop, lambda: worker.idle, report)
        except ModelUnavailable as e:
            logger.error("worker cannot start: {}; intake goes on, retrying in 60s", e)
            stop.wait(60)
            continue
        except Exception as e:  # the ledger failed while closing the run: tried again (the run stays open till then)
            if (problem := infrastructure_problem(e)) is None:
                raise
            if stop.is_set():  # the next uflash on this machine closes it as crashed
                logger.error("could not close run {}: {}; the next uflash on this machine closes it", worker.run.id,
                             problem)
                return None
            stop.wait(worker.trouble.failed(problem))
            continue
        if run_id is not None and stop.is_set():
            return run_id
        if run_id is not None:
            logger.info("queue empty: run {} closed", run_id)
        worker.idle = False
    return None


def stop_event() -> threading.Event:
    """An event set by SIGTERM/SIGINT (and SIGBREAK on Windows), so loops finish their step and exit. A second signal
    exits at once (130): the chunk in progress is not stored, and its lease lets the next worker redo it (the crash
    path, tested with SIGKILL), so nothing is lost by not waiting for a long decode."""
    stop = threading.Event()

    def handler(signum, _frame):  # noqa: ANN001
        if stop.is_set():
            logger.warning("signal {} again: stopping now; the chunk in progress is redone by the next worker", signum)
            logger.remove()  # closes (flushes) the log file before the hard exit
            os._exit(ExitCode.INTERRUPTED)
        logger.info("signal {} received: finishing the current step, then stopping (again: stop now)", signum)
        stop.set()

    for name in ("SIGTERM", "SIGINT", "SIGBREAK"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), handler)
    return stop
