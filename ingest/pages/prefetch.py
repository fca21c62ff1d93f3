"""A thread that prepares claimed chunks while the engine decodes others, so that page preparation never stalls the
GPU. For each chunk it reads what the ledger holds and checks the original (ingest.pages.prepare.locate), then has
its pages rendered, measured and made into the model's inputs: by the page-preparation processes when the worker has
them (ingest.pages.pool: several chunks at once, on other cores), else here, one chunk at a time
(``prepare_pages``; the model's inputs are then built when the chunk is submitted).

``put(claim)`` hands it a claimed chunk; ``take(wait)`` returns what is ready: a ``PreparedChunk``, an ``Unreadable``
or a ``NotPrepared`` (an error while preparing it, e.g. the ledger or a share in trouble: the worker gives that chunk
back). ``pending`` counts the chunks handed over and not yet taken back; ``ahead`` is how many chunks are worth
preparing beyond the decoder's free rows. Leaving ``with prefetch:`` stops the thread, forgets the chunks the
processes still prepare, and returns through ``left()`` the claims it never got to (the worker gives them back).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any

from db.queue import Claim
from db.session import Database
from ingest.config import Settings
from ingest.pages.pool import PoolBroken, PreparationDied, PreparePool
from ingest.pages.prepare import Located, PreparedChunk, Unreadable, chunk_ready, locate, prepare, prepare_pages


@dataclass(frozen=True)
class NotPrepared:
    claim: Claim
    error: BaseException


Prepared = PreparedChunk | Unreadable | NotPrepared


class Prefetcher:
    def __init__(self, settings: Settings, db: Database, pool: PreparePool | None = None):
        self.settings, self.db, self.pool = settings, db, pool
        self._todo: queue.Queue[Claim | Located | None] = queue.Queue()  # Located: back from a broken pool
        self._ready: queue.Queue[Prepared] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.pending = 0  # handed over, not yet taken back
        self._unstarted: list[Claim] = []
        self._lock = threading.Lock()
        self._in_pool: dict[int, tuple[Located, int | None]] = {}  # id(found) -> (found, its job in the pool)

    @property
    def ahead(self) -> int:
        """Chunks worth preparing beyond the decoder's free rows: one for this thread, one a preparation process."""
        return self.pool.processes if self.pool is not None else 1

    def put(self, c: Claim) -> None:
        self.pending += 1
        self._todo.put(c)

    def take(self, wait: float = 0.0) -> list[Prepared]:
        """What is ready now; with ``wait``, up to that many seconds for the first one."""
        out: list[Prepared] = []
        try:
            out.append(self._ready.get(timeout=wait) if wait > 0 else self._ready.get_nowait())
            while True:
                out.append(self._ready.get_nowait())
        except queue.Empty:
            pass
        self.pending -= len(out)
        return out

    def _loop(self) -> None:
        while (item := self._todo.get()) is not None:
            if isinstance(item, Located):  # the pool could not prepare it
                self._here(item)
                continue
            if self.pool is None:
                self._ready.put(self._guarded(item, lambda c=item: prepare(self.settings, self.db, c)))
                continue
            found = self._guarded(item, lambda c=item: locate(self.settings, self.db, c))
            if not isinstance(found, Located):
                self._ready.put(found)
            elif self.pool.broken is not None:
                self._here(found)
            else:
                self._send(found)

    @staticmethod
    def _guarded(c: Claim, work: Any) -> Any:
        try:
            return work()
        except Exception as e:  # noqa: BLE001 - the worker decides what the error means
            return NotPrepared(c, e)

    def _here(self, found: Located) -> None:
        """Prepare the chunk in this thread (no pool, or one that cannot run)."""
        self._ready.put(self._guarded(found.claim, lambda: chunk_ready(found, prepare_pages(found.job))))

    def _send(self, found: Located) -> None:
        key = id(found)
        with self._lock:
            self._in_pool[key] = (found, None)

        def done(result: Any) -> None:  # the pool's thread: hand it over, nothing more
            with self._lock:
                self._in_pool.pop(key, None)
            if isinstance(result, PoolBroken):
                self._todo.put(found)
            elif isinstance(result, PreparationDied):
                self._ready.put(Unreadable(found.claim, found.label, str(result), permanent=False))
            elif isinstance(result, BaseException):
                self._ready.put(NotPrepared(found.claim, result))
            else:
                self._ready.put(chunk_ready(found, result))

        try:
            job = self.pool.submit(found.job, done)
        except RuntimeError:  # the pool is closing
            with self._lock:
                self._in_pool.pop(key, None)
            return self._here(found)
        with self._lock:
            if key in self._in_pool:
                self._in_pool[key] = (found, job)

    def __enter__(self) -> Prefetcher:
        self._thread = threading.Thread(target=self._loop, name="prefetch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._drain()  # the chunks not started are not prepared now: the worker gives them back
        self._todo.put(None)
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.pool is not None:  # those the processes still prepare: forgotten, given back
            with self._lock:
                sent = list(self._in_pool.values())
            cancelled = set(self.pool.cancel([job for _, job in sent if job is not None]))
            self._unstarted += [found.claim for found, job in sent if job in cancelled]
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                item = self._todo.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._unstarted.append(item.claim if isinstance(item, Located) else item)

    def left(self) -> list[Claim]:
        """After leaving ``with``: the claims handed over and never taken back (prepared or not)."""
        claims, self._unstarted = self._unstarted, []
        claims += [p.claim for p in self.take()]
        self.pending = 0
        return claims
