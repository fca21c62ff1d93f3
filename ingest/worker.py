"""The worker: claim a chunk, decode it, store what it gives, and finish each document whose chunks are all done.

Results and the chunk's completion commit in one transaction, and only while the lease is still held (db.chunks): a
worker killed mid-chunk leaves nothing behind, and the chunk is redone by whoever takes the lease next. A worker
given ``document_ids`` (``uflash run FILE...``) claims and finishes only those documents; a re-run's worker
(``fresh_run``) claims only the chunks reserved for its run, with the earlier output of the same pages as its draft.

An error of the ledger or of the machine (ingest.errors.infrastructure_problem: the database gone or locked, a disk
full) fails no chunk and no document: the worker keeps its decoded result and stores it once the ledger takes it (the
lease decides, as always, that it is stored once), gives back a chunk it could not go on with (its attempt not
counted), and waits with a growing backoff (ingest.health), saying so loudly, until the ledger works again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from loguru import logger

from db.chunks import LeaseLost, store_chunk
from db.queue import Claim, claim, leases_of_others, release
from db.session import Database
from engine.chunk_decode import ChunkDecoder, ChunkOutput
from engine.model import ModelLoadError, ModelNotFound
from ingest.config import Settings
from ingest.errors import ModelUnavailable, infrastructure_problem
from ingest.finish import Finisher
from ingest.health import Trouble
from ingest.leases import LeaseKeeper
from ingest.lifecycle import RunHandle, take_over_from_the_gone
from ingest.outcome import (checked_stats, chunk_note, decode_failed, is_out_of_memory, page_rows, requeued_ranges,
                            unreadable)
from ingest.owners import this_process
from ingest.prepare import PreparedChunk, Turns, Unreadable, prepare


@dataclass
class Worker:
    settings: Settings
    db: Database
    make_decoder: Callable[[], ChunkDecoder]
    owner: str = field(default_factory=this_process)
    on_pages: Callable[[int], None] | None = None  # progress: pages stored
    fresh_run: dict[str, Any] | None = None  # a re-run: its run records these settings; its own chunks only
    document_ids: frozenset[int] | None = None  # only these documents' chunks (uflash run FILE...); None: any
    trouble: Trouble | None = None  # the ledger's or the machine's trouble, if any (made from the settings)

    def __post_init__(self) -> None:
        self.trouble = self.trouble or Trouble(self.settings.logs, "worker")
        self.finisher = Finisher(self.settings, self.db, self.document_ids)
        self.run = RunHandle(self.db, self.owner, self.decoder, self.finisher, self.fresh_run)
        self.turns = Turns(self.settings)
        self.leases = LeaseKeeper(self.db, self.settings.worker)
        self.idle = False  # the last look found nothing to claim and nothing in hand
        self._decoder: ChunkDecoder | None = None
        self._held: Claim | None = None  # the chunk in hand, while it is processed
        self._stop: threading.Event | None = None
        self._waiting_on: frozenset[str] = frozenset()  # owners of the leases the last idle poll found (logged once)

    def decoder(self) -> ChunkDecoder:
        if self._decoder is None:
            try:
                self._decoder = self.make_decoder()
            except (ModelNotFound, ModelLoadError) as e:
                raise ModelUnavailable(str(e)) from None
        return self._decoder

    def run_id(self) -> int:
        return self.run.open()

    def close_run(self) -> int | None:
        return self.run.close()

    # -- the loop --------------------------------------------------------------------------------
    def serve(self, stop: threading.Event, until: Callable[[], bool] | None = None) -> None:
        """Claim and run chunks until ``stop`` is set (or ``until()`` says the wanted work is done). Trouble with the
        ledger or the machine is waited out with a growing backoff; the chunk in hand then is given back (not
        counted as an attempt) once the ledger works again, unless it was stored."""
        self._stop, first = stop, True
        with self.leases:
            while not stop.is_set():
                try:
                    if self._held is not None and release(self.db, self._held):  # left in hand by the trouble
                        logger.info("chunk {} given back to the queue: it is decoded again", self._held.chunk_id)
                    self._held = None
                    if first:
                        self.finisher.finish_ready()
                        first = False
                    if until is not None and until():
                        return
                    self._step(stop)
                    self.trouble.ok()
                except Exception as e:
                    if (problem := infrastructure_problem(e)) is None:
                        raise
                    stop.wait(self.trouble.failed(problem))

    def _step(self, stop: threading.Event) -> None:
        """One turn of the loop: claim and process a chunk, or wait a poll."""
        w = self.settings.worker
        take_over_from_the_gone(self.settings, self.db, self.finisher)
        c = claim(self.db, self.owner, w.lease_seconds, w.max_attempts, document_ids=self.document_ids,
                  run_id=self.run_id() if self.fresh_run is not None else None)
        self.idle = c is None
        if c is None:
            self._log_leased()
            self.finisher.finish_ready()
            stop.wait(w.poll_seconds)
            return
        self._waiting_on, self._held = frozenset(), c
        self.process(c)
        self._held = None

    def _log_leased(self) -> None:
        """Say once per wait which other leases hold chunks this worker could take: a worker that crashed keeps its
        lease until it expires (up to ``lease_seconds``), and without this a restarted ``uflash run`` sits silent."""
        rows = leases_of_others(self.db, self.owner, self.run.reserved(), self.document_ids)
        for owner, n, until in rows:
            if owner not in self._waiting_on:
                logger.info("waiting for {} chunk(s) leased by {} until {} (in {:.0f} s; a worker that died loses "
                            "its lease then)", n, owner, datetime.fromtimestamp(until).strftime("%H:%M:%S"),
                            until - datetime.now().timestamp())
        self._waiting_on = frozenset(owner for owner, _, _ in rows)

    def process(self, c: Claim) -> None:
        """Decode one claimed chunk and store its pages (or record why it could not be decoded)."""
        try:
            decoder = self.decoder()
            self.run.open()
        except ModelUnavailable as e:
            release(self.db, c, reason=f"model unavailable: {e}")
            raise
        chunk = prepare(self.settings, self.db, c)
        if isinstance(chunk, Unreadable):
            return unreadable(self.settings, self.db, chunk)
        logger.info("decoding {} (attempt {})", chunk.label, c.attempts)
        with self.leases.holding(c):
            try:
                self.turns.turn_upright(decoder, chunk)
                cap = self.settings.engine.max_tokens_per_page
                limit = self.settings.engine.context_limit
                out = decoder.decode([p.image for p in chunk.pages], context_limit=limit,
                                     max_new_tokens=cap * len(chunk.pages) if cap else None,
                                     reference_texts=chunk.references, replay_ids=chunk.replay)
                stats = checked_stats(self.settings, chunk, out, _tokenizer(decoder), lambda images, refs: decoder.decode(
                    images, context_limit=limit, max_new_tokens=cap, reference_texts=refs))
            except Exception as e:
                if infrastructure_problem(e):  # e.g. the ledger failed while probing: no attempt is spent on it
                    raise
                if is_out_of_memory(e):
                    decoder.free_memory()
                return decode_failed(self.settings, self.db, c, chunk.label, e, decoder.device, self.run.reserved())
        if self.leases.lost(c):
            return logger.warning("{}: lease lost while decoding; dropping the result", chunk.label)
        self._store(chunk, out, stats)

    def _store(self, chunk: PreparedChunk, out: ChunkOutput, stats: list[dict[str, Any]]) -> None:
        """Store the decoded chunk; while the ledger is in trouble the result is kept, and stored once it works."""
        c, decoder = chunk.claim, self.decoder()
        rows = page_rows(chunk, out, stats, decoder.mode)
        ranges = requeued_ranges(c, out)
        note = chunk_note(out, ranges)
        while True:
            try:
                ready = store_chunk(self.db, c, self.run.open(), rows, new_ranges=ranges, note=note,
                                    stats=out.chunk_stats, output_ids=out.output_ids, reserved_for=self.run.reserved())
                break
            except LeaseLost:  # taken over by another worker (or stored by this one before the ledger failed)
                return logger.warning("{}: lease lost before storing; dropping the result", chunk.label)
            except Exception as e:
                problem = infrastructure_problem(e)
                if problem is None or self._stop is None or self._stop.is_set():
                    raise
                if self._stop.wait(self.trouble.failed(f"cannot store {chunk.label}: {problem}")):
                    raise
        self.trouble.ok()
        s = out.chunk_stats
        logger.info("{}: {} pages, {} tokens in {:.1f}s ({:.1f} tok/s), finish {}{}", chunk.label, len(rows),
                    s.get("output_tokens", 0), s.get("seconds", 0.0), s.get("tokens_per_second", 0.0),
                    out.finish_reason, f"; {note}" if note else "")
        if self.on_pages:
            self.on_pages(len(rows))
        if ready:
            self.finisher.finish(c.document_id)


def _tokenizer(decoder: ChunkDecoder) -> Any:
    return getattr(getattr(decoder, "loaded", None), "tokenizer", None)


def make_worker(settings: Settings, db: Database, **kw: Any) -> Worker:
    """A worker that loads the configured model in the configured mode when it first needs it."""
    from engine.chunk_decode import load_decoder

    m, e = settings.model, settings.engine
    return Worker(settings, db, lambda: load_decoder(settings.model_path, m.device, m.dtype, e.mode, e.fast_threshold,
                                                     max_pages_per_chunk=e.max_pages_per_chunk), **kw)
