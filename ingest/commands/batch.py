"""``uflash run [PATH...]``: take the named files now, decode their documents (and only theirs), report, exit.

With no PATH it takes every file in the inbox and every document already waiting in the ledger (queued earlier:
by a ``uflash watch`` that stopped, an interrupted ``uflash run``), and exits when all of them are done or failed.
With PATHs the worker claims only the chunks of those files' documents: a backlog of other documents stays queued
for ``uflash watch`` or a ``uflash run`` with no PATH. Either way the invocation is one run (ingest.worker.lifecycle
.RunHandle: opened by the first file it refuses or finds a duplicate, or by its first decode), closed when it
returns; it ends by saying what became of every file it touched, one line each (ingest.review.outcomes), as its report
does."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from db.documents import pending_pages, unfinished_documents, waiting_documents
from db.session import Database
from ingest.config import Settings
from ingest.errors import UsageError
from ingest.files import is_ignored_name, uflash_command
from ingest.intake.enqueue import Intake, intake_file
from ingest.ledger.owners import this_process
from ingest.logs import counted
from ingest.review.outcomes import DONE, FAILED, REFUSED, WAITING, outcome_line, run_outcomes
from ingest.worker.lifecycle import RunHandle, serve_run


@dataclass
class BatchResult:
    run_id: int | None = None  # the run that decoded this invocation's chunks; None when nothing was decoded
    done: int = 0
    failed: int = 0  # documents failed
    refused: int = 0  # files refused at intake
    pending: int = 0  # documents waiting: not finished (stopped before)
    interrupted: bool = False


def _expand(paths: list[Path], inbox: Path) -> list[Path]:
    if not paths:
        return sorted(p for p in inbox.iterdir() if p.is_file() and not is_ignored_name(p.name))
    out = []
    for p in paths:
        if p.is_dir():
            out += sorted(q for q in p.iterdir() if q.is_file() and not is_ignored_name(q.name))
        elif p.is_file():
            out.append(p)
        else:
            raise UsageError(f"no such file or folder: {p}")
    return out


def run_batch(settings: Settings, db: Database, paths: list[Path], make_worker: Callable,
              stop: threading.Event, report: Callable[[int], None]) -> BatchResult:
    """Take ``paths`` (or the inbox and the ledger's backlog) in, decode their documents in one run, say what became of
    each file, and report the run."""
    files = _expand(paths, settings.inbox)
    run = RunHandle(db, settings, this_process())
    doc_ids: list[int] = []
    for f in files:
        res = intake_file(db, settings, f, retry_failed=bool(paths), run=run)  # a failed file named again: retried
        if res.outcome in (Intake.DOCUMENT, Intake.KNOWN, Intake.MOVED, Intake.REQUEUED) \
                and res.document_id not in doc_ids:  # a duplicate or a refused file is its run's, decoding nothing
            doc_ids.append(res.document_id)
    backlog, backlog_chunks = waiting_documents(db, exclude=doc_ids)
    result = BatchResult()
    if not paths and backlog:  # no PATH: the whole inbox and everything already waiting in the ledger
        print(f"taking {counted(len(backlog), 'document')} ({counted(backlog_chunks, 'chunk')}) already queued in "
              "the ledger"
              + ("" if files else f" (the inbox {settings.inbox} is empty)"))
        doc_ids += backlog
    if not files and not doc_ids:
        print(f"nothing to do: no files given, the inbox {settings.inbox} is empty and no document is queued")
        return result

    def summary(run_id: int | None) -> None:
        result.run_id = run_id
        outcomes = run_outcomes(db, run_id, doc_ids)
        for o in outcomes:
            print(outcome_line(o))
        count = Counter(o["outcome"] for o in outcomes)
        result.done, result.failed, result.pending, result.refused = (count[DONE], count[FAILED], count[WAITING],
                                                                      count[REFUSED])
        if result.refused:
            print(f"retry   a refused file, once mended or replaced in {settings.failed}: "
                  f"{uflash_command(settings.config_file, 'retry', '--file', 'PATH')} (--all: every one)")
        others, other_chunks = waiting_documents(db, exclude=doc_ids)
        if others:
            print(f"queued  {counted(len(others), 'document')} ({counted(other_chunks, 'chunk')}) more wait in the "
                  "ledger, left alone by this run: `uflash run` with no files or `uflash watch` processes them")
        result.interrupted = stop.is_set()

    if doc_ids:
        with make_worker(settings, db, document_ids=frozenset(doc_ids), run=run) as worker:
            serve_run(worker, stop, lambda: not unfinished_documents(db, doc_ids), report,
                      progress=("uflash run", pending_pages(db, doc_ids)), summary=summary)
    else:  # only duplicates and refused files: a run that decoded nothing, reported all the same
        run_id, _ = run.close()
        summary(run_id)
        if run_id is not None:
            report(run_id)
    logger.debug("run finished (run {})", result.run_id)
    return result
