"""Documents in the ledger: created with their chunks, and the one place their status changes.

A document's status follows its chunks: ``queued`` until a chunk of it is claimed (``mark_running``), ``running``
while any chunk is pending, ``failed`` when a chunk failed and nothing is pending (``settle``; the chunks' reasons
become the document's error), and ``done`` once its outputs are written (``finish_document``). A document whose
chunks are all done (or split into chunks that are) but that is not finished yet is *ready*: the worker writes its
outputs. ``fail_document`` records a document that could not be finished (its outputs or its archiving failed), and
``retry_failed`` gives a failed one another try. A failed document records where its original lies while it is failed
(``failed_path``: ingest.intake.failed puts it in failed/).

Finishing is one worker's at a time (``claim_finish``): the worker that stored a document's last chunk and a worker
that finds it ready while idle (after a crash in between) would otherwise both write its outputs and both archive its
original, the second one failing it. The claim is a lease on the document's first chunk, whose lease fields a chunk
that is not running has no other use for; it is released when the document is done or failed, runs out after
``FINISH_LEASE_SECONDS`` (a finisher that died), and passes at once from an owner known to be gone.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import Connection, func, or_, select, update
from sqlalchemy.exc import IntegrityError

from db.models import Chunk, ChunkStatus, DocStatus, Document
from db.session import Database, among

D = Document.__table__
FINISH_LEASE_SECONDS = 600.0  # a document's finishing claim (grades, outputs, PDF/A, archiving), renewed on the way
C = Chunk.__table__
WAITING = (DocStatus.QUEUED, DocStatus.RUNNING)
PENDING = (ChunkStatus.QUEUED, ChunkStatus.RUNNING)


def mark_running(conn: Connection, doc_id: int) -> None:
    """A chunk of the document was claimed: a queued document is running from now on."""
    conn.execute(update(D).where(D.c.id == doc_id, D.c.status == DocStatus.QUEUED).values(status=DocStatus.RUNNING))


def settle(conn: Connection, doc_id: int) -> bool:
    """Derive the document's status from its chunks, inside the caller's transaction. True when it is ready to be
    finished (every chunk done or split, the document not finished yet). A document with a failed chunk and nothing
    pending is failed, with the chunks' reasons."""
    rows = conn.execute(select(C.c.status, C.c.first_page, C.c.last_page, C.c.last_error)
                        .where(C.c.document_id == doc_id)).all()
    if any(r.status in PENDING for r in rows):
        return False
    failed = [r for r in rows if r.status == ChunkStatus.FAILED]
    if failed:
        reason = "; ".join(f"pages {r.first_page}-{r.last_page}: {r.last_error}" for r in failed)
        conn.execute(update(D).where(D.c.id == doc_id).values(status=DocStatus.FAILED, error=reason[:4000]))
        return False
    return True


def ready_to_finish(db: Database, doc_id: int) -> bool:
    """``settle`` in a transaction of its own."""
    with db.engine.begin() as conn:
        return settle(conn, doc_id)


def get_document(db: Database, doc_id: int) -> Document | None:
    with db.session() as s:
        return s.get(Document, doc_id)


def document_by_sha(db: Database, sha256: str) -> Document | None:
    with db.session() as s:
        return s.scalar(select(Document).where(Document.sha256 == sha256))


def document_of_file(db: Database, path: Path, size: int, mtime_ns: int) -> int | None:
    """The id of the document this very file (path, size, mtime) already is, while it waits in place (or failed and
    stayed there). A failed document's original that was put in failed/ and is found at its old path again was
    dropped there again: not this."""
    with db.session() as s:
        return s.scalar(select(Document.id).where(
            Document.original_path == str(path), Document.size_bytes == size, Document.mtime_ns == mtime_ns,
            Document.archived_path.is_(None),
            or_(Document.failed_path.is_(None), Document.failed_path == Document.original_path)))


def original_of(path: Path, size: int, mtime_ns: int) -> dict:
    """The columns that say where a document's original is and which file it was."""
    return dict(original_path=str(path), original_name=path.name, size_bytes=size, mtime_ns=mtime_ns)


