"""``uflash run [PATH...]``: take the named files now, decode their documents (and only theirs), report, exit.

With no PATH it takes every file in the inbox and every document already waiting in the ledger (queued earlier:
by a ``uflash watch`` that stopped, an interrupted ``uflash run``), and exits when all of them are done or failed.
With PATHs the worker claims only the chunks of those files' documents: a backlog of other documents stays queued
for ``uflash watch`` or a ``uflash run`` with no PATH. Either way the invocation is one run (``Worker.run_id``),
closed when it returns."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from loguru import logger
from sqlalchemy import func, select
from tqdm import tqdm

from db.models import Chunk, ChunkStatus, DocStatus, Document
from db.queue import among
from db.session import Database
from ingest.config import Settings
from ingest.errors import UsageError
from ingest.files import is_ignored_name
from ingest.intake import intake_file

WAITING = (DocStatus.QUEUED, DocStatus.RUNNING)
PENDING = (ChunkStatus.QUEUED, ChunkStatus.RUNNING)


@dataclass(frozen=True)
class BatchResult:
    code: int  # the exit code
    run_id: int | None  # the run that decoded this invocation's chunks; None when nothing was decoded


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


def waiting_documents(db: Database, exclude: Collection[int] = ()) -> tuple[list[int], int]:
    """Documents waiting in the ledger (queued or running), apart from ``exclude``, and how many chunks they
    still have to decode (not counting chunks reserved for a re-run)."""
    skip = set(exclude)
    with db.session() as s:
        ids = [i for i in s.scalars(select(Document.id).where(Document.status.in_(WAITING)).order_by(Document.id))
               if i not in skip]
        chunks = s.scalar(select(func.count()).select_from(Chunk).where(
            among(Chunk.document_id, ids), Chunk.status.in_(PENDING), Chunk.run_id.is_(None))) if ids else 0
    return ids, chunks


def _pending_pages(db: Database, doc_ids: Collection[int]) -> int:
    """Pages still to decode in these documents (their queued and running chunks): the progress bar's total."""
    with db.session() as s:
        return int(s.scalar(select(func.coalesce(func.sum(Chunk.last_page - Chunk.first_page + 1), 0)).where(
            among(Chunk.document_id, doc_ids), Chunk.status.in_(PENDING), Chunk.run_id.is_(None))) or 0)


def _docs(n: int) -> str:
    return f"{n} document{'s' if n != 1 else ''}"


def run_batch(settings: Settings, db: Database, paths: list[Path], make_worker: Callable,
              stop: threading.Event) -> BatchResult:
    files = _expand(paths, settings.inbox)
    doc_ids: list[int] = []
    rejected: list[tuple[Path, str]] = []
    for f in files:
        res = intake_file(db, settings, f, retry_failed=bool(paths))  # a failed file named again: try it again
        if res.outcome == "rejected":
            rejected.append((f, res.reason or ""))
        elif res.document_id is not None and res.document_id not in doc_ids:
            doc_ids.append(res.document_id)
    backlog, backlog_chunks = waiting_documents(db, exclude=doc_ids)
    if not paths and backlog:  # no PATH: the whole inbox and everything already waiting in the ledger
        print(f"taking {_docs(len(backlog))} ({backlog_chunks} chunks) already queued in the ledger"
              + ("" if files else f" (the inbox {settings.inbox} is empty)"))
        doc_ids += backlog
    if not files and not doc_ids:
        print(f"nothing to do: no files given, the inbox {settings.inbox} is empty and no document is queued")
        return BatchResult(0, None)

    def docs() -> list[Document]:
        with db.session() as s:
            return list(s.scalars(select(Document).where(among(Document.id, doc_ids)).order_by(Document.id)))

    def finished() -> bool:
        with db.session() as s:
            return s.scalar(select(func.count()).select_from(Document).where(
                among(Document.id, doc_ids), Document.status.in_(WAITING))) == 0

    run_id = None
    if doc_ids:
        with tqdm(total=_pending_pages(db, doc_ids), unit="page", desc="uflash run", dynamic_ncols=True) as bar:
            worker = make_worker(settings, db, on_pages=bar.update, document_ids=frozenset(doc_ids))
            try:
                worker.serve(stop, until=finished)
            finally:
                run_id = worker.close_run()
    code = 0
    for d in docs():
        if d.status == DocStatus.DONE:
            print(f"done    {d.original_name}: {d.page_count} pages -> {d.output_dir}")
        elif d.status == DocStatus.FAILED:
            print(f"failed  {d.original_name}: {d.error}")
            code = 4
        else:
            print(f"pending {d.original_name}: {d.status} (stopped before it finished)")
            code = code or 130
    for f, why in rejected:
        print(f"refused {f.name}: {why} (see {settings.failed})")
        code = 4
    others, other_chunks = waiting_documents(db, exclude=doc_ids)
    if others:
        print(f"queued  {_docs(len(others))} ({other_chunks} chunks) more wait in the ledger, left alone by this run: "
              f"`uflash run` with no files or `uflash watch` processes them")
    if stop.is_set() and code == 0:
        code = 130
    logger.debug("run finished with exit code {} (run {})", code, run_id)
    return BatchResult(code, run_id)
