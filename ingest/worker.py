"""The GPU worker: claim a chunk, render its pages, decode them in one pass, store the pages, and once a
document's chunks are all done write its outputs and archive the original.

Results and the chunk's completion commit in one transaction, and only while the lease is still held: a
worker killed mid-chunk leaves nothing behind, and the chunk is redone by whoever takes the lease next.

Every stored page carries ``stats["quality"]`` (engine.quality.page_quality: finish reason, Distinct-20/35,
log-probabilities, agreement with the PDF text layer) and ``stats["mode"]``; when the document is finished,
each page is graded against its neighbours with the ``[quality]`` thresholds (grade and reasons are written
into the same stats).

Every worker has its own run (one ``uflash run``, one ``uflash watch`` process, one re-run): opened when it decodes
its first chunk, closed (``finished_at``) by ``close_run()`` when the command ends, Ctrl+C and SIGTERM included.
Each page records the run that produced it. A worker killed outright leaves its run open and its chunk leased;
the next worker on the same host finds its process gone (ingest.owners), takes the chunk over at once and
closes the run as crashed (db.runs: chunks still reserved for it are cancelled). Later workers never reuse an
open run. A worker given ``document_ids`` (``uflash run FILE...``)
claims and finishes only those documents. A re-run worker (``fresh_run``) claims only the chunks reserved for
its run (queued with that run_id; chunks it splits off stay reserved), with the earlier output of the same pages
as its draft, and rewrites the document outputs.

An error of the ledger or of the machine (ingest.errors.infrastructure_problem: the database gone or locked, a disk
full) fails no chunk and no document: the worker keeps its decoded result and stores it once the ledger takes it (the
lease decides, as always, that it is stored once), gives back a chunk it could not go on with (its attempt not
counted), and waits with a growing backoff (ingest.health), saying so loudly, until the ledger works again.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from loguru import logger
from sqlalchemy import func, select, true, update

import engine
from db.models import Chunk, ChunkStatus, DocStatus, Document, Page, Run
from db.queue import (Claim, Heartbeat, among, claim, complete, end_leases_of_gone_owners, fail, refresh_document,
                      release)
from db.runs import close_run, close_runs_of_gone_owners
from db.session import Database
from engine.chunk_decode import ChunkDecoder, ChunkOutput
from engine.model import ModelLoadError, ModelNotFound
from ingest.config import Settings
from ingest.errors import InfrastructureError, UflashError, infrastructure_problem
from ingest.files import file_away, sha256_file
from ingest.grading import grade_document, plain_text
from ingest.health import Trouble
from ingest.intake import intake_file
from ingest.orientation import TurnChoice, choose_turn, decoder_probe, turn
from ingest.outputs import holds_another_document, output_folder, write_document_outputs
from ingest.owners import is_gone, this_process
from ingest.render import render_pages
from ingest.repair import chunk_page_stats, repair_chunk


class _LeaseLost(Exception):
    pass


class ModelUnavailable(UflashError):
    """The model cannot be loaded: no chunk can run until the configuration or the files are fixed."""

    exit_code = 3


def _is_oom(e: BaseException) -> bool:
    name = type(e).__name__
    return name == "OutOfMemoryError" or (isinstance(e, RuntimeError) and "out of memory" in str(e).lower())


@dataclass
class Worker:
    settings: Settings
    db: Database
    make_decoder: Callable[[], ChunkDecoder]
    owner: str = field(default_factory=this_process)
    on_pages: Callable[[int], None] | None = None  # progress callback: pages finished
    fresh_run: dict[str, Any] | None = None  # a re-run: its run records these settings; its own chunks only
    document_ids: frozenset[int] | None = None  # only these documents' chunks (uflash run FILE...); None: any
    on_idle: Callable[[], None] | None = None  # called when no chunk can be claimed (after finalizing what is ready)
    _decoder: ChunkDecoder | None = None
    _run_id: int | None = None
    _waiting_on: frozenset[str] = frozenset()  # owners of the leases the last idle poll found (logged once)
    # (document, page) -> the turn chosen for a page that was probed: a chunk cut and re-queued does not probe it again
    _turns: dict[tuple[int, int], TurnChoice] = field(default_factory=dict)
    trouble: Trouble | None = None  # the ledger's or the machine's trouble, if any (made from the settings)
    _held: Claim | None = None  # the chunk in hand, while it is processed
    _stop: threading.Event | None = None  # serve()'s stop event

    def __post_init__(self) -> None:
        if self.trouble is None:
            self.trouble = Trouble(self.settings.logs, "worker")

    # -- model and run ---------------------------------------------------------------------------
    def decoder(self) -> ChunkDecoder:
        if self._decoder is None:
            try:
                self._decoder = self.make_decoder()
            except (ModelNotFound, ModelLoadError) as e:
                raise ModelUnavailable(str(e)) from None
        return self._decoder

    def run_id(self) -> int:
        """This worker's run, opened on first use (loading the model): a new one for every worker, never an
        earlier run left open (a worker that was killed, or another process running now)."""
        if self._run_id is None:
            d = self.decoder()
            with self.db.session() as s, s.begin():
                run = Run(mode=d.mode, model=d.model_name, engine_version=engine.__version__,
                          host=socket.gethostname(), owner=self.owner,
                          settings={**d.describe(), **(self.fresh_run or {})})
                s.add(run)
                s.flush()
                self._run_id = run.id
        return self._run_id

    def close_run(self) -> int | None:
        """Close this worker's run (``finished_at``), if it opened one, and return its id. Work after this
        opens a new run. A re-run stopped before its end cancels the chunks still reserved for it (db.runs) and
        rewrites the outputs of the documents it re-decoded pages of."""
        run_id = self._run_id
        if run_id is not None:
            with self.db.engine.begin() as conn:
                docs = close_run(conn, run_id)
            self._run_id = None  # only once closed: a ledger that failed to close it is asked again
            if docs:
                logger.warning("run {} stopped before it finished: its chunks left in {} document(s) are cancelled; "
                               "`uflash rerun` again picks their pages", run_id, len(docs))
            self._finalize_rerun(run_id, docs)
        return run_id

    def end_what_the_gone_left(self) -> None:
        """Leases and runs of uflash processes on this host that are gone (killed, crashed, the machine rebooted):
        their chunks are taken over now rather than when the lease runs out, and their runs are closed as
        crashed (a re-run's chunks still reserved for it are cancelled, and the documents it re-decoded pages of
        are rewritten). A re-run on another host is known gone once its own chunk has waited on an ended lease
        for longer than a lease (db.runs)."""
        stale_before = time.time() - self.settings.worker.lease_seconds
        for run_id, docs in close_runs_of_gone_owners(self.db, is_gone, stale_before).items():
            logger.warning("run {} was left open by a uflash process that is gone: closed as crashed{}", run_id,
                           f"; its chunks left in {len(docs)} document(s) are cancelled" if docs else "")
            self._finalize_rerun(run_id, docs)
        if n := end_leases_of_gone_owners(self.db, is_gone):
            logger.warning("{} chunk(s) leased by uflash processes that are gone: taken over now", n)

    def _finalize_rerun(self, run_id: int, doc_ids: list[int]) -> None:
        """Rewrite the outputs of the finished documents (of this worker's) that ``run_id`` stored pages of, now that
        the chunks it left were cancelled: the outputs show each page's latest version."""
        mine = [d for d in doc_ids if self.document_ids is None or d in self.document_ids]
        if not mine:
            return
        with self.db.session() as s:
            redone = s.scalars(select(Page.document_id).where(Page.run_id == run_id, among(Page.document_id, mine))
                               .join(Document, Document.id == Page.document_id)
                               .where(Document.status == DocStatus.DONE).distinct()).all()
        for doc_id in redone:
            self._finalize_if_ready(doc_id)

    # -- the loop --------------------------------------------------------------------------------
    def serve(self, stop: threading.Event, until: Callable[[], bool] | None = None) -> None:
        """Claim and run chunks until ``stop`` is set (or ``until()`` says the wanted work is done). Trouble with the
        ledger or the machine is waited out with a growing backoff; the chunk in hand then is given back (not
        counted as an attempt) once the ledger works again, unless it was stored."""
        self._stop = stop
        first = True
        while not stop.is_set():
            try:
                if self._held is not None:  # left in hand by trouble with the ledger
                    if release(self.db, self._held):
                        logger.info("chunk {} given back to the queue: it is decoded again", self._held.chunk_id)
                    self._held = None
                if first:
                    self.finalize_ready()
                    first = False
                if self._step(stop, until):
                    return
                self.trouble.ok()
            except Exception as e:
                problem = infrastructure_problem(e)
                if problem is None:
                    raise
                stop.wait(self.trouble.failed(problem))

    def _step(self, stop: threading.Event, until: Callable[[], bool] | None) -> bool:
        """One turn of the loop: claim and process a chunk, or wait a poll. True when ``until()`` holds."""
        w = self.settings.worker
        if until is not None and until():
            return True
        self.end_what_the_gone_left()
        c = claim(self.db, self.owner, w.lease_seconds, w.max_attempts,
                  run_id=self.run_id() if self.fresh_run is not None else None, document_ids=self.document_ids)
        if c is None:
            self._log_leased()
            self.finalize_ready()
            if self.on_idle is not None:
                self.on_idle()
            self.trouble.ok()
            stop.wait(w.poll_seconds)
            return False
        self._waiting_on = frozenset()
        self._held = c
        self.process(c)
        self._held = None
        return False

    def _log_leased(self) -> None:
        """Say once per wait which other leases hold chunks this worker could take. A worker that crashed keeps
        its lease until it expires (up to ``lease_seconds``): without this line a restarted ``uflash run`` sits
        silent that long, and ``status`` only shows ``running``."""
        now = time.time()
        mine = among(Chunk.document_id, self.document_ids) if self.document_ids is not None else true()
        with self.db.session() as s:
            rows = s.execute(select(Chunk.lease_owner, func.count(), func.max(Chunk.lease_expires_at)).where(
                Chunk.status == ChunkStatus.RUNNING, Chunk.lease_expires_at >= now, Chunk.lease_owner != self.owner,
                Chunk.run_id.is_(None) if self.fresh_run is None else Chunk.run_id == self._run_id, mine,
            ).group_by(Chunk.lease_owner)).all()
        owners = frozenset(owner for owner, _, _ in rows)
        for owner, n, until in rows:
            if owner not in self._waiting_on:
                logger.info("waiting for {} chunk(s) leased by {} until {} (in {:.0f} s; a worker that died loses "
                            "its lease then)", n, owner, datetime.fromtimestamp(until).strftime("%H:%M:%S"),
                            until - now)
        self._waiting_on = owners

    def process(self, c: Claim) -> None:
        w = self.settings.worker
        try:
            decoder = self.decoder()
            run_id = self.run_id()
        except ModelUnavailable as e:
            release(self.db, c, reason=f"model unavailable: {e}")
            raise
        with self.db.session() as s:
            doc = s.get(Document, c.document_id)
        label = f"{doc.original_name} pages {c.first_page}-{c.last_page}"
        path = Path(doc.original_path)
        if doc.archived_path and Path(doc.archived_path).exists():
            path = Path(doc.archived_path)  # a re-run of a finished document reads the archived original
        if not path.exists():
            if not path.parent.is_dir():  # not the file: its folder is not reachable from here (a share not mounted)
                raise InfrastructureError(f"the folder {path.parent} of {doc.original_name} cannot be reached from "
                                          f"this machine (every worker needs the inbox and the archive at the same "
                                          f"path; `uflash check`)")
            fail(self.db, c, f"original file is gone: {path}", w.max_attempts, w.backoff_seconds, permanent=True)
            logger.error("{}: original file is gone ({})", label, path)
            return
        if path == Path(doc.original_path) and not self._still_the_original(c, doc, path, label):
            return
        try:
            pages = render_pages(path, doc.kind, c.first_page, c.last_page,
                                 max_page_pixels=self.settings.watch.max_page_pixels)
        except Exception as e:
            if infrastructure_problem(e):  # the disk or the share, not the file: the chunk goes back, nothing fails
                raise
            fail(self.db, c, f"cannot render: {type(e).__name__}: {e}", w.max_attempts, w.backoff_seconds,
                 permanent=True)
            logger.error("{}: cannot render: {}", label, e)
            return
        logger.info("decoding {} (attempt {})", label, c.attempts)
        try:
            with Heartbeat(self.db, c, w.lease_seconds, w.heartbeat_seconds) as hb:
                turned = self._turn_to_read(decoder, pages, label, c.document_id)
                cap = self.settings.engine.max_tokens_per_page
                references = self._reference_texts(c, pages)
                out = decoder.decode([p.image for p in pages], context_limit=self.settings.engine.context_limit,
                                     max_new_tokens=cap * len(pages) if cap else None,
                                     reference_texts=references, replay_ids=self._replay_ids(c))
                page_stats = self._check_and_repair(decoder, pages, out, references, label)
        except Exception as e:
            self._decode_failed(c, label, e)
            return
        if hb.lost.is_set():
            logger.warning("{}: lease lost while decoding; dropping the result", label)
            return
        self._store(c, run_id, pages, out, label, turned, page_stats)

    def _check_and_repair(self, decoder: ChunkDecoder, pages: list, out: ChunkOutput, references: list[str],
                          label: str) -> list[dict[str, Any]]:
        """Each kept page's stats (ingest.repair); pages caught by the checks are decoded again alone and the better
        reading kept (``quality.repair``, on by default)."""
        thresholds = self.settings.quality.thresholds()
        tokenizer = getattr(getattr(decoder, "loaded", None), "tokenizer", None)
        images, layers = [p.image for p in pages], [p.text_layer for p in pages]
        first = pages[0].index if pages else 1
        stats = chunk_page_stats(out, images, layers, tokenizer, thresholds, first)
        if self.settings.quality.repair:
            cap = self.settings.engine.max_tokens_per_page

            def alone(i: int) -> ChunkOutput:
                return decoder.decode([images[i]], context_limit=self.settings.engine.context_limit,
                                      max_new_tokens=cap, reference_texts=[references[i]])

            for i in repair_chunk(out, stats, images, layers, alone, tokenizer, thresholds, first):
                rec = stats[i].get("repair")
                if rec:
                    logger.info("{}: page {} ({}) decoded again alone; kept the {} reading", label, pages[i].index,
                                ", ".join(rec["why"]), "single-page" if rec["kept"] == "alone" else "chunk's")
        return stats

    def _turn_to_read(self, decoder: ChunkDecoder, pages: list, label: str, doc_id: int) -> dict[int, TurnChoice]:
        """Turn the pages that were scanned sideways or upside down (ingest.orientation) so the chunk's decode reads
        them upright; returns the choice made for each page that was probed, by page index. A page this worker
        probed before (its chunk was cut and re-queued) keeps the turn chosen then."""
        o = self.settings.orientation
        if not o.auto:
            return {}
        config = o.config()
        probe = decoder_probe(decoder, self.settings.engine.context_limit, config.probe_tokens)
        choices = {}
        for page in pages:
            earlier = self._turns.get((doc_id, page.index))
            choice = earlier or choose_turn(page.image, probe, config)
            if choice.scores is None:
                continue
            if earlier is None:
                if len(self._turns) >= 4096:  # a watcher runs for weeks: keep this small
                    self._turns.clear()
                self._turns[(doc_id, page.index)] = choice
            choices[page.index] = choice
            if choice.turn:
                page.image = turn(page.image, choice.turn)
            logger.info("{}: page {} looks {}; probes {}{}: {}", label, page.index, choice.looks,
                        choice.record()["probe_mean_logprob"], " (made before)" if earlier else "",
                        f"turned {choice.turn} degrees clockwise" if choice.turn else "left as it is")
        return choices

    def _still_the_original(self, c: Claim, doc: Document, path: Path, label: str) -> bool:
        """The file waiting at ``path`` is still the content the document was queued with. A file touched in place
        (same content) is; one replaced by other content under the same name is not: then the chunk fails with
        that reason (decoding it would give the new pages under the old document's name and checksum) and the
        new content is taken as a document of its own."""
        st = path.stat()
        if (st.st_size, st.st_mtime_ns) == (doc.size_bytes, doc.mtime_ns):
            return True
        sha = sha256_file(path)
        if sha == doc.sha256:
            with self.db.engine.begin() as conn:
                conn.execute(update(Document.__table__).where(Document.id == doc.id).values(
                    size_bytes=st.st_size, mtime_ns=st.st_mtime_ns))
            return True
        why = (f"the file at {path} was replaced by other content (sha256 {sha[:12]}...) before this document "
               f"(sha256 {doc.sha256[:12]}...) was decoded; that content is queued as a document of its own")
        fail(self.db, c, why, self.settings.worker.max_attempts, self.settings.worker.backoff_seconds, permanent=True)
        logger.error("{}: {}", label, why)
        intake_file(self.db, self.settings, path)
        return False

    def _replay_ids(self, c: Claim) -> list[int] | None:
        """Token ids of an earlier decode of exactly these pages (a re-run's free draft), if any."""
        with self.db.session() as s:
            return s.scalar(select(Chunk.output_ids).where(
                Chunk.document_id == c.document_id, Chunk.first_page == c.first_page, Chunk.last_page == c.last_page,
                Chunk.id != c.chunk_id, Chunk.output_ids.is_not(None)).order_by(Chunk.id.desc()).limit(1))

    def _reserved(self) -> int | None:
        """The run id that chunks split off by this worker are reserved for (a re-run's), else None."""
        return self._run_id if self.fresh_run is not None else None

    def _reference_texts(self, c: Claim, pages: list) -> list[str]:
        """Per page: the latest earlier output of that page (a re-run), else its PDF text layer."""
        with self.db.session() as s:
            latest = select(func.max(Page.id)).where(
                Page.document_id == c.document_id, Page.page_index.between(c.first_page, c.last_page),
                Page.chunk_id != c.chunk_id).group_by(Page.page_index)
            earlier = dict(s.execute(select(Page.page_index, Page.text).where(Page.id.in_(latest))).all())
        return [earlier.get(p.index) or p.text_layer or "" for p in pages]

    def _decode_failed(self, c: Claim, label: str, e: Exception) -> None:
        w = self.settings.worker
        if infrastructure_problem(e):  # e.g. the ledger failed while reading the drafts: no attempt is spent on it
            raise e
        if _is_oom(e):
            self.decoder().free_memory()
            n = c.last_page - c.first_page + 1
            if n > 1:  # fewer pages need less memory: split instead of retrying the same size
                mid = c.first_page + n // 2 - 1
                note = f"out of memory with {n} pages ({e.__class__.__name__}); split into " \
                       f"{c.first_page}-{mid} and {mid + 1}-{c.last_page}"
                with self.db.engine.begin() as conn:
                    if complete(conn, c, status=ChunkStatus.SPLIT, note=note):
                        conn.execute(Chunk.__table__.insert(), [
                            dict(document_id=c.document_id, first_page=c.first_page, last_page=mid, parent_id=c.chunk_id,
                                 run_id=self._reserved()),
                            dict(document_id=c.document_id, first_page=mid + 1, last_page=c.last_page,
                                 parent_id=c.chunk_id, run_id=self._reserved()),
                        ])
                logger.warning("{}: {}", label, note)
                return
            reason = f"out of memory decoding one page on {self.decoder().device}: {str(e).splitlines()[0][:300]}"
        else:
            reason = f"{type(e).__name__}: {e}"
        status = fail(self.db, c, reason, w.max_attempts, w.backoff_seconds)
        logger.opt(exception=not _is_oom(e)).error("{}: {} -> {}", label, reason, status or "lease lost")

    def _store(self, c: Claim, run_id: int, pages: list, out: ChunkOutput, label: str,
               turned: dict[int, TurnChoice] | None = None, page_stats: list[dict[str, Any]] | None = None) -> None:
        n_in = len(pages)
        kept = out.pages
        rows = []
        mode = getattr(self.decoder(), "mode", None)
        for i, po in enumerate(kept):
            rendered = pages[i]
            stats = {**po.stats, "chunk_id": c.chunk_id, "chunk_pages": f"{c.first_page}-{c.last_page}", "mode": mode,
                     **page_stats[i]}
            notes = [out.note] if out.note else []
            if (choice := (turned or {}).get(rendered.index)) is not None:
                stats["orientation"] = choice.record()
                if choice.turn:
                    notes.append(choice.note())
            if notes:
                stats["note"] = "; ".join(notes)
            rows.append(dict(document_id=c.document_id, run_id=run_id, chunk_id=c.chunk_id,
                             page_index=rendered.index, text=po.text, boxes=po.boxes, stats=stats,
                             text_layer=rendered.text_layer))
        new_chunks = []
        if out.requeue:
            first_left = c.first_page + len(kept)
            if out.finish_reason in ("context_limit", "length") and first_left < c.last_page:
                # cut on page first_left (a runaway page, or one much longer than planned): it goes back alone,
                # with the whole room, and the pages after it as a chunk of their own, so a page that runs away
                # again costs one more decode of itself only, not of its neighbours
                new_chunks = [(first_left, first_left), (first_left + 1, c.last_page)]
            elif len(kept) == 0:  # no room for the prompt, or no page at all: halve the chunk
                mid = c.first_page + n_in // 2 - 1
                new_chunks = [(c.first_page, mid), (mid + 1, c.last_page)]
            else:
                new_chunks = [(first_left, c.last_page)]
        status = ChunkStatus.SPLIT if new_chunks else ChunkStatus.DONE
        note = out.note
        if new_chunks:
            why = {"context_limit": "output reached the context limit; ",
                   "length": "output reached engine.max_tokens_per_page x pages; "}.get(out.finish_reason, "")
            note = (note + "; " if note else "") + why + "pages " + \
                ", ".join(f"{a}-{b}" for a, b in new_chunks) + " re-queued"
        while True:  # the decoded result is kept while the ledger is in trouble, and stored once it works again
            try:
                with self.db.engine.begin() as conn:
                    if not complete(conn, c, status=status, note=note, stats=out.chunk_stats, run_id=run_id,
                                    output_ids=out.output_ids):
                        raise _LeaseLost
                    if rows:
                        conn.execute(Page.__table__.insert(), rows)
                    if new_chunks:
                        conn.execute(Chunk.__table__.insert(), [
                            dict(document_id=c.document_id, first_page=a, last_page=b, parent_id=c.chunk_id,
                                 run_id=self._reserved()) for a, b in new_chunks])
                    ready = refresh_document(conn, c.document_id) == "ready"
                break
            except _LeaseLost:  # taken over by another worker (or stored by this one before the ledger failed)
                logger.warning("{}: lease lost before storing; dropping the result", label)
                return
            except Exception as e:
                problem = infrastructure_problem(e)
                if problem is None or self._stop is None or self._stop.is_set():
                    raise
                if self._stop.wait(self.trouble.failed(f"cannot store {label}: {problem}")):
                    raise
        self.trouble.ok()
        s = out.chunk_stats
        logger.info("{}: {} pages, {} tokens in {:.1f}s ({:.1f} tok/s), finish {}{}", label, len(rows),
                    s.get("output_tokens", 0), s.get("seconds", 0.0), s.get("tokens_per_second", 0.0),
                    out.finish_reason, f"; {note}" if note else "")
        if self.on_pages:
            self.on_pages(len(rows))
        if ready:
            self.finalize(c.document_id)

    # -- documents -------------------------------------------------------------------------------
    def finalize_ready(self) -> None:
        """Finish documents whose chunks are all done but whose outputs were not written (a crash
        between the last chunk and the outputs leaves exactly this); only this worker's documents when it has
        ``document_ids``."""
        mine = among(Document.id, self.document_ids) if self.document_ids is not None else true()
        with self.db.session() as s:
            ids = s.scalars(select(Document.id).where(Document.status.in_([DocStatus.QUEUED, DocStatus.RUNNING]),
                                                      mine)).all()
        for doc_id in ids:
            self._finalize_if_ready(doc_id)

    def _finalize_if_ready(self, doc_id: int) -> None:
        """Finish the document when none of its chunks is pending (db.queue.refresh_document says so)."""
        with self.db.engine.begin() as conn:
            ready = refresh_document(conn, doc_id) == "ready"
        if ready:
            self.finalize(doc_id)

    def finalize(self, doc_id: int) -> Path | None:
        """Write document.md/json (latest page of each index), archive the original, mark it done. Returns the
        output folder, or None when the document could not be finished: then it is failed with the reason."""
        with self.db.session() as s:
            doc = s.get(Document, doc_id)
            latest = select(func.max(Page.id)).where(Page.document_id == doc_id).group_by(Page.page_index)
            pages = s.scalars(select(Page).where(Page.id.in_(latest)).order_by(Page.page_index)).all()
            run_ids = sorted({p.run_id for p in pages})
            runs = [s.get(Run, r) for r in run_ids]
        indexes = [p.page_index for p in pages]
        self._grade(pages)
        if indexes != list(range(1, doc.page_count + 1)):
            missing = sorted(set(range(1, doc.page_count + 1)) - set(indexes))
            return self._not_finished(doc, f"pages missing after all chunks finished: {missing}")
        document = {"id": doc.id, "name": doc.original_name, "sha256": doc.sha256, "kind": doc.kind,
                    "page_count": doc.page_count, "original_path": doc.original_path}
        run = _run_dict(runs[-1]) if runs else {}
        if len(runs) > 1:
            run["earlier_runs"] = [_run_dict(r) for r in runs[:-1]]
        page_dicts = [{"index": p.page_index, "text": p.text, "boxes": p.boxes, "stats": p.stats, "run_id": p.run_id,
                       **({"note": p.stats["note"]} if p.stats.get("note") else {})} for p in pages]
        # the scan under the searchable PDF: the archived original on a re-run, else the one still in place
        scan = next((Path(q) for q in (doc.archived_path, doc.original_path) if q and Path(q).exists()), None)
        try:
            folder = self._output_folder(doc)
            md, _ = write_document_outputs(folder, document, run, page_dicts, source=scan,
                                           formats=self.settings.outputs.formats)
        except OSError as e:  # a file in the way, access denied, a name or path the OS refuses
            if infrastructure_problem(e):  # a full or failing disk: the document waits, finished once it is fixed
                raise
            return self._not_finished(doc, f"outputs could not be written: {e}")
        archived = None
        src = Path(doc.original_path)
        error = None
        if doc.archived_path and Path(doc.archived_path).exists():
            archived = Path(doc.archived_path)  # archived by an earlier pass (this is a re-run)
        elif src.exists():
            try:
                archived = file_away(src, self.settings.archive, self.settings.inbox)
            except OSError as e:
                if infrastructure_problem(e):
                    raise
                return self._not_finished(doc, f"outputs written to {folder}, but the original could not be "
                                               f"archived: {e}", folder)
        else:
            error = f"original was no longer at {src} when archiving"
        with self.db.engine.begin() as conn:
            conn.execute(update(Document.__table__).where(Document.id == doc_id).values(
                status=DocStatus.DONE, archived_path=str(archived) if archived else None, error=error,
                output_dir=str(folder),
                completed_at=datetime.now(timezone.utc)))
        logger.success("{} done: {}", doc.original_name, md)
        return folder

    def _output_folder(self, doc: Document) -> Path:
        """Where the document's outputs go: the folder they were written to before (a re-run, or a retry, rewrites
        them there, even when that was a `uflash run --out DIR`), or, the first time, or when the place of that
        folder is gone or another document has taken the folder, a folder of its own in the outbox."""
        if doc.output_dir:
            earlier = Path(doc.output_dir)
            if earlier.parent.is_dir() and not holds_another_document(earlier, doc.sha256):
                return earlier
            logger.warning("{}: {}, where its outputs were written before, is gone or holds another document: "
                           "written to the outbox {}", doc.original_name, earlier, self.settings.outbox)
        return output_folder(self.settings.outbox, doc.original_name, doc.sha256)

    def _not_finished(self, doc: Document, reason: str, output_dir: Path | None = None) -> None:
        """Mark a document whose chunks are all done failed with ``reason``, and let the worker go on with the
        others. Nothing is lost: its pages stay in the ledger and its original stays where it is; being failed,
        it is not finalized again (and failing again) at every start."""
        values: dict[str, Any] = dict(status=DocStatus.FAILED, error=reason[:4000])
        if output_dir is not None:
            values["output_dir"] = str(output_dir)
        with self.db.engine.begin() as conn:
            conn.execute(update(Document.__table__).where(Document.id == doc.id).values(**values))
        logger.error("{}: {}", doc.original_name, reason)

    def _grade(self, pages: list[Page]) -> None:
        """Grade the document's latest pages against each other (ingest.grading); store grade and reasons in their
        stats."""
        graded = grade_document([{**(p.stats.get("quality") or {}), "plain": plain_text(p.text),
                                  "chunk_id": p.chunk_id} for p in pages], self.settings.quality.thresholds())
        with self.db.engine.begin() as conn:
            for p, q in zip(pages, graded):
                p.stats = {**p.stats, "quality": q}
                conn.execute(update(Page.__table__).where(Page.id == p.id).values(stats=p.stats))


def _run_dict(r: Run) -> dict[str, Any]:
    return {"id": r.id, "mode": r.mode, "model": r.model, "engine_version": r.engine_version, "host": r.host,
            "started_at": r.started_at.isoformat() if r.started_at else None}


def wait_backoff(seconds: float, stop: threading.Event) -> None:
    end = time.monotonic() + seconds
    while not stop.is_set() and time.monotonic() < end:
        stop.wait(min(1.0, end - time.monotonic()))
