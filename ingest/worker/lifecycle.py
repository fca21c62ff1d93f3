"""One run's life, the same for ``uflash watch`` (one run per batch: until the queue runs dry), ``uflash run`` and
``uflash rerun``: the run is opened when the worker decodes its first chunk (loading the model), the worker serves,
the run is closed when its work or the command ends (Ctrl+C and SIGTERM included), and its HTML report is written.

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
from collections.abc import Callable
from typing import Any

from loguru import logger

import engine
from db.queue import end_leases_of_gone_owners
from db.runs import close_run, close_runs_of_gone_owners, open_run
from db.session import Database
from ingest.config import Settings
from ingest.errors import ExitCode, ModelUnavailable, infrastructure_problem
from ingest.ledger.owners import is_gone
from ingest.logs import progress_bar
from ingest.worker.finish import Finisher
from ingest.worker.finish_queue import FinishQueue


class RunHandle:
    """A worker's run: opened on first use, closed once; a later use opens a new one."""

    def __init__(self, db: Database, owner: str, decoder: Callable[[], Any], finisher: Finisher,
                 rerun: dict[str, Any] | None = None):
        self.db, self.owner, self.decoder, self.finisher, self.rerun = db, owner, decoder, finisher, rerun
        self.id: int | None = None

    def open(self) -> int:
        """This worker's run, opened now if it has none (loading the model: the run records what decodes)."""
        if self.id is None:
            d = self.decoder()
            self.id = open_run(self.db, d.mode, d.model_name, engine.__version__, socket.gethostname(), self.owner,
                               {**d.describe(), **(self.rerun or {})})
        return self.id

    def reserved(self) -> int | None:
        """The run that chunks split off by this worker are reserved for (a re-run's), else None."""
        return self.id if self.rerun is not None else None

    def close(self) -> int | None:
        """Close the run, if one is open, and return its id. A re-run stopped before its end cancels the chunks still
        reserved for it (db.runs) and rewrites the outputs of the documents it re-decoded pages of."""
        run_id = self.id
        if run_id is not None:
            docs = close_run(self.db, run_id)
            self.id = None  # only once closed: a ledger that failed to close it is asked again
            if docs:
                logger.warning("run {} stopped before it finished: its chunks left in {} document(s) are cancelled; "
                               "`uflash rerun` again picks their pages", run_id, len(docs))
            self.finisher.rewrite_after_rerun(run_id, docs)
        return run_id


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
