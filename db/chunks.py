"""A chunk's results and what becomes of a chunk: stored with its pages, split into new chunks, queued for a re-run.

Results and the chunk's completion commit in one transaction, and only while the worker still holds the chunk's
lease (``LeaseLost`` otherwise, and nothing is written): a worker killed mid-chunk leaves nothing behind, and one whose
lease was taken over cannot store a page twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select, update

from db.documents import PENDING, settle
from db.models import Chunk, ChunkStatus, Page
from db.queue import Claim, held
from db.session import Database

C = Chunk.__table__
P = Page.__table__


class LeaseLost(Exception):
    """The chunk's lease was taken over (or the chunk already stored): its results must be dropped."""


def store_chunk(db: Database, c: Claim, run_id: int, pages: Sequence[dict[str, Any]], *,
                new_ranges: Sequence[tuple[int, int]] = (), note: str | None = None,
                stats: dict[str, Any] | None = None, output_ids: list[int] | None = None,
                reserved_for: int | None = None) -> bool:
    """Store a decoded chunk in one transaction: its pages (rows of ``Page`` columns), the chunk done (or split, when
    ``new_ranges`` are given: new queued chunks for those pages, reserved for run ``reserved_for`` when set), and the
    document's status. Returns whether the document is now ready to be finished; raises ``LeaseLost``."""
    values: dict[str, Any] = dict(status=ChunkStatus.SPLIT if new_ranges else ChunkStatus.DONE, lease_owner=None,
                                  lease_expires_at=None, last_error=None, run_id=run_id)
    for key, value in (("note", note), ("stats", stats), ("output_ids", output_ids)):
        if value is not None:
            values[key] = value
    with db.engine.begin() as conn:
        if conn.execute(update(C).where(held(c)).values(**values)).rowcount != 1:
            raise LeaseLost(c.chunk_id)
        if pages:
            conn.execute(P.insert(), [dict(p, document_id=c.document_id, run_id=run_id, chunk_id=c.chunk_id)
                                      for p in pages])
        if new_ranges:
            conn.execute(C.insert(), [dict(document_id=c.document_id, first_page=a, last_page=b, parent_id=c.chunk_id,
                                           run_id=reserved_for) for a, b in new_ranges])
        return settle(conn, c.document_id)


def split_chunk(db: Database, c: Claim, ranges: Sequence[tuple[int, int]], note: str,
                reserved_for: int | None = None) -> bool:
    """The chunk is not decoded but split: new queued chunks for ``ranges``. False when the lease was lost."""
    with db.engine.begin() as conn:
        if conn.execute(update(C).where(held(c)).values(status=ChunkStatus.SPLIT, note=note, lease_owner=None,
                                                        lease_expires_at=None, last_error=None)).rowcount != 1:
            return False
        conn.execute(C.insert(), [dict(document_id=c.document_id, first_page=a, last_page=b, parent_id=c.chunk_id,
                                       run_id=reserved_for) for a, b in ranges])
    return True


def replay_ids(db: Database, c: Claim) -> list[int] | None:
    """Token ids of an earlier decode of exactly these pages (a re-run's free draft), if any."""
    with db.session() as s:
        return s.scalar(select(Chunk.output_ids).where(
            Chunk.document_id == c.document_id, Chunk.first_page == c.first_page, Chunk.last_page == c.last_page,
            Chunk.id != c.chunk_id, Chunk.output_ids.is_not(None)).order_by(Chunk.id.desc()).limit(1))


def chunk_ranges(db: Database, ids: set[int]) -> dict[int, tuple[int, int, int | None]]:
    """Chunk id -> (first page, last page, parent chunk id) of ``ids`` and of all their ancestors."""
    found: dict[int, tuple[int, int, int | None]] = {}
    with db.session() as s:
        while ids:
            rows = s.execute(select(Chunk.id, Chunk.first_page, Chunk.last_page, Chunk.parent_id)
                             .where(Chunk.id.in_(ids))).all()
            found.update({r.id: (r.first_page, r.last_page, r.parent_id) for r in rows})
            ids = {r.parent_id for r in rows if r.parent_id is not None} - set(found)
    return found


def queue_reserved(db: Database, run_id: int, ranges: Sequence[tuple[int, int, int]], note: str) -> None:
    """Queue chunks (document id, first page, last page) reserved for run ``run_id`` (a re-run's: other workers leave
    them alone); ``note`` is formatted with ``first`` and ``last``."""
    with db.engine.begin() as conn:
        conn.execute(C.insert(), [dict(document_id=d, first_page=a, last_page=b, run_id=run_id,
                                       note=note.format(first=a, last=b)) for d, a, b in ranges])


def reserved_chunks(db: Database, run_id: int) -> list[Chunk]:
    """The chunks reserved for run ``run_id``, by document and first page."""
    with db.session() as s:
        return list(s.scalars(select(Chunk).where(Chunk.run_id == run_id)
                              .order_by(Chunk.document_id, Chunk.first_page, Chunk.id)))


def reserved_pending(db: Database, run_id: int) -> int:
    """How many chunks reserved for run ``run_id`` still wait (queued or running)."""
    with db.session() as s:
        return s.scalar(select(func.count()).select_from(Chunk).where(
            Chunk.run_id == run_id, Chunk.status.in_(PENDING)))


def complete_chunk(db: Database, c: Claim, run_id: int | None = None) -> bool:
    """Mark a held chunk done with no pages (queue tests, tools); False when the lease was lost."""
    values: dict[str, Any] = dict(status=ChunkStatus.DONE, lease_owner=None, lease_expires_at=None, last_error=None)
    if run_id is not None:
        values["run_id"] = run_id
    with db.engine.begin() as conn:
        if conn.execute(update(C).where(held(c)).values(**values)).rowcount != 1:
            return False
        settle(conn, c.document_id)
    return True
