"""The chunk queue: atomic claims with leases, heartbeats, retries with backoff.

Contract (what every function here keeps true):
- A chunk is never deleted when claimed. ``status`` moves queued -> running -> done | failed | split, and
  running -> queued on a retryable failure or a released lease.
- A claim is one ``UPDATE ... WHERE id = (SELECT ... LIMIT 1) RETURNING`` statement inside a short
  transaction (SQLite: ``BEGIN IMMEDIATE``, so two processes cannot pick the same row; PostgreSQL: the
  sub-select uses ``FOR UPDATE SKIP LOCKED``). It takes a queued chunk whose ``next_attempt_at`` has come,
  or a running chunk whose lease has expired (its owner died), and counts an attempt. It may be limited to
  some documents (``uflash run FILE...`` takes only the chunks of the documents it was given).
- A lease is (owner, expiry). Only the owner may renew, complete or fail it, and only while it holds it:
  a worker whose lease was taken over gets ``False`` back and must drop its result.
- A lease whose owner process is known to be gone (``end_leases_of_gone_owners``: same host, process ended)
  ends at once; leases of other owners end when they expire.
- A chunk whose attempts reach ``max_attempts`` ends ``failed`` with its last error; earlier failures go
  back to ``queued`` after ``backoff * 2**(attempts-1)`` seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from loguru import logger
from sqlalchemy import ColumnElement, Connection, and_, bindparam, case, func, literal, or_, select, update

from db.models import Chunk, ChunkStatus, DocStatus, Document
from db.session import Database

T = Chunk.__table__
D = Document.__table__


@dataclass(frozen=True)
class Claim:
    chunk_id: int
    document_id: int
    first_page: int
    last_page: int
    attempts: int
    owner: str
    lease_expires_at: float


def _fail_exhausted(conn: Connection, now: float, max_attempts: int) -> None:
    """Running chunks whose lease expired and that have no attempt left end failed."""
    rows = conn.execute(
        update(T)
        .where(T.c.status == ChunkStatus.RUNNING, T.c.lease_expires_at < now, T.c.attempts >= max_attempts)
        .values(
            status=ChunkStatus.FAILED,
            last_error=literal("lease expired on every attempt (worker crashed or was killed); last owner ")
            + func.coalesce(T.c.lease_owner, ""),
            lease_owner=None,
            lease_expires_at=None,
        )
        .returning(T.c.document_id)
    ).all()
    for (doc_id,) in rows:
        refresh_document(conn, doc_id)


def among(column: ColumnElement, ids: Collection[int]) -> ColumnElement:
    """``column IN (ids)`` with the ids written into the SQL rather than bound one parameter each, so that a
    `uflash run` of a folder of many thousand files stays under SQLite's and PostgreSQL's parameter limits."""
    return column.in_(bindparam("ids", sorted(ids), expanding=True, literal_execute=True, unique=True))


def claim(db: Database, owner: str, lease_seconds: float, max_attempts: int, now: float | None = None,
          run_id: int | None = None, document_ids: Collection[int] | None = None) -> Claim | None:
    """Atomically take the next runnable chunk for ``owner``, or return None when there is none.

    A chunk queued with its ``run_id`` already set is reserved for that run (a re-run): only a claim with
    that ``run_id`` takes it, and a claim with a ``run_id`` takes nothing else. (Other chunks get their
    run_id when they complete.) With ``document_ids`` only chunks of those documents are taken (an empty
    collection takes nothing); the claim stays one atomic statement."""
    now = time.time() if now is None else now
    runnable = or_(
        and_(T.c.status == ChunkStatus.QUEUED, T.c.next_attempt_at <= now),
        and_(T.c.status == ChunkStatus.RUNNING, T.c.lease_expires_at < now),
    )
    runnable = and_(runnable, T.c.run_id.is_(None) if run_id is None else T.c.run_id == run_id)
    if document_ids is not None:
        runnable = and_(runnable, among(T.c.document_id, document_ids))
    pick = select(T.c.id).where(runnable).order_by(T.c.document_id, T.c.first_page, T.c.id).limit(1)
    if db.dialect == "postgresql":
        pick = pick.with_for_update(skip_locked=True)
    expires = now + lease_seconds
    stmt = (
        update(T)
        .where(T.c.id == pick.scalar_subquery())
        .values(
            status=ChunkStatus.RUNNING,
            lease_owner=owner,
            lease_expires_at=expires,
            attempts=T.c.attempts + 1,
            last_error=case(
                (T.c.status == ChunkStatus.RUNNING, literal("lease of ") + T.c.lease_owner + literal(" expired")),
                else_=T.c.last_error,
            ),
        )
        .returning(T.c.id, T.c.document_id, T.c.first_page, T.c.last_page, T.c.attempts)
    )
    with db.engine.begin() as conn:
        _fail_exhausted(conn, now, max_attempts)
        row = conn.execute(stmt).first()
        if row is None:
            return None
        conn.execute(
            update(D).where(D.c.id == row.document_id, D.c.status == DocStatus.QUEUED).values(status=DocStatus.RUNNING)
        )
    return Claim(row.id, row.document_id, row.first_page, row.last_page, row.attempts, owner, expires)


def _held(claim_or_id: Claim | int, owner: str | None = None):
    cid = claim_or_id.chunk_id if isinstance(claim_or_id, Claim) else claim_or_id
    own = claim_or_id.owner if isinstance(claim_or_id, Claim) else owner
    return and_(T.c.id == cid, T.c.lease_owner == own, T.c.status == ChunkStatus.RUNNING)


def end_leases_of_gone_owners(db: Database, is_gone: Callable[[str | None], bool], now: float | None = None) -> int:
    """End now the leases held by owner processes that are gone (``is_gone``, e.g. a worker killed on this host),
    so that the next claim takes their chunks over at once instead of when the lease runs out. Returns how many
    chunks were released this way."""
    now = time.time() if now is None else now
    with db.session() as s:
        owners = s.scalars(select(T.c.lease_owner).where(
            T.c.status == ChunkStatus.RUNNING, T.c.lease_expires_at >= now).distinct()).all()
    gone = [o for o in owners if is_gone(o)]
    if not gone:
        return 0
    with db.engine.begin() as conn:
        return conn.execute(update(T).where(
            T.c.status == ChunkStatus.RUNNING, T.c.lease_owner.in_(gone), T.c.lease_expires_at >= now)
            .values(lease_expires_at=now - 0.001)).rowcount


def heartbeat(db: Database, c: Claim, lease_seconds: float) -> bool:
    """Extend the lease; False means it was lost (expired and taken by another worker)."""
    with db.engine.begin() as conn:
        res = conn.execute(update(T).where(_held(c)).values(lease_expires_at=time.time() + lease_seconds))
        return res.rowcount == 1


def complete(conn: Connection, c: Claim, status: str = ChunkStatus.DONE, note: str | None = None,
             stats: dict | None = None, run_id: int | None = None, output_ids: list[int] | None = None) -> bool:
    """Mark the chunk finished inside the caller's transaction (so results and completion commit together).
    Returns False when the lease was lost: the caller must roll back its results."""
    values = dict(status=status, lease_owner=None, lease_expires_at=None, last_error=None)
    if note is not None:
        values["note"] = note
    if stats is not None:
        values["stats"] = stats
    if run_id is not None:
        values["run_id"] = run_id
    if output_ids is not None:
        values["output_ids"] = output_ids
    res = conn.execute(update(T).where(_held(c)).values(**values))
    return res.rowcount == 1


def fail(db: Database, c: Claim, error: str, max_attempts: int, backoff_seconds: float,
         permanent: bool = False) -> str:
    """Record a failure: retry later with backoff, or end failed after max attempts (or when permanent).
    Returns the chunk's new status ('' when the lease was already lost)."""
    now = time.time()
    final = permanent or c.attempts >= max_attempts
    values = dict(lease_owner=None, lease_expires_at=None, last_error=error[:4000])
    if final:
        values["status"] = ChunkStatus.FAILED
    else:
        values["status"] = ChunkStatus.QUEUED
        values["next_attempt_at"] = now + backoff_seconds * (2 ** (c.attempts - 1))
    with db.engine.begin() as conn:
        res = conn.execute(update(T).where(_held(c)).values(**values))
        if res.rowcount != 1:
            return ""
        refresh_document(conn, c.document_id)
    return values["status"]


