"""The chunk queue: atomic claims with leases, lease renewals, retries with backoff, and what a worker that died
leaves behind.

Contract (what every function here keeps true):
- A chunk is never deleted when claimed. ``status`` moves queued -> running -> done | failed | split, and
  running -> queued on a retryable failure, a released lease or a worker that died with it.
- A claim is one ``UPDATE ... WHERE id = (SELECT ... LIMIT 1) RETURNING`` statement inside a short
  transaction (SQLite: ``BEGIN IMMEDIATE``, so two processes cannot pick the same row; PostgreSQL: the
  sub-select uses ``FOR UPDATE SKIP LOCKED``). It takes the first queued chunk (by document and page) whose
  ``next_attempt_at`` has come and counts an attempt. It may be limited to some documents (``uflash run FILE...``
  takes only the chunks of the documents it was given). Before it, the same transaction hands back the chunks of
  workers that died (``take_over_dead``: the crash rule below).
- A claim never makes a worker hold more chunks than the smallest ``batch_limit`` among the chunks it holds and the
  one it takes: when the first chunk in line does not fit beside what the worker holds, the claim takes nothing
  (the worker decodes what it holds, and takes that chunk once it has room: a limited chunk is not passed over).
- A lease is (owner, expiry). Only the owner may renew, complete or fail it, and only while it holds it:
  a worker whose lease was taken over gets ``False`` back and must drop its result.
- A lease whose owner process is known to be gone (``end_leases_of_gone_owners``: same host, process ended)
  ends at once; leases of other owners end when they expire. One heartbeat renews all of a worker's leases
  together, so once one of them has expired its owner is taken for dead, and all its leases end together.
- A chunk whose attempts reach ``max_attempts`` through errors it raised ends ``failed`` with its last error;
  earlier failures go back to ``queued`` after ``backoff * 2**(attempts-1)`` seconds.

The crash rule (``take_over_dead``). A worker that dies (killed, out of memory, a segfault in a kernel, a power
cut) says nothing about why. When it died with several chunks in flight, the likely cause is one of them, or none
(the machine): blaming all of them would fail every chunk of a batch after ``max_attempts`` crashes although at
most one was at fault. So the chunks of a worker that died with n > 1 chunks in hand go back to the queue
**uncharged** (the claim's attempt is given back), each with ``batch_limit = max(1, n // 2)``: they are decoded
again in groups half as large, and a chunk that kills its worker every time ends up alone within a few crashes
(at most log2 of the batch). A chunk that was the only one its worker held when it died (``batch_limit`` 1, or
nothing else in flight) is the evidence: it is **charged** the attempt (``solo_crashes`` counts these), keeps
``batch_limit`` 1, and after ``max_attempts`` attempts ends ``failed`` with a reason that says it killed the
worker when decoded alone. A chunk that completes changes nothing for the others; a limit stays with its chunk.
Chunks reserved for a re-run are left to their run (db.runs cancels them when it is found gone).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from sqlalchemy import ColumnElement, Connection, and_, func, or_, select, true, update

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
    batch_limit: int | None = None  # the chunk's own: its worker holds at most this many chunks while it holds it

    @property
    def pages(self) -> range:
        return range(self.first_page, self.last_page + 1)


def room_left(held: Collection[Claim]) -> int | None:
    """How many more chunks a worker holding ``held`` may claim under their batch limits (None: no limit)."""
    limits = [c.batch_limit for c in held if c.batch_limit is not None]
    return None if not limits else max(0, min(limits) - len(held))


@dataclass(frozen=True)
class TakenOver:
    """What ``take_over_dead`` did with the chunks of one worker that died: ``chunks`` (id, document id, first page,
    last page) went back to the queue uncharged with ``batch_limit``; or (one chunk, alone) were charged, and
    ``failed`` says whether that was its last attempt."""

    owner: str | None
    chunks: list[tuple[int, int, int, int]]
    batch_limit: int
    charged: bool
    failed: bool
    reason: str


def held(c: Claim) -> ColumnElement:
    """The chunk of ``c``, while ``c``'s owner still holds its lease."""
    return and_(T.c.id == c.chunk_id, T.c.lease_owner == c.owner, T.c.status == ChunkStatus.RUNNING)


