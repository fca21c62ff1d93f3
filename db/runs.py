"""Closing runs, and what a run leaves behind when it ends early.

Contract:
- A run is open while ``finished_at`` is None. Its own process closes it (``end_reason`` closed) when its command
  ends, Ctrl+C and SIGTERM included. A run whose owner process is gone (killed, crashed, the machine rebooted)
  is closed by the next uflash process that finds it (``end_reason`` crashed, ``finished_at`` = the time of its
  last stored page, or its start when it stored none). Gone means: known gone on this host (ingest.ledger.owners), or,
  for a re-run on any host, one of its reserved chunks has been running on an ended lease for longer than a
  lease (a live re-run takes its own chunk back within a poll).
- Chunks reserved for a run (a re-run's: ``run_id`` set while queued) are taken by that run only. When the run
  ends with some of them still queued or running, they are **cancelled** (kept, with a note; never deleted):
  nothing else would ever take them, and while pending they would keep their document from being finished by
  any later run. Running ``uflash rerun`` again re-picks those pages.
- Chunks of ordinary runs are not reserved (they get their run_id when they complete), so closing a run never
  touches them: a dead worker's chunk is retaken through its lease (db.queue).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Connection, func, literal, select, update

from db.models import Chunk, ChunkStatus, Document, Duplicate, Page, Rejected, Run, RunEnd
from db.session import Database, among

C = Chunk.__table__
R = Run.__table__


def open_run(db: Database, mode: str, model: str, engine_version: str, host: str, owner: str,
             settings: dict[str, Any]) -> int:
    """A new open run; its id."""
    with db.engine.begin() as conn:
        return conn.execute(R.insert().values(mode=mode, model=model, engine_version=engine_version, host=host,
                                              owner=owner, settings=settings).returning(R.c.id)).scalar_one()


def describe_run(db: Database, run_id: int, mode: str, model: str, settings: dict[str, Any]) -> None:
    """What decodes in run ``run_id``, once it loaded (a run opened by taking files in records the configured mode and
    model until then)."""
    with db.engine.begin() as conn:
        conn.execute(update(R).where(R.c.id == run_id).values(mode=mode, model=model, settings=settings))


def get_run(db: Database, run_id: int) -> Run | None:
    with db.session() as s:
        return s.get(Run, run_id)


def runs(db: Database, ids: Collection[int]) -> list[Run]:
    """The runs ``ids``, in id order."""
    with db.session() as s:
        return list(s.scalars(select(Run).where(among(Run.id, ids)).order_by(Run.id))) if ids else []


def run_ids(db: Database) -> list[int]:
    """Every run's id, in order."""
    with db.session() as s:
        return list(s.scalars(select(Run.id).order_by(Run.id)))


def latest_run_with_pages(db: Database) -> int | None:
    with db.session() as s:
        return s.scalar(select(func.max(Page.run_id)))


def latest_run_with_work(db: Database) -> int | None:
    """The latest run that stored pages or took files in (a refused one, a duplicate)."""
    with db.session() as s:
        return max((i for table in (Page, Rejected, Duplicate) if (i := s.scalar(select(func.max(table.run_id))))),
                   default=None)


def run_pages(db: Database, run_id: int) -> list[tuple[Page, Document]]:
    """The pages run ``run_id`` stored, each with its document, by document and page index."""
    with db.session() as s:
        return [tuple(r) for r in s.execute(select(Page, Document).join(Document, Document.id == Page.document_id)
                                            .where(Page.run_id == run_id).order_by(Document.id, Page.page_index))]


def run_chunk_stats(db: Database, run_id: int) -> list[dict[str, Any]]:
    """The decode stats of every chunk run ``run_id`` stored, by chunk id."""
    with db.session() as s:
        return [c.stats or {} for c in s.scalars(select(Chunk).where(Chunk.run_id == run_id).order_by(Chunk.id))]


def close_run(db: Database, run_id: int) -> list[int]:
    """Close ``run_id`` (its own process ends it) and cancel the chunks still reserved for it; see ``end_run``."""
    with db.engine.begin() as conn:
        return end_run(conn, run_id)


def end_run(conn: Connection, run_id: int, reason: RunEnd = RunEnd.CLOSED,
            finished_at: datetime | None = None) -> list[int]:
    """Close ``run_id`` if it is still open and cancel the chunks still reserved for it, inside the caller's
    transaction. Returns the ids of the documents that had chunks cancelled (sorted; empty when the run was
    already closed or left nothing)."""
    closed = conn.execute(update(R).where(R.c.id == run_id, R.c.finished_at.is_(None)).values(
        finished_at=finished_at or datetime.now(timezone.utc), end_reason=reason)).rowcount
    if not closed:
        return []
    how = "stopped" if reason == RunEnd.CLOSED else "was left by a process that is gone (crashed or killed)"
    rows = conn.execute(
        update(C).where(C.c.run_id == run_id, C.c.status.in_([ChunkStatus.QUEUED, ChunkStatus.RUNNING]))
        .values(status=ChunkStatus.CANCELLED, lease_owner=None, lease_expires_at=None,
                note=func.coalesce(C.c.note + literal("; "), literal(""))
                + literal(f"cancelled: its re-run (run {run_id}) {how} before decoding these pages; "
                          f"`uflash rerun` again picks them"))
        .returning(C.c.document_id)
    ).all()
    return sorted({doc_id for (doc_id,) in rows})


def close_runs_of_gone_owners(db: Database, is_gone: Callable[[str | None], bool],
                              stale_before: float | None = None) -> dict[int, list[int]]:
    """Close, as crashed, every open run whose owner process is gone, and (``stale_before``, UNIX seconds) every
    open run with a reserved chunk running on a lease that ended before then. Returns run id -> the documents
    that had chunks cancelled (see ``close_run``)."""
    with db.session() as s:
        open_runs = s.execute(select(Run.id, Run.owner, Run.started_at).where(Run.finished_at.is_(None))).all()
        stale = set() if stale_before is None else set(s.scalars(select(C.c.run_id).where(
            C.c.run_id.is_not(None), C.c.status == ChunkStatus.RUNNING, C.c.lease_expires_at < stale_before)))
    out = {}
    for run_id, owner, started_at in open_runs:
        if run_id not in stale and not is_gone(owner):
            continue
        with db.engine.begin() as conn:
            last_page = conn.scalar(select(func.max(Page.created_at)).where(Page.run_id == run_id))
            out[run_id] = end_run(conn, run_id, RunEnd.CRASHED, last_page or started_at)
    return out
