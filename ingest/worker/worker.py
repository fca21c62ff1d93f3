"""The worker: claim chunks as the decoder's rows free up, decode them together, store each chunk's results the moment
it ends, and finish each document whose chunks are all done.

One loop keeps the decoder full (``engine.max_batch`` rows; ingest.worker.inflight: any decoder, batch 1 included, runs
through the same code): it claims a chunk for each free row (and enough ahead to keep page preparation busy), each with
its own lease, all renewed by one heartbeat thread (ingest.ledger.leases); the claimed chunks are prepared while the
engine decodes others (ingest.pages.prefetch: rendered, measured and made into the model's inputs by the
page-preparation processes, ``worker.prepare_processes``, ingest.pages.pool); a prepared chunk whose pages look turned
has them probed (ingest.worker.probes: the probes decode beside the other rows) and is submitted once they are in; each
engine step hands back the chunks that ended, and each is checked by a thread of its own (ingest.worker.checks: page
figures, word confidences, the chunk's checks; caught pages of a multi-page chunk decoded again alone beside the other
rows, ingest.quality.repair), and stored there in its own transaction, so that the loop's thread only decodes
(ingest.worker.outcome says what becomes of it). A document whose chunks are all stored is finished by a thread of its
own (ingest.worker.finish_queue) while the loop steps on. A chunk is stored only while its lease is held (db.chunks): a
worker killed with chunks in flight leaves nothing of them behind, the chunks it stored stay stored, and the others are
redone by whoever takes their leases next. Stopping (SIGTERM) claims nothing more, gives back the chunks not yet
decoding, stores those in flight as they end and finishes their documents. A worker given ``document_ids`` (``uflash run
FILE...``) claims and finishes only those documents; a re-run's worker (``fresh_run``) claims only the chunks reserved
for its run, with the earlier output of the same pages as its draft. ``close()`` (or leaving ``with worker:``) stops the
page-preparation processes and gives the decoder's device memory back.

A worker holds no more chunks than the smallest batch limit among them (db.queue: the chunks of a worker that died
with several in flight are decoded again in smaller groups, and one that died alone is charged an attempt); a claim
returns its chunk's limit, and the worker claims only while there is room under it (db.queue.room_left). It says
loudly whose chunks it took over and what became of them, and puts the originals of documents that failed into
failed/ (ingest.intake.failed).

An error of the ledger or of the machine (ingest.errors.infrastructure_problem: the database gone or locked, a disk
full) fails no chunk and no document: the worker keeps a decoded result and stores it once the ledger takes it, gives
back a chunk it could not go on with (its attempt not counted), and waits with a growing backoff (ingest.ledger.health),
saying so loudly, until the ledger works again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loguru import logger

from db.chunks import LeaseLost, store_chunk
from db.queue import Claim, TakenOver, claim, release, room_left
from db.session import Database
from engine.chunk_decode import ChunkDecoder
from engine.chunk_output import ChunkOutput
from engine.model.files import ModelNotFound
from engine.model.load import ModelLoadError
from ingest.config import Settings
from ingest.errors import ModelUnavailable, infrastructure_problem
from ingest.intake.failed import file_failed
from ingest.ledger.health import Trouble
from ingest.ledger.leases import LeaseKeeper, say_whose_leases
from ingest.ledger.owners import this_process
from ingest.logs import counted
from ingest.pages.inputs import turned_inputs
from ingest.pages.pool import preparation_pool
from ingest.pages.prefetch import NotPrepared, Prefetcher, Prepared
from ingest.pages.prepare import PreparedChunk, Unreadable
from ingest.quality.calibration import grading_thresholds
from ingest.quality.measures import loop_stopper
from ingest.worker import crash_hook
from ingest.worker.checks import ChunkChecks, Repair, RepairKey
from ingest.worker.drafts import chunk_replay
from ingest.worker.finish import Finisher
from ingest.worker.finish_queue import FinishQueue
from ingest.worker.inflight import batched, poll_all
from ingest.worker.lifecycle import RunHandle, take_over_from_the_gone
from ingest.worker.model_files import model_not_found
from ingest.worker.outcome import (
    chunk_note,
    decode_failed,
    is_out_of_memory,
    page_rows,
    requeued_ranges,
    unreadable,
)
from ingest.worker.probes import ProbeKey, Turns, turned_positions


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
    run: RunHandle | None = None  # the run it decodes in (a command's, which took its files in); None: its own

    def __post_init__(self) -> None:
        self.trouble = self.trouble or Trouble(self.settings.logs, "worker")
        self.finisher = Finisher(self.settings, self.db, self.document_ids, self.owner)
        self.finishing = FinishQueue(self.finisher)
        self.checks = ChunkChecks(self.settings, self._store_checked)
        self.repairs: dict[RepairKey, Repair] = {}  # pages the checks decode again alone, decoding now
        self.run = self.run or RunHandle(self.db, self.settings, self.owner, self.fresh_run)
        self.turns = Turns(self.settings)
        self.pool = preparation_pool(self.settings)  # its processes start with the first chunk claimed
        self.leases = LeaseKeeper(self.db, self.settings.worker)
        self.idle = False  # the last look found nothing to claim and nothing in hand
        self.inflight: dict[int, PreparedChunk] = {}  # chunk id -> the chunk decoding now
        self._ready: list[Prepared] = []  # chunks the prefetch thread made ready, waiting for a free row
        self._decoder: Any = None
        self._load_failed: ModelUnavailable | None = None
        self._unsettled: list[Claim] = []  # chunks whose handling the ledger's trouble cut short: given back
        self._stop: threading.Event | None = None
        self._waiting_on: frozenset[str] = frozenset()  # owners of the leases the last idle poll found (logged once)
        self._next_look = 0.0  # while chunks decode, the queue found empty is looked at again from then on

    def decoder(self) -> Any:
        if self._decoder is None:
            if self._load_failed is not None:  # met while loading ahead: said now, and tried again next time
                e, self._load_failed = self._load_failed, None
                raise e
            try:
                self._decoder = batched(self.make_decoder())
            except ModelNotFound as e:
                raise model_not_found(self.settings, e) from None
            except ModelLoadError as e:
                raise ModelUnavailable(str(e)) from None
        return self._decoder

    def run_id(self) -> int:
        return self.run.open(self.decoder)

    def close_run(self) -> int | None:
        """Close the run, if one is open (its id; None: none was open); a re-run stopped before its end rewrites the
        outputs of the documents it re-decoded pages of."""
        run_id, docs = self.run.close()
        if run_id is not None:
            self.finisher.rewrite_after_rerun(run_id, docs)
        return run_id

    def close(self) -> None:
        """Stop the page-preparation processes and give the decoder's device memory back (a later ``serve`` starts
        them again and loads the model again)."""
        if self.pool is not None:
            self.pool.close()
        if self._decoder is not None:
            close = getattr(self._decoder, "close", None)  # a decoder made by a test may have none
            if close is not None:
                close()
            self._decoder = None

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loop --------------------------------------------------------------------------------
    def serve(self, stop: threading.Event, until: Callable[[], bool] | None = None) -> None:
        """Claim and run chunks until ``stop`` is set (then the chunks in flight are finished) or ``until()`` says the
        wanted work is done. Trouble with the ledger or the machine is waited out with a growing backoff."""
        self._stop, first = stop, True
        prefetch = Prefetcher(self.settings, self.db, self.pool)
        self.finishing, self.repairs = FinishQueue(self.finisher), {}
        self.checks = ChunkChecks(self.settings, self._store_checked)
        try:
            with self.leases, prefetch, self.finishing, self.checks:
                while not (stop.is_set() and not self.inflight and not self.checks.busy):
                    try:
                        self._give_back(self._unsettled)
                        self.finishing.check()
                        if first:
                            self.finishing.finish_ready()
                            first = False
                        if until is not None and not (self.inflight or self.checks.busy or prefetch.pending or
                                                      self._ready) and until():
                            self.trouble.ok()  # (``until`` read the ledger: it works)
                            break
                        self._step(stop, prefetch)
                        if not (self.trouble.active and self.checks.busy):  # (a store may be retrying: it says so)
                            self.trouble.ok()
                    except Exception as e:
                        if (problem := infrastructure_problem(e)) is None:
                            raise
                        stop.wait(self.trouble.failed(problem))
            self._finishing_trouble()
        finally:
            self._give_back(prefetch.left() + [r.claim for r in self._ready] + self._unsettled + self.checks.left())
            self._ready, self.repairs = [], {}

    def _finishing_trouble(self) -> None:
        """An error of the finishes made on the way out: the machine's trouble is said (the document is finished at
        the next start), anything else is raised."""
        try:
            self.finishing.check()
        except Exception as e:
            if (problem := infrastructure_problem(e)) is None:
                raise
            self.trouble.failed(problem)

    def _give_back(self, claims: list[Claim]) -> None:
        while claims:
            c = claims[-1]
            if release(self.db, c):
                logger.info("chunk {} given back to the queue: it is decoded again", c.chunk_id)
            self.leases.drop(c)
            claims.pop()

    def _step(self, stop: threading.Event, prefetch: Prefetcher) -> None:
        """One turn: claim for the free rows, submit what is rendered, one engine step (or wait a poll when idle)."""
        found = self._claim_ahead(prefetch) if not stop.is_set() else 0
        if self._decoder is None and prefetch.pending and not self._ready and not stop.is_set():
            self._load_ahead()
        self._ready += prefetch.take(wait=0.0 if self.inflight or self._ready else 0.05)
        if stop.is_set():  # nothing more starts: given back at the next turn
            self._unsettled += [r.claim for r in self._ready]
            self._ready = []
        while self._ready and (not self.inflight or self.decoder().free_rows > 0):
            self._start(self._ready.pop(0), stop)
        self._start_repairs()
        if self.inflight or self.repairs:
            ended = []
            for key, out in poll_all(self.decoder()):
                if isinstance(key, RepairKey):  # a page the checks decode again alone
                    self.checks.resolve(self.repairs.pop(key), out)
                    continue
                if isinstance(key, ProbeKey):  # a chunk's probe: once its chunk's are all in, the chunk goes on
                    key, out = self._probed(key, out)
                if key in self.inflight and out is not None:
                    ended.append((self.inflight.pop(key), out))
            for i, (chunk, out) in enumerate(ended):
                try:
                    self._ended(chunk, out)
                except Exception:  # the ledger's trouble: the chunks after it are given back
                    self._unsettled += [later.claim for later, _ in ended[i + 1:]]
                    raise
        self._settle_checked()
        if self.inflight or self.repairs:
            return
        if self.checks.busy:  # only chunks being checked: their checks are waited for a moment
            return self.checks.wait(self.settings.worker.poll_seconds)
        self.idle = not found and not prefetch.pending and not self._ready
        if self.idle:
            self._log_leased()
            if self.finishing.busy:  # a document being finished: looked at again as soon as it is
                self.finishing.wait(self.settings.worker.poll_seconds)
                return
            self.finishing.finish_ready()
            self._file_failed()
            stop.wait(self.settings.worker.poll_seconds)

    def _start_repairs(self) -> None:
        """Submit the pages the checks asked to decode again alone, beside the other rows."""
        cap, limit = self.settings.engine.max_tokens_per_page, self.settings.engine.context_limit
        for r in self.checks.repairs():
            self.repairs[r.key] = r
            try:
                early = self.decoder().submit(r.key, r.images, limit, cap, reference_texts=r.references,
                                              replay_ids=r.replay_ids)
            except Exception as e:  # its admission failed: the check that asked meets the error, as it did before
                early = e
            if early is not None:
                self.checks.resolve(self.repairs.pop(r.key), early)

    def _store_checked(self, chunk: PreparedChunk, out: ChunkOutput, stats: list[dict[str, Any]]) -> None:
        """On the checks' thread: store a checked chunk."""
        self.leases.drop(chunk.claim)  # (a lease taken over meanwhile: the store finds it gone and stores nothing)
        self._store(chunk, out, stats)

    def _settle_checked(self) -> None:
        """Settle the chunks the checks' thread stored; its error is raised here (that chunk and later ones back)."""
        checked = self.checks.take()
        for i, (chunk, _, error) in enumerate(checked):
            c = chunk.claim
            if error is not None:
                self._unsettled += [c] + [later.claim for later, _, _ in checked[i + 1:]]
                raise error
            self.leases.drop(c)
            self._file_failed([c.document_id])  # failed now, or by an earlier chunk once this one is settled

    def _load_ahead(self) -> None:
        """Load the model while the first chunks claimed are prepared (and their preparation processes start), not
        after. A model that cannot be loaded is said when the first chunk starts (its chunk records the reason)."""
        try:
            self.decoder()
        except ModelUnavailable as e:
            self._load_failed = e

    def _log_leased(self) -> None:
        self._waiting_on = say_whose_leases(self.db, self.owner, self.run.reserved(), self.document_ids,
                                            self._waiting_on)

    def _claim_ahead(self, prefetch: Prefetcher) -> int:
        """Claim a chunk for each row the decoder has free, and ``prefetch.ahead`` more (one a preparation process,
        at most one a row), so that a row that frees is filled at once, as far as the batch limits of the chunks in
        hand allow (db.queue); hand each to the prefetch thread."""
        w, d = self.settings.worker, self._decoder
        rows, ahead = (d.free_rows, min(prefetch.ahead, d.rows)) if d is not None else (1, prefetch.ahead)
        room, found = self._room(rows + ahead - prefetch.pending - len(self._ready)), 0
        if room > 0 and self.inflight and time.monotonic() < self._next_look:
            return 0  # the queue was empty a moment ago: the engine steps on without asking the ledger every step
        if room > 0:
            take_over_from_the_gone(self.settings, self.db, self.finishing)
        while room > 0:
            c = claim(self.db, self.owner, w.lease_seconds, w.max_attempts, document_ids=self.document_ids,
                      run_id=self.run_id() if self.fresh_run is not None else None, on_takeover=self._taken_over)
            if c is None:
                self._next_look = time.monotonic() + w.poll_seconds
                break
            self.leases.hold(c)
            prefetch.put(c)
            room, found, self._waiting_on = self._room(room - 1), found + 1, frozenset()
        return found

    def _room(self, room: int) -> int:
        """``room``, or less when a chunk in hand limits how many this worker may hold (db.queue)."""
        left = room_left(self.leases.held())
        return room if left is None else min(room, left)

    def _taken_over(self, t: TakenOver) -> None:
        """Say what became of the chunks of a worker that died (db.queue's crash rule); file away what failed."""
        what = ", ".join(f"document {d} pages {a}-{b}" for _, d, a, b in t.chunks)
        if not t.charged:
            logger.warning("took over {} chunk(s) of {}, which died with them in flight: {}; not counted as attempts, "
                           "decoded again at most {} at a time", len(t.chunks), t.owner, what, t.batch_limit)
        elif t.failed:
            logger.error("{} failed: {}", what, t.reason)
            self._file_failed([d for _, d, _, _ in t.chunks])
        else:
            logger.warning("took over {} of {}, which died while decoding it alone: {}", what, t.owner, t.reason)

    def _file_failed(self, doc_ids: list[int] | None = None) -> None:
        """The originals of this worker's documents that failed (of ``doc_ids``) go to failed/."""
        if doc_ids is not None and self.document_ids is not None:
            doc_ids = [d for d in doc_ids if d in self.document_ids]
        file_failed(self.settings, self.db, self.document_ids if doc_ids is None else doc_ids)

    def _start(self, ready: Prepared, stop: threading.Event) -> None:
        """A chunk the prefetch thread made ready: submitted, or its pages that look turned probed first (or failed,
        or given back)."""
        c = ready.claim
        if isinstance(ready, NotPrepared) or stop.is_set():  # given back at the next turn (or on leaving)
            self._unsettled.append(c)
            if isinstance(ready, NotPrepared):
                raise ready.error
            return
        if isinstance(ready, Unreadable):
            self.leases.drop(c)
            unreadable(self.settings, self.db, ready)
            return self._file_failed([c.document_id])
        try:
            decoder = self.decoder()
            self.run_id()
        except ModelUnavailable as e:
            self.leases.drop(c)
            release(self.db, c, reason=f"model unavailable: {e}")
            raise
        logger.info("decoding {} (attempt {})", ready.label, c.attempts)
        self.inflight[c.chunk_id] = ready
        try:
            early = None if self.turns.start(decoder, ready) else self._submit(ready)
        except Exception as e:  # the chunk's own failure (a probe or its admission), unless the ledger's
            early = e
        if early is not None:
            self._ended(self.inflight.pop(c.chunk_id), early)

    def _submit(self, chunk: PreparedChunk) -> ChunkOutput | None:
        """Submit the chunk (its pages turned as the probes chose): None, or its output when it cannot be decoded."""
        cap, limit = self.settings.engine.max_tokens_per_page, self.settings.engine.context_limit
        inputs = turned_inputs(chunk.inputs, chunk.probe_inputs, turned_positions(chunk))
        crash_hook.before_decode(chunk.label, [p.text_layer for p in chunk.pages])  # test-only; unset: nothing
        decoder = self.decoder()
        tokenizer = getattr(getattr(decoder, "loaded", None), "tokenizer", None)
        return decoder.submit(chunk.claim.chunk_id, [p.image for p in chunk.pages], limit,
                              cap * len(chunk.pages) if cap else None, reference_texts=chunk.references,
                              replay_ids=chunk_replay(chunk, tokenizer), inputs=inputs)

    def _probed(self, key: ProbeKey, out: ChunkOutput | BaseException) -> tuple[int, ChunkOutput | BaseException |
                                                                               None]:
        """A probe that ended: (its chunk's id, the chunk's end) when the chunk ends here (a probe failed, or it
        cannot be submitted), (its chunk's id, None) while it waits or decodes."""
        probed = self.turns.ended(key, out)
        if probed is None:
            return key.chunk_id, None
        chunk, error = probed
        if error is not None:
            return key.chunk_id, error
        try:
            return key.chunk_id, self._submit(chunk)
        except Exception as e:  # its admission: the chunk's own failure
            return key.chunk_id, e

    def _ended(self, chunk: PreparedChunk, out: ChunkOutput | BaseException) -> None:
        """A chunk whose decode ended: checked and stored, or split, retried or failed (ingest.worker.outcome)."""
        c, decoder = chunk.claim, self.decoder()
        self._unsettled.append(c)  # until settled: the ledger's trouble half-way gives it back
        if isinstance(out, BaseException):
            if infrastructure_problem(out):  # e.g. the ledger failed while probing: no attempt is spent on it
                raise out
            if is_out_of_memory(out):
                decoder.free_memory()
            self.leases.drop(c)  # the heartbeat stops before the write that ends the lease
            decode_failed(self.settings, self.db, c, chunk.label, out, decoder.device, self.run.reserved())
        elif self.leases.lost(c):
            logger.warning("{}: lease lost while decoding; dropping the result", chunk.label)
        else:  # checked by the checks' thread, then stored (``_settle_checked``), its lease held meanwhile
            self._unsettled.remove(c)
            return self.checks.put(chunk, out, getattr(getattr(decoder, "loaded", None), "tokenizer", None))
        self._unsettled.remove(c)
        self.leases.drop(c)
        self._file_failed([c.document_id])  # failed now, or by an earlier chunk once this one is settled

    def _store(self, chunk: PreparedChunk, out: ChunkOutput, stats: list[dict[str, Any]]) -> None:
        """Store the decoded chunk; while the ledger is in trouble the result is kept, and stored once it works."""
        c, decoder = chunk.claim, self.decoder()
        rows = page_rows(chunk, out, stats, decoder.mode)
        ranges = requeued_ranges(c, out)
        note = chunk_note(out, ranges)
        try:
            ready = self.trouble.retrying(f"cannot store {chunk.label}", self._stop, lambda: store_chunk(
                self.db, c, self.run_id(), rows, new_ranges=ranges, note=note, stats=out.chunk_stats,
                output_ids=out.output_ids, reserved_for=self.run.reserved()))
        except LeaseLost:  # taken over by another worker (or stored by this one before the ledger failed)
            return logger.warning("{}: lease lost before storing; dropping the result", chunk.label)
        self.trouble.ok()
        s = out.chunk_stats
        logger.info("{}: {}, {} tokens in {:.1f}s ({:.1f} tok/s), finish {}{}", chunk.label, counted(len(rows), "page"),
                    s.get("output_tokens", 0), s.get("seconds", 0.0), s.get("tokens_per_second", 0.0),
                    out.finish_reason, f"; {note}" if note else "")
        if self.on_pages:
            self.on_pages(len(rows))
        if ready:
            self.finishing.finish(c.document_id)


def make_worker(settings: Settings, db: Database, **kw: Any) -> Worker:
    """A worker that loads the configured model and engine (``[engine]``) on ``model.device`` when it needs it."""

    def load() -> ChunkDecoder:
        from engine.loading import load_decoder

        m, e = settings.model, settings.engine
        if m.device.startswith("cuda:"):  # one worker per GPU: this process's CUDA work goes to its card
            import torch

            torch.cuda.set_device(m.device)
        return load_decoder(settings.model_path, m.device, m.dtype, e.mode, e.fast_threshold, max_batch=e.max_batch,
                            kernels=e.kernels, max_pages_per_chunk=e.max_pages_per_chunk,
                            loop_check=loop_stopper(grading_thresholds(settings).thresholds),
                            **e.model_dump(include={"vision_attention", "vision_ahead", "kernel_tiles"}))

    return Worker(settings, db, load, **kw)