def _take_over_dead(conn: Connection, now: float, max_attempts: int, claimer: str | None) -> list[TakenOver]:
    """The crash rule of the module docstring, inside the caller's transaction: the chunks of every worker (other than
    ``claimer``) with an expired lease go back to the queue, uncharged when it died with others in flight, charged
    (or failed, on its last attempt) when it died with this chunk alone."""
    dead = [o for (o,) in conn.execute(select(T.c.lease_owner).where(
        T.c.status == ChunkStatus.RUNNING, T.c.lease_expires_at < now, T.c.run_id.is_(None),
        *([] if claimer is None else [func.coalesce(T.c.lease_owner, "") != claimer]))
        .distinct().order_by(T.c.lease_owner))]  # in one order: two claims lock the same rows in the same order
    out = []
    for owner in dead:
        mine = and_(T.c.status == ChunkStatus.RUNNING, T.c.run_id.is_(None),
                    T.c.lease_owner.is_(None) if owner is None else T.c.lease_owner == owner)
        pick = select(T.c.id, T.c.document_id, T.c.first_page, T.c.last_page, T.c.attempts, T.c.solo_crashes)
        if conn.dialect.name == "postgresql":  # a claim racing this one waits, then finds them taken over
            pick = pick.with_for_update()
        rows = conn.execute(pick.where(mine).order_by(T.c.id)).all()
        if not rows:
            continue
        n, ids = len(rows), [r.id for r in rows]
        chunks = [(r.id, r.document_id, r.first_page, r.last_page) for r in rows]
        back = dict(status=ChunkStatus.QUEUED, lease_owner=None, lease_expires_at=None, next_attempt_at=now)
        if n > 1:
            limit = max(1, n // 2)
            reason = (f"its worker ({owner}) died with {n} chunks in flight: not counted as an attempt; decoded "
                      f"again with at most {limit} chunk(s) at a time")
            conn.execute(update(T).where(mine, T.c.id.in_(ids)).values(
                **back, attempts=T.c.attempts - 1, batch_limit=limit, last_error=reason))
            out.append(TakenOver(owner, chunks, limit, charged=False, failed=False, reason=reason))
            continue
        r = rows[0]
        solo = r.solo_crashes + 1
        if r.attempts >= max_attempts:
            times = f"{solo} time{'s' if solo > 1 else ''}"
            reason = (f"killed the worker on every attempt (decoded alone {times}; last worker {owner})"
                      if solo >= r.attempts else f"killed the worker when decoded alone ({times} in {r.attempts} "
                                                 f"attempts; last worker {owner})")
            values = dict(status=ChunkStatus.FAILED, lease_owner=None, lease_expires_at=None)
        else:
            reason = (f"its worker ({owner}) died while it decoded alone: attempt {r.attempts} of {max_attempts} "
                      f"counted; decoded again alone")
            values = back
        conn.execute(update(T).where(mine, T.c.id == r.id).values(
            **values, solo_crashes=solo, batch_limit=1, last_error=reason))
        settle(conn, r.document_id)
        out.append(TakenOver(owner, chunks, 1, charged=True, failed=r.attempts >= max_attempts, reason=reason))
    return out


def take_over_dead(db: Database, claimer: str | None, max_attempts: int, now: float | None = None
                   ) -> list[TakenOver]:
    """Apply the crash rule (module docstring) now, in a transaction of its own, to the chunks of every worker but
    ``claimer`` whose lease has expired (or was ended by ``end_leases_of_gone_owners``); a claim does the same
    first. Returns what was done, for the log."""
    now = time.time() if now is None else now
    with db.engine.begin() as conn:
        return _take_over_dead(conn, now, max_attempts, claimer)


def claim(db: Database, owner: str, lease_seconds: float, max_attempts: int, now: float | None = None,
          run_id: int | None = None, document_ids: Collection[int] | None = None,
          on_takeover: Callable[[TakenOver], None] | None = None) -> Claim | None:
    """Atomically take the next runnable chunk for ``owner``, or return None when there is none (or when the next in
    line does not fit beside the chunks ``owner`` holds, by their ``batch_limit``).

    A chunk queued with its ``run_id`` already set is reserved for that run (a re-run): only a claim with
    that ``run_id`` takes it, and a claim with a ``run_id`` takes nothing else. (Other chunks get their
    run_id when they complete.) With ``document_ids`` only chunks of those documents are taken (an empty
    collection takes nothing); the claim stays one atomic statement. The chunks of dead workers are taken over
    first (``take_over_dead``); ``on_takeover`` hears of each, once the transaction is committed."""
    now = time.time() if now is None else now
    runnable = and_(T.c.status == ChunkStatus.QUEUED, T.c.next_attempt_at <= now,
                    T.c.run_id.is_(None) if run_id is None else T.c.run_id == run_id)
    if document_ids is not None:
        runnable = and_(runnable, among(T.c.document_id, document_ids))
    pick = select(T.c.id).where(runnable).order_by(T.c.document_id, T.c.first_page, T.c.id).limit(1)
    if db.dialect == "postgresql":
        pick = pick.with_for_update(skip_locked=True)
    expires = now + lease_seconds
    with db.engine.begin() as conn:
        taken_over = _take_over_dead(conn, now, max_attempts, owner)
        holding, lowest = conn.execute(select(func.count(), func.min(T.c.batch_limit)).where(
            T.c.status == ChunkStatus.RUNNING, T.c.lease_owner == owner)).one()
        row = None
        if lowest is None or holding < lowest:
            fits = or_(T.c.batch_limit.is_(None), T.c.batch_limit > holding)
            row = conn.execute(
                update(T).where(T.c.id == pick.scalar_subquery(), fits)
                .values(status=ChunkStatus.RUNNING, lease_owner=owner, lease_expires_at=expires,
                        attempts=T.c.attempts + 1)
                .returning(T.c.id, T.c.document_id, T.c.first_page, T.c.last_page, T.c.attempts, T.c.batch_limit)
            ).first()
            if row is not None:
                mark_running(conn, row.document_id)
    for t in taken_over if on_takeover is not None else []:
        on_takeover(t)
    if row is None:
        return None
    return Claim(row.id, row.document_id, row.first_page, row.last_page, row.attempts, owner, expires,
                 row.batch_limit)


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
