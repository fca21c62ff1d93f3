"""Checking and storing decoded chunks beside the decode loop: a thread of the worker computes each ended chunk's
page stats (ingest.worker.outcome.checked_stats: its figures, word confidences, the chunk's checks, and the repair of
the pages those checks catch) and stores it (``store``: the worker's one function that writes a chunk's pages), so
that the loop's thread does nothing but decoding and its claims.

The loop hands a chunk over (``put``) and takes it back settled (``take``: the chunk, its output and None once
stored, or the error the check or the store met, which the loop raises as it always did). A repair decodes
a page again alone on the same decoder, which only the loop's thread drives: the check asks for it
(``decode_alone``, which waits), the loop submits it beside its other rows (``repairs``) and hands the output back
(``resolve``) when the engine ends it. A chunk is still the worker's while it is checked: its lease is held by the
heartbeat, and the worker gives it back (``left``) when it leaves with chunks still being checked.

The checks are Python and hold the interpreter's lock while they run: while the thread lives, the interpreter's switch
interval is ``SWITCH_INTERVAL`` (its default is 5 ms), so that the loop's thread, back from waiting on the GPU, gets
the lock back within a fraction of a decode step.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from db.queue import Claim
from engine.chunk_output import ChunkOutput
from ingest.config import Settings
from ingest.pages.prepare import PreparedChunk
from ingest.worker.outcome import checked_stats

THREAD_NAME = "checks"
SWITCH_INTERVAL = 0.0005  # seconds a thread may hold the interpreter's lock while another waits for it


class WorkerStopped(RuntimeError):
    """A repair asked for after the worker left its loop (the chunk is given back, not failed)."""


@dataclass(frozen=True)
class RepairKey:
    """The key of a page decoded again alone, among the decoder's keys (a chunk's id, a probe's key)."""
    serial: int


@dataclass
class Repair:
    """One page to decode alone: ``decoder.submit(key, images, ...)``'s arguments; ``future`` gets its output."""
    key: RepairKey
    images: list
    references: list[str]
    replay_ids: list[int] | None
    future: Future = field(default_factory=Future)


Checked = tuple[PreparedChunk, ChunkOutput, "BaseException | None"]
Store = Callable[[PreparedChunk, ChunkOutput, "list[dict[str, Any]]"], None]


class ChunkChecks:
    def __init__(self, settings: Settings, store: Store):
        self.settings, self.store = settings, store
        self._todo: deque[tuple[PreparedChunk, ChunkOutput, Any]] = deque()
        self._running: PreparedChunk | None = None
        self._done: list[Checked] = []
        self._repairs: deque[Repair] = deque()  # asked for, not yet handed to the loop
        self._unresolved: dict[RepairKey, Repair] = {}  # asked for, no output yet
        self._cond = threading.Condition()
        self._serial = count()
        self._closing = False
        self._thread: threading.Thread | None = None

    # -- the loop's side ------------------------------------------------------------------------------
    def put(self, chunk: PreparedChunk, out: ChunkOutput, tokenizer: Any) -> None:
        """Check this ended chunk (its lease still held)."""
        with self._cond:
            self._todo.append((chunk, out, tokenizer))
            self._cond.notify_all()

    def take(self) -> list[Checked]:
        """The chunks checked and stored (or not: their error) since the last call, in the order they were handed
        over."""
        with self._cond:
            done, self._done = self._done, []
        return done

    def repairs(self) -> list[Repair]:
        """The pages the checks asked to decode alone since the last call."""
        with self._cond:
            asked, self._repairs = list(self._repairs), deque()
        return asked

    def resolve(self, repair: Repair, out: ChunkOutput | BaseException) -> None:
        """Hand a repair's output (or the error its decode met) to the check that waits for it."""
        with self._cond:
            if self._unresolved.pop(repair.key, None) is None:  # failed already (the worker left)
                return
        if isinstance(out, BaseException):
            repair.future.set_exception(out)
        else:
            repair.future.set_result(out)

    @property
    def busy(self) -> bool:
        """Chunks handed over and not yet taken back."""
        with self._cond:
            return bool(self._todo or self._running is not None or self._done)

    def wait(self, timeout: float) -> None:
        """Until a chunk is checked, a repair is asked for, or ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: self._done or self._repairs or not (self._todo or self._running), timeout)

    def left(self) -> list[Claim]:
        """The claims of the chunks handed over and not stored (the worker gives them back when it leaves)."""
        with self._cond:
            chunks = [c for c, _, _ in self._todo] + [c for c, _, e in self._done if e is not None] + \
                ([self._running] if self._running is not None else [])
            self._todo.clear()
            self._done = []
        return [c.claim for c in chunks]

    # -- the thread ----------------------------------------------------------------------------------
    def decode_alone(self, images: list, references: list[str], replay_ids: list[int] | None) -> ChunkOutput:
        """On the checking thread: the loop decodes these page(s) alone; their output (or the decode's error)."""
        repair = Repair(RepairKey(next(self._serial)), images, references, replay_ids)
        with self._cond:
            if self._closing:
                raise WorkerStopped("the worker stopped before a page could be decoded again alone")
            self._repairs.append(repair)
            self._unresolved[repair.key] = repair
            self._cond.notify_all()
        return repair.future.result()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._todo or self._closing)
                if self._closing:
                    return
                chunk, out, tokenizer = self._todo.popleft()
                self._running = chunk
            result: BaseException | None = None
            try:
                self.store(chunk, out, checked_stats(self.settings, chunk, out, tokenizer, self.decode_alone))
            except Exception as e:  # noqa: BLE001 - handed to the loop's thread, which raises it as before
                result = e
            with self._cond:
                if self._running is chunk:  # (not given back by ``left`` meanwhile)
                    self._done.append((chunk, out, result))
                self._running = None
                self._cond.notify_all()

    def __enter__(self) -> ChunkChecks:
        self._closing, self._interval = False, sys.getswitchinterval()
        sys.setswitchinterval(min(self._interval, SWITCH_INTERVAL))
        self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._closing = True
            pending, self._unresolved, self._repairs = list(self._unresolved.values()), {}, deque()
            self._cond.notify_all()
        for repair in pending:  # asked for or decoding: the checks waiting for them end (their chunks given back)
            repair.future.set_exception(WorkerStopped("the worker stopped while a page waited to be decoded "
                                                          "again alone"))
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        sys.setswitchinterval(self._interval)
