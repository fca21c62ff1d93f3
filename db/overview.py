"""Read-only views of the whole ledger: what ``uflash status`` shows and what ``uflash check`` looks at."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select

from db.documents import PENDING, WAITING
from db.models import Chunk, ChunkStatus, DocStatus, Document, Duplicate, Page, Rejected, Run
from db.session import Database, open_engine, schema_version


def ledger_counts(db: Database, limit: int = 20) -> dict[str, Any]:
    """Counts by status, the waiting documents with their pages decoded so far and their originals, the latest done
    documents, the leases of running chunks, the open runs with their pages, the failures, the refused files not
    retried, the latest duplicates (each with its document) and the chunks waiting after an error (``limit`` of each
    list)."""
    with db.session() as s:
        docs = dict(s.execute(select(Document.status, func.count()).group_by(Document.status)).all())
        chunks = dict(s.execute(select(Chunk.status, func.count()).group_by(Chunk.status)).all())
        pages = s.scalar(select(func.coalesce(func.sum(Document.page_count), 0)))
        failed = s.execute(select(Document.id, Document.original_name, Document.error, Document.failed_path)
                           .where(Document.status == DocStatus.FAILED).order_by(Document.id.desc()).limit(limit)).all()
        rejected = s.scalars(select(Rejected).where(Rejected.retried_at.is_(None))
                             .order_by(Rejected.id.desc()).limit(limit)).all()
        duplicates = s.execute(select(Duplicate, Document).join(Document, Document.id == Duplicate.document_id)
                               .order_by(Duplicate.id.desc()).limit(limit)).all()
        done = s.scalars(select(Document).where(Document.status == DocStatus.DONE)
                         .order_by(Document.completed_at.desc(), Document.id.desc()).limit(limit)).all()
        leases = s.execute(select(Chunk.lease_owner, func.count(), func.max(Chunk.lease_expires_at))
                           .where(Chunk.status == ChunkStatus.RUNNING).group_by(Chunk.lease_owner)
                           .order_by(Chunk.lease_owner)).all()
        open_runs = s.execute(select(Run.id, Run.mode, Run.owner, Run.started_at, Run.settings,
                                     select(func.count(Page.id)).where(Page.run_id == Run.id).scalar_subquery())
                              .where(Run.finished_at.is_(None)).order_by(Run.id)).all()
        pages_left = s.scalar(select(func.coalesce(func.sum(Chunk.last_page - Chunk.first_page + 1), 0))
                              .where(Chunk.status.in_(PENDING)))
        waiting = s.execute(select(Document.id, Document.original_name, Document.status, Document.page_count,
                                   select(func.count(func.distinct(Page.page_index)))
                                   .where(Page.document_id == Document.id).scalar_subquery(),
                                   func.coalesce(Document.archived_path, Document.original_path))
                            .where(Document.status.in_(WAITING)).order_by(Document.id).limit(limit)).all()
        retrying = s.execute(select(Chunk.id, Chunk.document_id, Chunk.first_page, Chunk.last_page, Chunk.attempts,
                                    Chunk.last_error)
                             .where(Chunk.status == ChunkStatus.QUEUED, Chunk.last_error.is_not(None))
                             .order_by(Chunk.id).limit(limit)).all()
        return {
            "documents": docs, "chunks": chunks, "pages": int(pages or 0),
            "duplicates": s.scalar(select(func.count()).select_from(Duplicate)),
            "rejected": s.scalar(select(func.count()).select_from(Rejected)),
            "rejected_waiting": s.scalar(select(func.count()).select_from(Rejected)
                                         .where(Rejected.retried_at.is_(None))),
            "failed_documents": [tuple(r) for r in failed], "rejected_files": list(rejected),
            "duplicate_files": [tuple(r) for r in duplicates], "done_documents": list(done),
            "leases": [tuple(r) for r in leases], "open_runs": [tuple(r) for r in open_runs],
            "pages_left": int(pages_left or 0), "waiting_documents": [tuple(r) for r in waiting],
            "retrying_chunks": [tuple(r) for r in retrying],
        }


@dataclass
class LedgerFacts:
    """What ``uflash check`` reads from a ledger, changing nothing."""

    server: str
    version: int | None  # None: no uflash tables yet
    open_run_owners: list[str] = field(default_factory=list)
    waiting_originals: list[str] = field(default_factory=list)  # paths of the originals of waiting documents


def ledger_facts(url: str, busy_timeout_ms: int) -> LedgerFacts:
    """Reach the ledger at ``url`` (read only) and say what it holds. Raises ``LedgerUrlError`` for a URL that cannot
    work, and what the database layer raised when it cannot be reached."""
    engine = open_engine(url, busy_timeout_ms)
    try:
        with engine.connect() as conn:
            facts = LedgerFacts(_server(conn), schema_version(conn))
            if facts.version is not None:
                facts.open_run_owners = sorted(o for o in conn.execute(
                    select(Run.owner).where(Run.finished_at.is_(None)).distinct()).scalars() if o)
                facts.waiting_originals = list(conn.execute(select(Document.original_path).where(
                    Document.status.in_(WAITING), Document.archived_path.is_(None)).limit(10_000)).scalars())
            return facts
    finally:
        engine.dispose()


def _server(conn: Any) -> str:
    info = ".".join(map(str, conn.dialect.server_version_info or ()))
    if conn.dialect.name == "sqlite":
        return f"SQLite {sqlite3.sqlite_version}"
    return f"{'PostgreSQL' if conn.dialect.name == 'postgresql' else conn.dialect.name} {info}".strip()