def create_document(db: Database, original: dict, sha256: str, kind: str, page_count: int,
                    ranges: Sequence[tuple[int, int]]) -> int | None:
    """A new queued document with one queued chunk per page range, in one transaction; None when a document of that
    content was recorded meanwhile (by another intake process)."""
    try:
        with db.engine.begin() as conn:
            doc_id = conn.execute(D.insert().values(**original, sha256=sha256, kind=kind, page_count=page_count,
                                                    status=DocStatus.QUEUED).returning(D.c.id)).scalar_one()
            conn.execute(C.insert(), [dict(document_id=doc_id, first_page=a, last_page=b) for a, b in ranges])
    except IntegrityError:
        return None
    return doc_id


def retry_failed(db: Database, doc_id: int, original: dict | None = None) -> int | None:
    """Give a failed document another try: its failed chunks go back to the queue with their attempts (and the
    crashes they were charged) reset, and the document is queued again (``original``: the file that is its original
    from now on, ``original_of``'s columns, which makes it unarchived; or only ``archived_path``: where its archived
    original is now). Done chunks and their pages stay as they are; a chunk keeps its batch limit (one that killed its
    worker is tried alone again). A failed chunk that was reserved for a re-run is freed for any worker (that run has
    ended, and nothing else would ever claim it). Returns how many chunks were re-queued; None when the document was
    no longer failed (another intake re-queued it a moment ago)."""
    values: dict = dict(status=DocStatus.QUEUED, error=None, failed_path=None)
    if original and "original_path" in original:
        values["archived_path"] = None
    values.update(original or {})
    with db.engine.begin() as conn:
        res = conn.execute(update(D).where(D.c.id == doc_id, D.c.status == DocStatus.FAILED).values(**values))
        if res.rowcount != 1:
            return None
        return conn.execute(update(C).where(C.c.document_id == doc_id, C.c.status == ChunkStatus.FAILED).values(
            status=ChunkStatus.QUEUED, attempts=0, solo_crashes=0, next_attempt_at=0.0, last_error=None,
            run_id=None)).rowcount


def failed_documents(db: Database) -> list[int]:
    """The failed documents, by id."""
    with db.session() as s:
        return list(s.scalars(select(Document.id).where(Document.status == DocStatus.FAILED).order_by(Document.id)))


def failed_document_at(db: Database, paths: Collection[str]) -> int | None:
    """The failed document whose original lies at one of ``paths`` (its ``failed_path``), if any."""
    with db.session() as s:
        return s.scalar(select(Document.id).where(Document.status == DocStatus.FAILED,
                                                  Document.failed_path.in_(list(paths))).limit(1))


def failed_unfiled(db: Database, ids: Collection[int] | None = None) -> list[Document]:
    """Failed documents (of ``ids``, when given) whose original was not filed away yet (no ``failed_path``)."""
    with db.session() as s:
        query = select(Document).where(Document.status == DocStatus.FAILED, Document.failed_path.is_(None))
        if ids is not None:
            query = query.where(among(Document.id, ids))
        return list(s.scalars(query.order_by(Document.id)))


def set_failed_path(db: Database, doc_id: int, path: Path | str, only_if_unset: bool = False) -> bool:
    """Record where the failed document's original lies ("": nowhere to be found); with ``only_if_unset``, only when
    no one recorded it yet (two workers filing the same document: one does). False when the document is no longer
    failed (or it was set)."""
    cond = [D.c.id == doc_id, D.c.status == DocStatus.FAILED]
    if only_if_unset:
        cond.append(D.c.failed_path.is_(None))
    with db.engine.begin() as conn:
        return conn.execute(update(D).where(*cond).values(failed_path=str(path))).rowcount == 1


def adopt_path(db: Database, doc: Document, original: dict) -> bool:
    """A waiting document's file found at a new path (renamed or moved): that file is its original from now on.
    False when another intake adopted another path first."""
    with db.engine.begin() as conn:
        return conn.execute(update(D).where(D.c.id == doc.id, D.c.original_path == doc.original_path,
                                            D.c.archived_path.is_(None)).values(**original)).rowcount == 1


def note_file_stamp(db: Database, doc_id: int, size: int, mtime_ns: int) -> None:
    """The document's file was touched in place (same content): remember its new size and mtime."""
    with db.engine.begin() as conn:
        conn.execute(update(D).where(D.c.id == doc_id).values(size_bytes=size, mtime_ns=mtime_ns))


def _first_chunk(doc_id: int):
    return select(func.min(C.c.id)).where(C.c.document_id == doc_id).scalar_subquery()