def release(db: Database, c: Claim, reason: str | None = None) -> bool:
    """Give a chunk back untouched (shutdown, or a worker that cannot run at all): the attempt is not
    counted. ``reason``, when given, is kept as the chunk's last error so that ``uflash status`` shows it."""
    values = dict(status=ChunkStatus.QUEUED, lease_owner=None, lease_expires_at=None, attempts=T.c.attempts - 1)
    if reason is not None:
        values["last_error"] = reason[:4000]
    with db.engine.begin() as conn:
        res = conn.execute(update(T).where(_held(c)).values(**values))
        return res.rowcount == 1


def refresh_document(conn: Connection, doc_id: int) -> str:
    """Derive a document's status from its chunks. Returns 'ready' when every chunk is done or split
    (outputs may be written), otherwise the status set. A document with a failed chunk and nothing
    pending is failed, with the chunks' reasons."""
    rows = conn.execute(
        select(T.c.status, T.c.first_page, T.c.last_page, T.c.last_error).where(T.c.document_id == doc_id)
    ).all()
    pending = [r for r in rows if r.status in (ChunkStatus.QUEUED, ChunkStatus.RUNNING)]
    failed = [r for r in rows if r.status == ChunkStatus.FAILED]
    if pending:
        return DocStatus.RUNNING
    if failed:
        reason = "; ".join(f"pages {r.first_page}-{r.last_page}: {r.last_error}" for r in failed)
        conn.execute(update(D).where(D.c.id == doc_id).values(status=DocStatus.FAILED, error=reason[:4000]))
        return DocStatus.FAILED
    return "ready"


