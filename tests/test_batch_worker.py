"""The batched worker on CPU with a tiny random Unlimited-OCR: several chunks decoding together (engine.max_batch),
each stored in its own transaction the moment it ends; real processes, real signals, one real SQLite ledger."""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime

from sqlalchemy import func, select

from db.models import Chunk, ChunkStatus, Document, Page
from db.session import Database
from engine.loading import load_decoder
from ingest.config import load_settings
from ingest.intake.enqueue import intake_file
from ingest.review.report import collect_report, format_report
from ingest.worker.worker import Worker
from tests.conftest import make_pdf, uflash, worker_config
from tests.test_worker import freeze_while, serve_until_done, start_uflash


def _config(tmp_path, tiny_model_dir, max_batch, chunk_pages=1, **sections):
    return worker_config(tmp_path, tiny_model_dir, engine={"mode": "lossless", "max_batch": max_batch,
                                                           "max_pages_per_chunk": chunk_pages,
                                                           "max_tokens_per_page": 24},
                         orientation={"auto": False}, **sections)


def _queue(tmp_path, cfg, docs: int, pages: int):
    s = load_settings(cfg)
    s.ensure_folders()
    db = Database(s.database_url)
    ids = [intake_file(db, s, make_pdf(s.inbox / f"d{i}.pdf", [f"Document {i} page {p}: the register of "
                                                              f"{1850 + 7 * i + p}." for p in range(pages)]))
           .document_id for i in range(docs)]
    return s, db, ids


def _page_rows(db) -> dict[tuple[int, int], int]:
    with db.session() as ss:
        return {(d, i): n for d, i, n in ss.execute(select(Page.document_id, Page.page_index, func.count())
                                                   .group_by(Page.document_id, Page.page_index))}


def test_max_batch_4_gives_the_texts_of_max_batch_1(tmp_path, tiny_model_dir):
    """Six two-page chunks through the worker at max_batch 4 (lossless; the tiny model's short outputs cut most of
    them, so their pages come back as chunks of their own): the same page texts as at max_batch 1, and the pages record
    that they decoded in a batch of more than one chunk."""
    texts, rows = {}, {}
    for max_batch in (1, 4):
        folder = tmp_path / f"b{max_batch}"
        folder.mkdir()
        cfg = _config(folder, tiny_model_dir, max_batch, chunk_pages=2)
        s, db, _ = _queue(folder, cfg, docs=6, pages=2)
        decoder = load_decoder(str(tiny_model_dir), "cpu", "float32", "lossless", max_batch=max_batch)
        serve_until_done(Worker(s, db, lambda d=decoder: d), db, timeout=600)
        with db.session() as ss:
            pages = ss.execute(select(Document.original_name, Page.page_index, Page.text, Page.stats)
                               .join(Document, Document.id == Page.document_id)).all()
        texts[max_batch] = {(name, i): text for name, i, text, _ in pages}
        rows[max_batch] = [st["batch_rows"] for *_, st in pages]
        rep = collect_report(db)
        with db.session() as ss:  # 12 pages from the run's start to its last stored page
            last_page = ss.scalar(select(func.max(Page.created_at)))
        started = datetime.fromisoformat(rep["run"]["started_at"])
        hours = (last_page.replace(tzinfo=None) - started.replace(tzinfo=None)).total_seconds() / 3600
        assert rep["run"]["pages_per_hour"] == round(12 / hours, 1)
        assert f"{rep['run']['pages_per_hour']:,.0f} pages/hour" in format_report(rep).splitlines()[0]
        db.dispose()
    assert len(texts[4]) == 12 and texts[4] == texts[1]
    assert set(rows[1]) == {1} and max(rows[4]) > 1, rows


