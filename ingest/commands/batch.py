"""``uflash run [PATH...]``: take the named files now, decode their documents (and only theirs), report, exit.

With no PATH it takes every file in the inbox and every document already waiting in the ledger (queued earlier:
by a ``uflash watch`` that stopped, an interrupted ``uflash run``), and exits when all of them are done or failed.
With PATHs the worker claims only the chunks of those files' documents: a backlog of other documents stays queued
for ``uflash watch`` or a ``uflash run`` with no PATH. Either way the invocation is one run (``Worker.run_id``),
closed when it returns."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from db.documents import documents, pending_pages, unfinished_documents, waiting_documents
from db.models import DocStatus
from db.session import Database
from ingest.config import Settings
from ingest.errors import UsageError
from ingest.files import is_ignored_name
from ingest.intake.enqueue import Intake, intake_file
from ingest.logs import counted
from ingest.worker.lifecycle import serve_run


@dataclass
class BatchResult:
    run_id: int | None = None  # the run that decoded this invocation's chunks; None when nothing was decoded
    done: int = 0
    failed: int = 0  # documents failed
    refused: int = 0  # files refused at intake
    pending: int = 0  # documents not finished (stopped before)
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
    each document and file, and report the run."""
    files = _expand(paths, settings.inbox)
    doc_ids: list[int] = []
    rejected: list[tuple[Path, str]] = []
    for f in files:
        res = intake_file(db, settings, f, retry_failed=bool(paths))  # a failed file named again: try it again
        if res.outcome == Intake.REJECTED:
            rejected.append((f, res.reason or ""))
        elif res.document_id is not None and res.document_id not in doc_ids:
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
        for d in documents(db, doc_ids):
            if d.status == DocStatus.DONE:
                result.done += 1
                print(f"done    {d.original_name}: {counted(d.page_count, 'page')} -> {d.output_dir}")
            elif d.status == DocStatus.FAILED:
                result.failed += 1
                print(f"failed  {d.original_name}: {d.error}")
            else:
                result.pending += 1
                print(f"pending {d.original_name}: {d.status} (stopped before it finished)")
        for f, why in rejected:
            result.refused += 1
            print(f"refused {f.name}: {why} (see {settings.failed})")
        others, other_chunks = waiting_documents(db, exclude=doc_ids)
        if others:
            print(f"queued  {counted(len(others), 'document')} ({counted(other_chunks, 'chunk')}) more wait in the "
                  "ledger, left alone by this run: `uflash run` with no files or `uflash watch` processes them")
        result.interrupted = stop.is_set()

    if doc_ids:
        with make_worker(settings, db, document_ids=frozenset(doc_ids)) as worker:
            serve_run(worker, stop, lambda: not unfinished_documents(db, doc_ids), report,
                      progress=("uflash run", pending_pages(db, doc_ids)), summary=summary)
    else:
        summary(None)
    logger.debug("run finished (run {})", result.run_id)
    return result