def claim_finish(db: Database, doc_id: int, owner: str, gone: Collection[str] = (),
                 lease_seconds: float = FINISH_LEASE_SECONDS) -> bool:
    """Take (or renew) the finishing of the document for ``owner`` (see the module docstring); False when another
    owner holds it, unless that owner is among ``gone``."""
    now = time.time()
    free = [C.c.lease_owner.is_(None), C.c.lease_owner == owner, C.c.lease_expires_at < now]
    if gone:
        free.append(C.c.lease_owner.in_(list(gone)))
    with db.engine.begin() as conn:
        return conn.execute(update(C).where(C.c.id == _first_chunk(doc_id), C.c.status != ChunkStatus.RUNNING,
                                            or_(*free))
                            .values(lease_owner=owner, lease_expires_at=now + lease_seconds)).rowcount == 1


def finishing_owner(db: Database, doc_id: int) -> str | None:
    """Who holds the document's finishing claim now (an unexpired one), if anyone."""
    with db.engine.begin() as conn:
        return conn.execute(select(C.c.lease_owner).where(
            C.c.id == _first_chunk(doc_id), C.c.status != ChunkStatus.RUNNING,
            C.c.lease_expires_at >= time.time())).scalar()


def _release_finish(conn: Connection, doc_id: int, owner: str | None = None) -> None:
    held_by = [] if owner is None else [C.c.lease_owner == owner]
    conn.execute(update(C).where(C.c.id == _first_chunk(doc_id), C.c.status != ChunkStatus.RUNNING, *held_by)
                 .values(lease_owner=None, lease_expires_at=None))


def release_finish(db: Database, doc_id: int, owner: str) -> None:
    """Give the document's finishing claim back, if ``owner`` holds it (it finished nothing)."""
    with db.engine.begin() as conn:
        _release_finish(conn, doc_id, owner)


def finish_document(db: Database, doc_id: int, output_dir: Path, archived: Path | None, error: str | None) -> None:
    """The document's outputs are written (into ``output_dir``) and its original archived: it is done (and its
    finishing claim released)."""
    with db.engine.begin() as conn:
        conn.execute(update(D).where(D.c.id == doc_id).values(
            status=DocStatus.DONE, archived_path=str(archived) if archived else None, error=error,
            output_dir=str(output_dir), completed_at=datetime.now(timezone.utc)))
        _release_finish(conn, doc_id)


def fail_document(db: Database, doc_id: int, reason: str, output_dir: Path | None = None) -> None:
    """The document could not be finished (its pages stay in the ledger): failed with ``reason``."""
    values: dict = dict(status=DocStatus.FAILED, error=reason[:4000])
    if output_dir is not None:
        values["output_dir"] = str(output_dir)
    with db.engine.begin() as conn:
        conn.execute(update(D).where(D.c.id == doc_id).values(**values))
        _release_finish(conn, doc_id)


def documents(db: Database, ids: Collection[int]) -> list[Document]:
    with db.session() as s:
        return list(s.scalars(select(Document).where(among(Document.id, ids)).order_by(Document.id)))


def unfinished_documents(db: Database, ids: Collection[int] | None = None) -> list[int]:
    """Queued or running documents (of ``ids``, when given), by id."""
    with db.session() as s:
        query = select(Document.id).where(Document.status.in_(WAITING)).order_by(Document.id)
        if ids is not None:
            query = query.where(among(Document.id, ids))
        return list(s.scalars(query))


def waiting_documents(db: Database, exclude: Collection[int] = ()) -> tuple[list[int], int]:
    """Documents waiting in the ledger (queued or running), apart from ``exclude``, and how many chunks they
    still have to decode (not counting chunks reserved for a re-run)."""
    skip = set(exclude)
    ids = [i for i in unfinished_documents(db) if i not in skip]
    if not ids:
        return [], 0
    with db.session() as s:
        chunks = s.scalar(select(func.count()).select_from(Chunk).where(
            among(Chunk.document_id, ids), Chunk.status.in_(PENDING), Chunk.run_id.is_(None)))
    return ids, chunks


def pending_pages(db: Database, doc_ids: Collection[int]) -> int:
    """Pages still to decode in these documents (their queued and running chunks, not reserved for a re-run)."""
    with db.session() as s:
        return int(s.scalar(select(func.coalesce(func.sum(Chunk.last_page - Chunk.first_page + 1), 0)).where(
            among(Chunk.document_id, doc_ids), Chunk.status.in_(PENDING), Chunk.run_id.is_(None))) or 0)
