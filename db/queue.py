"""The chunk queue: atomic claims with leases, lease renewals, retries with backoff.

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

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from sqlalchemy import ColumnElement, Connection, and_, case, func, literal, or_, select, true, update

from db.documents import mark_running, settle
from db.models import Chunk, ChunkStatus
from db.session import Database, among

T = Chunk.__table__


@dataclass(frozen=True)
class Claim:
    chunk_id: int
    document_id: int
    first_page: int
    last_page: int
    attempts: int
    owner: str
    lease_expires_at: float

    @property
    def pages(self) -> range:
        return range(self.first_page, self.last_page + 1)


def held(c: Claim) -> ColumnElement:
    """The chunk of ``c``, while ``c``'s owner still holds its lease."""
    return and_(T.c.id == c.chunk_id, T.c.lease_owner == c.owner, T.c.status == ChunkStatus.RUNNING)


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
        settle(conn, doc_id)


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
        mark_running(conn, row.document_id)
    return Claim(row.id, row.document_id, row.first_page, row.last_page, row.attempts, owner, expires)


def renew_leases(db: Database, claims: Iterable[Claim], lease_seconds: float) -> set[int]:
    """Extend the leases of ``claims`` in one transaction; returns the ids of the chunks whose lease was renewed
    (a chunk missing from it was lost: expired and taken by another worker)."""
    by_owner: dict[str, list[int]] = {}
    for c in claims:
        by_owner.setdefault(c.owner, []).append(c.chunk_id)
    if not by_owner:
        return set()
    renewed: set[int] = set()
    with db.engine.begin() as conn:
        for owner, ids in by_owner.items():
            rows = conn.execute(update(T).where(among(T.c.id, ids), T.c.lease_owner == owner,
                                                T.c.status == ChunkStatus.RUNNING)
                                .values(lease_expires_at=time.time() + lease_seconds).returning(T.c.id)).all()
            renewed.update(r.id for r in rows)
    return renewed


def heartbeat(db: Database, c: Claim, lease_seconds: float) -> bool:
    """Extend one lease; False means it was lost (expired and taken by another worker)."""
    return c.chunk_id in renew_leases(db, [c], lease_seconds)


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


def leases_of_others(db: Database, owner: str, run_id: int | None,
                     document_ids: Collection[int] | None) -> list[tuple[str, int, float]]:
    """(owner, chunks, latest expiry) of the live leases other owners hold on chunks that ``owner`` could claim (with
    the same ``run_id`` and ``document_ids`` as its claims)."""
    now = time.time()
    mine = among(T.c.document_id, document_ids) if document_ids is not None else true()
    with db.session() as s:
        return [tuple(r) for r in s.execute(select(T.c.lease_owner, func.count(), func.max(T.c.lease_expires_at)).where(
            T.c.status == ChunkStatus.RUNNING, T.c.lease_expires_at >= now, T.c.lease_owner != owner,
            T.c.run_id.is_(None) if run_id is None else T.c.run_id == run_id, mine,
        ).group_by(T.c.lease_owner)).all()]


def fail(db: Database, c: Claim, error: str, max_attempts: int, backoff_seconds: float,
         permanent: bool = False) -> ChunkStatus | None:
    """Record a failure: retry later with backoff, or end failed after max attempts (or when permanent).
    Returns the chunk's new status (None when the lease was already lost)."""
    now = time.time()
    final = permanent or c.attempts >= max_attempts
    values = dict(lease_owner=None, lease_expires_at=None, last_error=error[:4000])
    if final:
        values["status"] = ChunkStatus.FAILED
    else:
        values["status"] = ChunkStatus.QUEUED
        values["next_attempt_at"] = now + backoff_seconds * (2 ** (c.attempts - 1))
    with db.engine.begin() as conn:
        res = conn.execute(update(T).where(held(c)).values(**values))
        if res.rowcount != 1:
            return None
        settle(conn, c.document_id)
    return values["status"]


def release(db: Database, c: Claim, reason: str | None = None) -> bool:
    """Give a chunk back untouched (shutdown, or a worker that cannot run at all): the attempt is not
    counted. ``reason``, when given, is kept as the chunk's last error so that ``uflash status`` shows it."""
    values = dict(status=ChunkStatus.QUEUED, lease_owner=None, lease_expires_at=None, attempts=T.c.attempts - 1)
    if reason is not None:
        values["last_error"] = reason[:4000]
    with db.engine.begin() as conn:
        res = conn.execute(update(T).where(held(c)).values(**values))
        return res.rowcount == 1
