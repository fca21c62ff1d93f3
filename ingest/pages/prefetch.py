"""A thread that prepares claimed chunks (ingest.pages.prepare: the original checked, its pages rendered, the drafts
read) while the engine decodes others, so that rendering never stalls the GPU.

``put(claim)`` hands it a claimed chunk; ``take(wait)`` returns what is ready: a ``PreparedChunk``, an ``Unreadable``
or a ``NotPrepared`` (an error while preparing it, e.g. the ledger or a share in trouble: the worker gives that chunk
back). ``pending`` counts the chunks handed over and not yet taken back. Leaving ``with prefetch:`` stops the thread
and returns, through ``left()``, the claims it never got to (the worker gives them back to the queue).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

from db.queue import Claim
from db.session import Database
from ingest.config import Settings
from ingest.pages.prepare import PreparedChunk, Unreadable, prepare


@dataclass(frozen=True)
class NotPrepared:
    claim: Claim
    error: BaseException


Prepared = PreparedChunk | Unreadable | NotPrepared


class Prefetcher:
    def __init__(self, settings: Settings, db: Database):
        self.settings, self.db = settings, db
        self._todo: queue.Queue[Claim | None] = queue.Queue()
        self._ready: queue.Queue[Prepared] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.pending = 0  # handed over, not yet taken back
        self._unstarted: list[Claim] = []

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
        while (c := self._todo.get()) is not None:
            try:
                self._ready.put(prepare(self.settings, self.db, c))
            except Exception as e:  # noqa: BLE001 - the worker decides what the error means
                self._ready.put(NotPrepared(c, e))

    def __enter__(self) -> Prefetcher:
        self._thread = threading.Thread(target=self._loop, name="prefetch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        while True:  # the chunks not started are not prepared now: the worker gives them back
            try:
                c = self._todo.get_nowait()
            except queue.Empty:
                break
            if c is not None:
                self._unstarted.append(c)
        self._todo.put(None)
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def left(self) -> list[Claim]:
        """After leaving ``with``: the claims handed over and never taken back (prepared or not)."""
        claims, self._unstarted = self._unstarted, []
        claims += [p.claim for p in self.take()]
        self.pending = 0
        return claims
