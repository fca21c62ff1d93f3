"""One heartbeat thread that keeps every lease a worker holds alive (``worker.heartbeat_seconds``), with one statement
per beat whatever the number of chunks in hand (db.queue.renew_leases). A lease found taken over is marked lost: the
worker drops that chunk's result when it ends. A failed beat (the ledger in trouble) is logged and the next retries."""

from __future__ import annotations

import threading
from collections.abc import Collection
from datetime import datetime

from loguru import logger

from db.queue import Claim, leases_of_others, renew_leases
from db.session import Database
from ingest.config import WorkerSettings


class LeaseKeeper:
    """``with keeper:`` runs the heartbeat thread; ``hold(c)`` / ``drop(c)`` say which leases it renews (``held()``);
    ``lost(c)`` tells whether ``c``'s lease was found taken over."""

    def __init__(self, db: Database, worker: WorkerSettings):
        self.db, self.lease, self.every = db, worker.lease_seconds, worker.heartbeat_seconds
        self._held: dict[int, Claim] = {}
        self._lost: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, c: Claim) -> None:
        with self._lock:
            self._held[c.chunk_id] = c
            self._lost.discard(c.chunk_id)

    def drop(self, c: Claim) -> None:
        with self._lock:
            self._held.pop(c.chunk_id, None)

    def held(self) -> list[Claim]:
        """The claims whose leases it renews now."""
        with self._lock:
            return list(self._held.values())

    def lost(self, c: Claim) -> bool:
        with self._lock:
            return c.chunk_id in self._lost

    def beat(self) -> None:
        """Renew every lease held now (one transaction)."""
        with self._lock:
            held = [c for c in self._held.values() if c.chunk_id not in self._lost]
        if not held:
            return
        renewed = renew_leases(self.db, held, self.lease)
        with self._lock:
            for c in held:
                if c.chunk_id not in renewed and c.chunk_id in self._held:
                    logger.warning("lease on chunk {} was lost", c.chunk_id)
                    self._lost.add(c.chunk_id)

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.beat()
            except Exception as e:  # a ledger hiccup must not kill the worker; the next beat retries
                logger.warning("heartbeat for chunk(s) {} failed: {}", sorted(self._held), e)

    def __enter__(self) -> LeaseKeeper:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None


def say_whose_leases(db: Database, owner: str, reserved_for: int | None, document_ids: Collection[int] | None,
                     said: frozenset[str]) -> frozenset[str]:
    """Say once per wait which other leases hold chunks this worker could take (``said``: the owners named at the
    last look; returns those of this look): a worker that crashed keeps its lease until it expires (up to
    ``lease_seconds``), and without this a restarted ``uflash run`` sits silent."""
    rows = leases_of_others(db, owner, reserved_for, document_ids)
    for other, n, until in rows:
        if other not in said:
            logger.info("waiting for {} chunk(s) leased by {} until {} (in {:.0f} s; a worker that died loses its "
                        "lease then)", n, other, datetime.fromtimestamp(until).strftime("%H:%M:%S"),
                        until - datetime.now().timestamp())
    return frozenset(other for other, _, _ in rows)