def test_sigkill_with_chunks_in_flight_loses_no_finished_chunk_and_duplicates_nothing(tmp_path, tiny_model_dir):
    """A watcher decoding up to 3 chunks at once is killed outright (SIGKILL) once it has stored some chunks and holds
    several others: the stored chunks stay stored (their pages once, their attempt not repeated), and the restart
    decodes the others, each page once."""
    cfg = _config(tmp_path, tiny_model_dir, 3, worker={"lease_seconds": 300.0, "heartbeat_seconds": 1.0,
                                                        "prepare_processes": 1})
    s, db, ids = _queue(tmp_path, cfg, docs=6, pages=2)
    proc = start_uflash(cfg, "watch")

    def holding(ss):
        done = ss.scalar(select(func.count()).select_from(Chunk).where(Chunk.status == ChunkStatus.DONE))
        running = ss.scalars(select(Chunk).where(Chunk.status == ChunkStatus.RUNNING)).all()
        return running if done >= 2 and len(running) >= 2 else []

    freeze_while(proc, db, holding)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    with db.session() as ss:
        stored = {c.id: c.attempts for c in ss.scalars(select(Chunk).where(Chunk.status == ChunkStatus.DONE))}
        in_flight = ss.scalars(select(Chunk.id).where(Chunk.status == ChunkStatus.RUNNING)).all()
    before = _page_rows(db)
    assert len(stored) >= 2 and len(in_flight) >= 2
    assert set(before.values()) == {1}  # a stored chunk's pages, once each; nothing of the chunks in flight
    r = uflash("--config", str(cfg), "run", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    after = _page_rows(db)
    assert after == {(d, i): 1 for d in ids for i in (1, 2)}  # every page exactly once
    with db.session() as ss:
        assert all(ss.get(Chunk, c).attempts == n for c, n in stored.items())  # the stored ones were not redone
        assert all(ss.get(Document, d).status == "done" for d in ids)
    db.dispose()


def test_two_worker_processes_on_one_sqlite_ledger_store_no_chunk_twice(tmp_path, tiny_model_dir):
    """Two `uflash run` processes (as one per GPU would run, here both on the CPU) serve one SQLite ledger at once:
    both decode, and every page is stored exactly once."""
    cfg = _config(tmp_path, tiny_model_dir, 2)
    s, db, ids = _queue(tmp_path, cfg, docs=8, pages=2)
    procs = [start_uflash(cfg, "run", "--device", "cpu") for _ in range(2)]
    deadline = time.monotonic() + 600
    for p in procs:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
        p.reader.join(timeout=10)
    assert [p.returncode for p in procs] == [0, 0], "".join(procs[0].lines + procs[1].lines)
    assert _page_rows(db) == {(d, i): 1 for d in ids for i in (1, 2)}
    with db.session() as ss:
        by_run = dict(ss.execute(select(Page.run_id, func.count()).group_by(Page.run_id)).all())
        assert ss.scalar(select(func.count()).select_from(Chunk).where(Chunk.status != ChunkStatus.DONE)) == 0
    assert len(by_run) == 2, f"one process did all the work: {by_run}"
    db.dispose()


def test_batch_and_device_settings(tmp_path):
    """engine.max_batch is "auto" or a positive number; model.device and --device take cpu, cuda or cuda:N (one
    worker per GPU), and a device that is none of these is a configuration error (exit 2) naming the flag."""
    import pytest

    from ingest.errors import ConfigError
    from tests.conftest import write_config

    s = load_settings(write_config(tmp_path, engine={"max_batch": 8}, model={"device": "cuda:1"}))
    assert (s.engine.max_batch, s.model.device, s.on_device("cpu").model.device) == (8, "cuda:1", "cpu")
    assert load_settings(write_config(tmp_path)).engine.max_batch == "auto"
    for bad in ({"engine": {"max_batch": 0}}, {"engine": {"max_batch": "many"}}, {"model": {"device": "gpu1"}}):
        with pytest.raises(ConfigError):
            load_settings(write_config(tmp_path, **bad))
    r = uflash("--config", str(write_config(tmp_path)), "run", "--device", "gpu")
    assert r.returncode == 2 and "--device 'gpu'" in r.stderr, r.stderr