def requeue_failed(conn: Connection, doc_id: int) -> int:
    """Give a failed document another try, inside the caller's transaction: its failed chunks go back to the
    queue with their attempts reset, and the document is queued again. Done chunks and their pages stay as
    they are. A failed chunk that was reserved for a re-run is freed for any worker (that run has ended, and
    nothing else would ever claim it). Returns how many chunks were re-queued."""
    res = conn.execute(
        update(T)
        .where(T.c.document_id == doc_id, T.c.status == ChunkStatus.FAILED)
        .values(status=ChunkStatus.QUEUED, attempts=0, next_attempt_at=0.0, last_error=None, run_id=None)
    )
    conn.execute(update(D).where(D.c.id == doc_id).values(status=DocStatus.QUEUED, error=None))
    return res.rowcount


class Heartbeat:
    """Renews a lease in a background thread while work runs: ``with Heartbeat(...) as hb: ...``.
    ``hb.lost`` is set when a renewal finds the lease gone."""

    def __init__(self, db: Database, c: Claim, lease_seconds: float, every_seconds: float):
        self.db, self.claim, self.lease, self.every = db, c, lease_seconds, every_seconds
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{c.chunk_id}", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            try:
                if not heartbeat(self.db, self.claim, self.lease):
                    logger.warning("lease on chunk {} was lost", self.claim.chunk_id)
                    self.lost.set()
                    return
            except Exception as e:  # a DB hiccup must not kill the worker; the next beat retries
                logger.warning("heartbeat for chunk {} failed: {}", self.claim.chunk_id, e)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
