"""Files that did not become documents: rejected files (with their reason) and duplicates of a document's content;
each tied to the run that took it in, and a rejected file's return to the inbox (``uflash retry``).

Each is recorded together with putting the file where it goes (``place``: moved out of the inbox, or copied), in one
transaction: the ledger goes first, so when it cannot take the record (unreachable, locked, full) the file stays
where it is, untouched; when placing the file or the commit fails, the record is not kept and ``undo`` puts the file
back. A rejected file's return is recorded the same way (``return_rejected``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import select

from db.models import Document, Duplicate, Rejected
from db.session import Database


def record_rejected(db: Database, place: Callable[[], Path | None], undo: Callable[[Path | None], None],
                    **values) -> Path | None:
    """A rejected file (``Rejected`` columns: path, name, sha256, size_bytes, reason, run_id) recorded and placed;
    returns where it went."""
    return _record_and_place(db, Rejected(**values), place, undo)


def record_duplicate(db: Database, place: Callable[[], Path | None], undo: Callable[[Path | None], None],
                     **values) -> Path | None:
    """A duplicate of document ``document_id`` (``Duplicate`` columns) recorded and placed; returns where it went."""
    return _record_and_place(db, Duplicate(**values), place, undo)


def _record_and_place(db: Database, row: Rejected | Duplicate, place: Callable[[], Path | None],
                      undo: Callable[[Path | None], None]) -> Path | None:
    with db.session() as s:
        s.begin()
        s.add(row)
        s.flush()
        dest = None
        try:
            dest = place()
            row.moved_to = str(dest) if dest else None
            s.commit()
        except BaseException:
            with contextlib.suppress(Exception):
                s.rollback()
            undo(dest)
            raise
        return dest


def return_rejected(db: Database, rejected_id: int, place: Callable[[], Path],
                    undo: Callable[[Path], None]) -> Path | None:
    """Rejected file ``rejected_id`` put back into the inbox (``place``, which returns where) and marked retried, in one
    transaction; None when it was retried already (by another ``uflash retry`` a moment ago): nothing is placed."""
    with db.session() as s:
        s.begin()
        row = s.get(Rejected, rejected_id, with_for_update=True)
        if row is None or row.retried_at is not None:
            s.rollback()
            return None
        dest = None
        try:
            dest = place()
            row.retried_at = datetime.now(timezone.utc)
            s.commit()
        except BaseException:
            with contextlib.suppress(Exception):
                s.rollback()
            if dest is not None:
                undo(dest)
            raise
        return dest


def rejected_waiting(db: Database, moved_to: list[str] | None = None) -> list[Rejected]:
    """Rejected files not retried, by id (``moved_to``: only those put at one of these paths)."""
    with db.session() as s:
        query = select(Rejected).where(Rejected.retried_at.is_(None))
        if moved_to is not None:
            query = query.where(Rejected.moved_to.in_(moved_to))
        return list(s.scalars(query.order_by(Rejected.id)))


def files_of_run(db: Database, run_id: int) -> tuple[list[Rejected], list[tuple[Duplicate, Document]]]:
    """The files run ``run_id`` took in that became no document of their own: rejected ones, and duplicates with the
    document they duplicate; each by id."""
    with db.session() as s:
        rejected = list(s.scalars(select(Rejected).where(Rejected.run_id == run_id).order_by(Rejected.id)))
        duplicates = [tuple(r) for r in s.execute(select(Duplicate, Document)
                                                  .join(Document, Document.id == Duplicate.document_id)
                                                  .where(Duplicate.run_id == run_id).order_by(Duplicate.id))]
        return rejected, duplicates
