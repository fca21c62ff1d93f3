"""The worker end to end on CPU with a tiny random Unlimited-OCR: real files, real processes, real SQLite."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pymupdf
import pytest
import torch
from PIL import Image
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError

from db.models import Chunk, ChunkStatus, DocStatus, Document, Duplicate, Page, Run
from db.session import Database
from engine.chunk_decode import OfficialDecoder
from engine.chunk_output import assemble
from engine.model.load import load_model
from engine.official import DecodeResult
from ingest.config import OrientationSettings, load_settings
from ingest.errors import ModelUnavailable
from ingest.intake.enqueue import intake_file
from ingest.pages.render import render_pages
from ingest.worker.worker import Worker, make_worker
from tests.conftest import ROOT, make_pdf, serve_until, uflash, wait_until, worker_config, write_config


def make_tiff(path: Path, n: int, shade: int = 0) -> Path:
    frames = [Image.new("RGB", (400, 560), (255 - shade, 255 - 40 * i, 255)) for i in range(n)]
    frames[0].save(path, save_all=True, append_images=frames[1:])
    return path


def pages_in_db(db, doc_id):
    with db.session() as s:
        return s.execute(select(Page.page_index, func.count()).where(Page.document_id == doc_id)
                         .group_by(Page.page_index).order_by(Page.page_index)).all()


def test_uflash_run_end_to_end(tmp_path, tiny_model_dir, ledger_url):
    cfg = worker_config(tmp_path, tiny_model_dir, database={"url": ledger_url})
    s = load_settings(cfg)
    s.ensure_folders()
    files = [make_pdf(s.inbox / "one.pdf", ["A single page."]), make_pdf(s.inbox / "seven.pdf", 7),
             make_tiff(s.inbox / "scan.tif", 3)]
    Image.new("RGB", (500, 300), "white").save(s.inbox / "photo.png")
    files.append(s.inbox / "photo.png")
    r = uflash("--config", str(cfg), "run", *map(str, files), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    expected = {"one": 1, "seven": 7, "scan": 3, "photo": 1}
    with Database(s.database_url).session() as ss:
        stored_pages = {(Path(name).stem, i): (text, boxes) for name, i, text, boxes in ss.execute(
            select(Document.original_name, Page.page_index, Page.text, Page.boxes)
            .join(Document, Document.id == Page.document_id))}
    assert len(stored_pages) == sum(expected.values()) and any(text for text, _ in stored_pages.values())
    for stem, n in expected.items():
        out = s.outbox / stem
        doc = json.loads((out / "document.json").read_text(encoding="utf-8"))
        assert [p["index"] for p in doc["pages"]] == list(range(1, n + 1))
        for p in doc["pages"]:
            assert {"finish_reason", "tokens", "seconds"} <= set(p["stats"])
            stored = stored_pages[(stem, p["index"])]  # document.json says what the ledger holds, page for page
            assert (p["text"], p["boxes"]) == stored
        assert doc["run"]["mode"] == "lossless" and doc["document"]["page_count"] == n  # the default mode
        assert (out / "document.md").read_text(encoding="utf-8").count("<!-- page ") == n
        with pymupdf.open(out / "document.pdf") as searchable:  # the scan with the text over it, page for page
            assert searchable.page_count == n
    assert not any(s.inbox.iterdir()), "originals must leave the inbox"
    assert sorted(p.name for p in s.archive.iterdir()) == ["one.pdf", "photo.png", "scan.tif", "seven.pdf"]
    assert "seven.pdf: 7 pages" in r.stdout
    db = Database(s.database_url)
    with db.session() as ss:
        seven = ss.scalar(select(Document).where(Document.original_name == "seven.pdf"))
        planned = [(c.first_page, c.last_page) for c in seven.chunks if c.parent_id is None]
        assert planned == [(1, 4), (5, 7)]
    assert [n for _, n in pages_in_db(db, seven.id)] == [1] * 7


def test_run_on_a_file_outside_the_inbox_leaves_it_in_place(tmp_path, tiny_model_dir):
    """`uflash run PATH` copies a file named outside the inbox into the archive and leaves the original where the
    user keeps it; running the same command again finds the document done, decodes nothing and says so."""
    cfg = worker_config(tmp_path, tiny_model_dir)
    s = load_settings(cfg)
    s.ensure_folders()
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    pdf = make_pdf(shelf / "letter.pdf", ["Dear archivist.", "Yours."])
    original = pdf.read_bytes()
    for said in ("done    letter.pdf: 2 pages", "duplicate letter.pdf: the same content as document 1 (letter.pdf), "
                                                  f"nothing decoded; left at {pdf}"):
        r = uflash("--config", str(cfg), "run", str(pdf), timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        assert said in r.stdout and len(r.stdout.splitlines()) == 2, r.stdout  # that line, and the report's
        assert pdf.read_bytes() == original, "the user's file stays where it was, unchanged"
    assert [p.name for p in s.archive.iterdir() if p.is_file()] == ["letter.pdf"]
    assert (s.archive / "letter.pdf").read_bytes() == original
    db = Database(s.database_url)
    with db.session() as ss:
        (doc,) = ss.scalars(select(Document)).all()
        assert doc.archived_path == str(s.archive / "letter.pdf")
        (dup,) = ss.scalars(select(Duplicate)).all()  # the second run: recorded, left in place, not decoded again
        assert dup.document_id == doc.id and dup.moved_to is None
    assert [n for _, n in pages_in_db(db, doc.id)] == [1, 1]


def test_worker_decode_equals_generate(tmp_path, tiny_model_dir):
    """Token ids stored for a 3-page chunk equal model.generate() called directly on the same inputs."""
    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    pdf = make_pdf(tmp_path / "three.pdf", ["alpha beta", "gamma delta", "epsilon"])
    images = [p.image for p in render_pages(pdf, "pdf", 1, 3)]
    out = OfficialDecoder(loaded).decode(images, context_limit=32768, max_new_tokens=160)
    inputs = loaded.processor(images=images, text="<image><image><image>Multi page parsing.", return_tensors="pt")
    with torch.inference_mode():
        seq = loaded.model.generate(**inputs, max_new_tokens=160, do_sample=False, no_repeat_ngram_size=35,
                                    no_repeat_ngram_window_size=1024)
    direct = seq[0, inputs["input_ids"].shape[1]:].tolist()
    assert out.output_ids == direct
    assert len(direct) > 128  # crosses the R-SWA window many times over (window 8)


def _fake_result(text: str, finish: str, n_tokens: int = 100) -> DecodeResult:
    return DecodeResult(prompt_ids=[0] * 10, output_ids=list(range(n_tokens)), finish_reason=finish, seconds=1.0,
                        text=text, prompt_kind="multi", n_pages=4, ngram_window=1024)


def test_assemble_keeps_complete_pages_at_the_limit():
    out = assemble(_fake_result("<PAGE>one<PAGE>two<PAGE>thr", "length"), 4, hit_context=True)
    assert [p.text for p in out.pages] == ["one", "two"] and out.requeue and out.finish_reason == "context_limit"
    out = assemble(_fake_result("<PAGE>a<PAGE>b<PAGE>c<PAGE>d", "eos"), 4, hit_context=False)
    assert [p.text for p in out.pages] == ["a", "b", "c", "d"] and not out.requeue
    assert out.pages[-1].stats["finish_reason"] == "eos"
    out = assemble(_fake_result("<PAGE>a<PAGE>b", "eos"), 4, hit_context=False)
    assert [p.text for p in out.pages] == ["a", "b"] and out.requeue and "2 pages for 4" in out.note
    assert "re-queued" not in out.note  # the worker says which pages it re-queues, once
    out = assemble(_fake_result("<PAGE>a<PAGE>b<PAGE>c<PAGE>d<PAGE>e", "eos"), 4, hit_context=False)
    assert len(out.pages) == 4 and out.pages[3].text == "d\n\ne" and "5 pages for 4" in out.pages[3].stats["note"]
    out = assemble(_fake_result("no separator at all, cut", "length"), 4, hit_context=True)
    assert out.pages == [] and out.requeue
    out = assemble(_fake_result("a single page, cut", "length"), 1, hit_context=True)
    assert [p.text for p in out.pages] == ["a single page, cut"] and not out.requeue
    assert out.pages[0].stats["finish_reason"] == "context_limit"


def serve_until_done(worker, db, timeout=300):
    def done():
        with db.session() as s:
            return s.scalar(select(func.count()).select_from(Document)
                            .where(Document.status.not_in(["done", "failed"]))) == 0

    serve_until(worker, done, timeout)


def test_context_limit_loses_no_page(tmp_path, tiny_model_dir, ledger_url):
    # 3-page prompt = 1 + 3*21 + 5 tokens; a limit of 110 leaves ~40 output tokens for 3 pages.
    cfg = worker_config(tmp_path, tiny_model_dir, engine={"max_tokens_per_page": None, "max_pages_per_chunk": 3,
                                                          "default_tokens_per_page": 1}, database={"url": ledger_url})
    s = load_settings(cfg)
    s.ensure_folders()
    db = Database(s.database_url)
    doc = intake_file(db, s, make_pdf(s.inbox / "six.pdf", 6)).document_id  # planned as 2 chunks of 3
    s.engine.context_limit = 110  # below the config floor on purpose: force the limit
    worker = Worker(s, db, lambda: OfficialDecoder(load_model(str(tiny_model_dir), "cpu", "float32")))
    serve_until_done(worker, db)
    assert [n for _, n in pages_in_db(db, doc)] == [1] * 6  # every page exactly once
    with db.session() as ss:
        chunks = ss.scalars(select(Chunk).where(Chunk.document_id == doc)).all()
        d = ss.get(Document, doc)
    assert any(c.status == ChunkStatus.SPLIT for c in chunks)
    assert all("output reached the context limit; pages" in c.note for c in chunks if c.status == ChunkStatus.SPLIT)
    assert all(c.status in (ChunkStatus.DONE, ChunkStatus.SPLIT) for c in chunks)
    assert d.status == "done"
    out = json.loads((Path(d.output_dir) / "document.json").read_text(encoding="utf-8"))
    assert [p["index"] for p in out["pages"]] == list(range(1, 7))


def test_the_per_page_token_cap_is_named_as_such_when_it_cuts_a_chunk(tmp_path, tiny_model_dir):
    cfg = worker_config(tmp_path, tiny_model_dir, engine={"max_tokens_per_page": 12, "max_pages_per_chunk": 3,
                                                          "default_tokens_per_page": 1})
    s = load_settings(cfg)
    s.ensure_folders()
    db = Database(s.database_url)
    doc = intake_file(db, s, make_pdf(s.inbox / "six.pdf", 6)).document_id
    worker = Worker(s, db, lambda: OfficialDecoder(load_model(str(tiny_model_dir), "cpu", "float32")))
    serve_until_done(worker, db)
    assert [n for _, n in pages_in_db(db, doc)] == [1] * 6  # every page exactly once
    with db.session() as ss:
        notes = [c.note for c in ss.scalars(select(Chunk).where(Chunk.document_id == doc)) if c.status == "split"]
    assert notes and all("output reached engine.max_tokens_per_page x pages; pages" in n for n in notes)


class FlakyDecoder:
    """Wraps the real decoder; raises an out-of-memory error for chunks with a given page count."""

    def __init__(self, inner, oom_pages: int):
        self.inner, self.oom_pages = inner, oom_pages
        self.mode, self.model_name, self.device = inner.mode, inner.model_name, inner.device

    def describe(self):
        return self.inner.describe()

    def free_memory(self):
        self.inner.free_memory()

    def decode(self, images, context_limit, max_new_tokens=None, **hints):
        if len(images) == self.oom_pages:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return self.inner.decode(images, context_limit, max_new_tokens, **hints)


def test_out_of_memory_is_recorded_and_other_documents_go_on(tmp_path, tiny_model_dir, ledger_url):
    cfg = worker_config(tmp_path, tiny_model_dir, worker={"max_attempts": 2, "backoff_seconds": 0.0},
                        database={"url": ledger_url})
    s = load_settings(cfg)
    s.ensure_folders()
    db = Database(s.database_url)
    ok = intake_file(db, s, make_pdf(s.inbox / "ok.pdf", 3)).document_id  # 3 pages: fine
    big = intake_file(db, s, make_pdf(s.inbox / "big.pdf", 2)).document_id  # 2 pages: OOM, then 1 page: fine
    bad = intake_file(db, s, make_tiff(s.inbox / "single.tif", 1)).document_id
    inner = OfficialDecoder(load_model(str(tiny_model_dir), "cpu", "float32"))
    worker = Worker(s, db, lambda: FlakyDecoder(inner, oom_pages=2))
    serve_until_done(worker, db)
    with db.session() as ss:
        assert ss.get(Document, ok).status == "done"
        assert ss.get(Document, big).status == "done"  # split after the OOM, each half fits
        notes = [c.note for c in ss.scalars(select(Chunk).where(Chunk.document_id == big))]
        assert any(n and "out of memory with 2 pages" in n for n in notes)
        assert ss.get(Document, bad).status == "done"
    worker2 = Worker(s, db, lambda: FlakyDecoder(inner, oom_pages=1))
    single = intake_file(db, s, make_tiff(s.inbox / "one more.tif", 1, shade=9)).document_id
    serve_until_done(worker2, db)
    with db.session() as ss:
        d = ss.get(Document, single)
        assert d.status == "failed" and "out of memory decoding one page" in d.error


def test_missing_and_corrupt_weights_give_readable_reasons(tmp_path, tiny_model_dir):
    cfg = worker_config(tmp_path, tmp_path / "no-such-model")
    s = load_settings(cfg)
    s.ensure_folders()
    pdf = make_pdf(s.inbox / "doc.pdf", 1)
    r = uflash("--config", str(cfg), "run", str(pdf))
    assert r.returncode == 3, r.stderr
    assert "model not found at" in r.stderr and "model.path" in r.stderr and "Traceback" not in r.stderr
    assert not Path(s.database_url.removeprefix("sqlite:///")).exists()  # it stopped before taking anything in
    said = r.stderr.strip().splitlines()[-1].removeprefix("uflash: error: ")
    # a worker that meets it (`uflash watch` waits for the model): the same line, recorded on the waiting chunk
    db = Database(s.database_url)
    intake_file(db, s, pdf)
    with make_worker(s, db) as worker, pytest.raises(ModelUnavailable) as met:
        worker.serve(threading.Event(), until=lambda: False)
    db.dispose()
    assert str(met.value) == said
    st = uflash("--config", str(cfg), "status").stdout
    assert "model unavailable: model not found at" in st
    assert pdf.exists(), "the file stays queued until a model is there"

    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    cfg2 = worker_config(tmp_path / "two", broken) if (tmp_path / "two").mkdir() is None else None
    r = uflash("--config", str(cfg2), "run", str(make_pdf(tmp_path / "two" / "x.pdf", 1)))
    assert r.returncode == 3 and "cannot load weights" in r.stderr and "Traceback" not in r.stderr


def start_uflash(cfg, *args, env: dict | None = None) -> subprocess.Popen:
    """``uflash --config CFG ARGS`` as a child process (``env``: added to its environment); its output lines collect
    in ``proc.lines`` (all of them once ``proc.reader`` has ended)."""
    proc = subprocess.Popen([sys.executable, "-m", "ingest.commands.cli", "--config", str(cfg), *args], cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    proc.lines = []
    proc.reader = threading.Thread(target=lambda: proc.lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    proc.reader.start()
    return proc


def freeze_while(proc, db, holding) -> list:
    """Freeze ``proc`` (SIGSTOP) at a moment when ``holding(session)`` returns running chunks (the tiny model decodes
    a chunk in well under a second, so the queue itself is watched); returns them, seen while frozen."""
    deadline, running = time.monotonic() + 120, []
    # the look while it is frozen waits 1 s at most: frozen inside a transaction it holds SQLite's write lock for good
    frozen_look = Database(db.url, busy_timeout_ms=1000, create=False)
    while not running and time.monotonic() < deadline and proc.poll() is None:
        with db.session() as ss:  # a session holds SQLite's write lock (BEGIN IMMEDIATE): never sleep inside one
            seen = holding(ss)
        if not seen:
            time.sleep(0.005)
            continue
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            with frozen_look.session() as ss:
                running = holding(ss)
        except OperationalError:  # frozen while it held the write lock: let it go and look again
            running = []
        if not running:  # it finished between the two looks (or held the lock): let it go on
            os.kill(proc.pid, signal.SIGCONT)
    frozen_look.dispose()
    assert running, "the process was never seen holding a chunk\n" + "".join(proc.lines)
    return running


def test_worker_killed_mid_chunk_redoes_it_once(tmp_path, tiny_model_dir, ledger_url):
    """A watcher killed outright (SIGKILL) mid-chunk: the restart takes the chunk over at once (its owner's process
    is gone), although the lease has most of its 300 s left, redoes it once, and closes the killed run as crashed."""
    cfg = worker_config(tmp_path, tiny_model_dir, engine={"max_tokens_per_page": 100, "max_pages_per_chunk": 2},
                        worker={"lease_seconds": 300.0, "heartbeat_seconds": 1.0, "prepare_processes": 1},
                        database={"url": ledger_url})
    s = load_settings(cfg)
    s.ensure_folders()
    make_pdf(s.inbox / "four.pdf", 4)
    proc = start_uflash(cfg, "watch")
    db = Database(s.database_url)
    # frozen the moment it holds a chunk with the model loaded (its run opened), then killed for real
    freeze_while(proc, db, lambda ss: ss.scalar(select(Run.id)) is not None and ss.scalars(
        select(Chunk).where(Chunk.status == ChunkStatus.RUNNING)).all())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    with db.session() as ss:  # the chunk decoding and the one claimed ahead of it (rendered while the other decodes)
        running = ss.scalars(select(Chunk).where(Chunk.status == ChunkStatus.RUNNING)).all()
        assert 1 <= len(running) <= 2 and all(c.lease_expires_at > time.time() + 200 for c in running), \
            "the killed worker held its leases"
        dead_lease_ends = min(c.lease_expires_at for c in running)
    st = uflash("--config", str(cfg), "status").stdout
    assert "its worker is gone: the next worker takes it over at once" in st and "its process is gone" in st, st
    r = uflash("--config", str(cfg), "run", timeout=600)  # restart: takes the inbox file again
    assert r.returncode == 0, r.stdout + r.stderr
    assert time.time() < dead_lease_ends, "the restart waited for the dead worker's lease"
    assert "leased by uflash processes that are gone: taken over now" in r.stderr
    with db.session() as ss:
        doc = ss.scalar(select(Document))
        chunks = ss.scalars(select(Chunk)).all()
    assert doc.status == "done"
    assert [n for _, n in pages_in_db(db, doc.id)] == [1] * 4
    # The restart closed the killed watcher's run as crashed, and did not reuse it: its own run has the redone chunk.
    killed, restart = runs_in_db(db)
    assert (killed.end_reason, restart.end_reason) == ("crashed", "closed") and restart.finished_at is not None
    assert killed.finished_at is not None  # the time of its last stored page (or its start)
    redone = [c for c in chunks if c.id in {r.id for r in running}]
    assert all(c.run_id == restart.id for c in redone)
    # a chunk the killed worker held alone was charged that attempt; two held together were not, and went alone
    assert [(c.attempts, c.batch_limit) for c in redone] == ([(2, 1)] if len(running) == 1 else [(1, 1)] * 2)
    assert all(c.attempts == 1 for c in chunks if c not in redone)
    assert {(doc.id, i) for c in redone for i in c.pages} <= set(pages_of_run(db, restart.id))
    with db.session() as ss:  # decoded again while the dead worker's leases still had minutes left
        stored = max(p.created_at for p in ss.scalars(select(Page).where(Page.run_id == restart.id)))
    stored = stored if stored.tzinfo else stored.replace(tzinfo=timezone.utc)
    assert stored.timestamp() < min(c.lease_expires_at for c in running), "the restart waited for the dead leases"
    rep = json.loads(uflash("--config", str(cfg), "report", "--json", "--no-html").stdout)
    assert rep["run"]["id"] == restart.id
    assert sorted(p["index"] for d in rep["documents"] for p in d["pages"]) == \
        [i for _, i in pages_of_run(db, restart.id)]
    if pages_of_run(db, killed.id):
        assert "stopped by a crash after" in uflash("--config", str(cfg), "report", "--run", str(killed.id),
                                                    "--no-html").stdout
    assert "open:" not in uflash("--config", str(cfg), "status").stdout


def _rerun_chunks(ss, run_id, status):
    return ss.scalars(select(Chunk).where(Chunk.run_id == run_id, Chunk.status == status)
                      .order_by(Chunk.first_page)).all()


def _rerun_frozen(tmp_path, tiny_model_dir, pages_stored, ledger_url):
    """six.pdf decoded by `uflash run` (run 1, a chunk per page), then `uflash rerun --doc 1` started and frozen
    while it holds a chunk, once it stored ``pages_stored`` pages (run 2). Returns (cfg, settings, db, proc)."""
    cfg = worker_config(tmp_path, tiny_model_dir, engine={"max_tokens_per_page": 100, "max_pages_per_chunk": 1},
                        database={"url": ledger_url}, worker={"prepare_processes": 1})
    s = load_settings(cfg)
    s.ensure_folders()
    r = uflash("--config", str(cfg), "run", str(make_pdf(s.inbox / "six.pdf", 6)), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    db = Database(s.database_url)
    proc = start_uflash(cfg, "rerun", "--doc", "1")
    freeze_while(proc, db, lambda ss: len(ss.scalars(select(Page).where(Page.run_id == 2)).all())
                 >= pages_stored and _rerun_chunks(ss, 2, ChunkStatus.RUNNING))
    return cfg, s, db, proc


def test_a_rerun_killed_mid_way_is_closed_and_the_next_rerun_finishes_the_document(tmp_path, tiny_model_dir,
                                                                                   ledger_url):
    """`uflash rerun` killed (SIGKILL) after re-decoding two pages: its chunks stay reserved for a run nobody will
    continue. Before, they stayed pending for ever, and a later re-run of the same pages decoded them all but never
    rewrote the document (a pending chunk kept it from being finished). Now the next worker closes the killed run
    as crashed, cancels what it left (kept, with a note), and the document outputs show every page's latest text."""
    cfg, s, db, proc = _rerun_frozen(tmp_path, tiny_model_dir, pages_stored=2, ledger_url=ledger_url)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    with db.session() as ss:
        redone = sorted(ss.scalars(select(Page.page_index).where(Page.run_id == 2)).all())
    assert 2 <= len(redone) < 6
    st = uflash("--config", str(cfg), "status").stdout
    assert "open:      re-run 2 (lossless)" in st and "its process is gone" in st, st
    r = uflash("--config", str(cfg), "rerun", "--doc", "1", "--pages", f"{len(redone) + 1}-6", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "run 2 was left open by a uflash process that is gone: closed as crashed" in r.stderr
    with db.session() as ss:
        killed = ss.get(Run, 2)
        assert killed.end_reason == "crashed"
        assert killed.finished_at.replace(tzinfo=None) == max(
            p.created_at for p in ss.scalars(select(Page).where(Page.run_id == 2))).replace(tzinfo=None)
        cancelled = _rerun_chunks(ss, 2, ChunkStatus.CANCELLED)
        assert [c.first_page for c in cancelled] == list(range(len(redone) + 1, 7))
        assert all("`uflash rerun` again picks them" in c.note for c in cancelled)
        assert ss.scalar(select(func.count()).select_from(Chunk).where(
            Chunk.status.in_([ChunkStatus.QUEUED, ChunkStatus.RUNNING]))) == 0
    doc = json.loads((s.outbox / "six" / "document.json").read_text(encoding="utf-8"))
    assert [p["run_id"] for p in doc["pages"]] == [2] * len(redone) + [3] * (6 - len(redone))
    rep = uflash("--config", str(cfg), "report", "--run", "2").stdout
    assert "stopped by a crash after" in rep, rep
    assert "stopped by a crash after" in (s.outbox / "reports" / "run-2.html").read_text(encoding="utf-8")
    st = uflash("--config", str(cfg), "status").stdout
    assert "open:" not in st and "running:" not in st and "cancelled" in st, st


def test_a_rerun_stopped_by_a_signal_cancels_what_it_left_and_rewrites_the_document(tmp_path, tiny_model_dir,
                                                                                    ledger_url):
    """SIGTERM during `uflash rerun`: the chunk decoding is finished (one claimed ahead and not yet decoding is given
    back), the rest is cancelled (not left reserved for a closed run), the command says which pages were not re-run
    and exits 130, and the document shows the pages it did re-run."""
    cfg, s, db, proc = _rerun_frozen(tmp_path, tiny_model_dir, pages_stored=1, ledger_url=ledger_url)
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGCONT)
    assert proc.wait(timeout=120) == 130, "".join(proc.lines)
    proc.reader.join(timeout=10)
    out = "".join(proc.lines)
    with db.session() as ss:
        run = ss.get(Run, 2)
        redone = sorted(ss.scalars(select(Page.page_index).where(Page.run_id == 2)).all())
        cancelled = [c.first_page for c in _rerun_chunks(ss, 2, ChunkStatus.CANCELLED)]
    assert run.end_reason == "closed" and 1 <= len(redone) < 6, out
    assert redone + cancelled == list(range(1, 7))
    assert all(f"not run pages {i}-{i} of document 1: stopped before it was decoded" in out for i in cancelled), out
    doc = json.loads((s.outbox / "six" / "document.json").read_text(encoding="utf-8"))
    assert [p["run_id"] for p in doc["pages"]] == [2 if i in redone else 1 for i in range(1, 7)]


@pytest.mark.skipif(not (ROOT.parent / "shared" / "samples" / "real").is_dir(), reason="shared samples absent")
def test_real_world_files_through_the_worker(tmp_path, tiny_model_dir):
    samples = ROOT.parent / "shared" / "samples" / "real"
    cfg = worker_config(tmp_path, tiny_model_dir, engine={"max_tokens_per_page": 8})
    s = load_settings(cfg)
    s.ensure_folders()
    names = ["multipage.pdf", "cardinal.pdf", "ccitt.pdf", "jbig2.pdf", "typewriter.png", "no_contents.pdf",
             "invalid.pdf"]
    for n in names:  # copies: the worker archives what it takes, and the samples stay untouched
        shutil.copyfile(samples / n, s.inbox / n)
    r = uflash("--config", str(cfg), "run", timeout=600)
    assert r.returncode == 4, r.stdout + r.stderr  # invalid.pdf is refused, the rest is done
    assert "refused invalid.pdf" in r.stdout
    for n, pages in {"multipage": 6, "cardinal": 4, "ccitt": 1, "jbig2": 1, "typewriter": 1, "no_contents": 1}.items():
        doc = json.loads((s.outbox / n / "document.json").read_text(encoding="utf-8"))
        assert len(doc["pages"]) == pages
    assert (s.failed / "invalid.pdf.error.txt").exists()


def test_all_modes_give_the_same_pages(tmp_path, tiny_model_dir):
    """official (generate), plain and lossless (our engine) store identical token ids and texts."""
    texts = {}
    for mode in ("official", "plain", "lossless"):
        folder = tmp_path / mode
        folder.mkdir()
        cfg = worker_config(folder, tiny_model_dir, engine={"max_tokens_per_page": 60})
        s = load_settings(cfg)
        s.ensure_folders()
        pdf = make_pdf(s.inbox / "three.pdf", ["first page words", "second page", "third"])
        r = uflash("--config", str(cfg), "run", "--mode", mode, str(pdf), timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        doc = json.loads((s.outbox / "three" / "document.json").read_text(encoding="utf-8"))
        assert doc["run"]["mode"] == mode
        if mode != "official":
            assert {"verify_rounds", "tau", "backend", "draft_share", "drafters"} <= set(doc["pages"][0]["stats"]), \
                doc["pages"][0]["stats"]
        db = Database(s.database_url)
        with db.session() as ss:
            ids = [c.output_ids for c in ss.scalars(select(Chunk).order_by(Chunk.id))]
        texts[mode] = ([p["text"] for p in doc["pages"]], ids)
    assert texts["plain"] == texts["official"]
    assert texts["lossless"] == texts["official"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_outputs_that_cannot_be_written_fail_that_document_only(tmp_path, tiny_model_dir):
    """A file in the way of one document's output folder fails that document with the reason; the other is done,
    and a restart leaves it failed instead of crashing on it again. Nothing is lost: its pages stay in the ledger and
    its original goes to failed/ beside its reason. The outputs written get the mode a plain open() gives (not
    mkstemp's 0600)."""
    cfg = worker_config(tmp_path, tiny_model_dir)
    s = load_settings(cfg)
    s.ensure_folders()
    Image.new("RGB", (500, 300), "white").save(s.inbox / "typewriter.png")
    make_pdf(s.inbox / "letter.pdf", 2)
    (s.outbox / "typewriter").write_text("x\n", encoding="utf-8")  # a plain file where the folder would go
    r = uflash("--config", str(cfg), "run", timeout=600)
    assert r.returncode == 4, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "unexpected error" not in r.stderr, r.stderr
    assert "failed  typewriter.png: outputs could not be written: [Errno 17] File exists" in r.stdout
    assert "typewriter.png: outputs could not be written" in r.stderr, r.stderr
    r = uflash("--config", str(cfg), "run", timeout=600)  # the restart: the document is failed, not finalized again
    assert r.returncode == 0 and "nothing to do" in r.stdout, r.stdout + r.stderr
    assert "typewriter.png" not in r.stderr, r.stderr
    assert not (s.inbox / "typewriter.png").exists() and (s.failed / "typewriter.png").exists()
    assert "outputs could not be written" in (s.failed / "typewriter.png.error.txt").read_text(encoding="utf-8")
    assert (s.outbox / "typewriter").read_text(encoding="utf-8") == "x\n"
    db = Database(s.database_url)
    with db.session() as ss:
        tw = ss.scalar(select(Document).where(Document.original_name == "typewriter.png"))
        letter = ss.scalar(select(Document).where(Document.original_name == "letter.pdf"))
    assert tw.status == "failed" and tw.archived_path is None and tw.output_dir is None
    assert tw.failed_path == str(s.failed / "typewriter.png")
    assert [n for _, n in pages_in_db(db, tw.id)] == [1], "its pages stay in the ledger"
    assert letter.status == "done" and (s.archive / "letter.pdf").exists()
    st = uflash("--config", str(cfg), "status").stdout
    assert f"#{tw.id} typewriter.png: outputs could not be written" in st
    for name in ("document.md", "document.json"):
        assert (s.outbox / "letter" / name).stat().st_mode & 0o777 == 0o666 & ~_umask()


def test_original_that_cannot_be_archived_fails_that_document(tmp_path, tiny_model_dir):
    """Archiving is guarded the same way: the outputs are written, the document is failed with the reason, the
    original goes to failed/ beside its reason, and the worker goes on."""
    cfg = worker_config(tmp_path, tiny_model_dir)
    s = load_settings(cfg)
    s.ensure_folders()
    db = Database(s.database_url)
    doc = intake_file(db, s, make_pdf(s.inbox / "memo.pdf", 1)).document_id
    s.archive.rmdir()
    s.archive.write_text("not a folder\n", encoding="utf-8")
    worker = Worker(s, db, lambda: OfficialDecoder(load_model(str(tiny_model_dir), "cpu", "float32")))
    serve_until_done(worker, db)
    with db.session() as ss:
        d = ss.get(Document, doc)
    assert d.status == "failed" and "but the original could not be archived: [Errno 17] File exists" in d.error
    assert d.output_dir == str(s.outbox / "memo") and (s.outbox / "memo" / "document.md").exists()
    assert not (s.inbox / "memo.pdf").exists() and (s.failed / "memo.pdf").exists()
    assert d.error in (s.failed / "memo.pdf.error.txt").read_text(encoding="utf-8")
    serve_until_done(Worker(s, db, lambda: None), db)  # a restart leaves it failed, without touching the model


def test_worker_says_once_whose_lease_it_waits_for(tmp_path, ledger_url):
    """A chunk held by another (e.g. a crashed) worker's lease: the idle worker logs the owner and the expiry once
    per wait, not at every poll, and again when a new wait begins."""
    from loguru import logger

    s = load_settings(write_config(tmp_path, worker={"poll_seconds": 0.05}, database={"url": ledger_url}))
    s.ensure_folders()
    db = Database(s.database_url)
    intake_file(db, s, make_pdf(s.inbox / "held.pdf", 1))
    expires = time.time() + 300

    def lease(until: float) -> None:
        with db.engine.begin() as conn:
            conn.execute(Chunk.__table__.update().values(status=ChunkStatus.RUNNING, lease_owner="deadhost:4242",
                                                         lease_expires_at=until, attempts=1))

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO", format="{message}")
    worker = Worker(s, db, lambda: None)  # never decodes: nothing is claimable
    try:
        for _ in range(2):
            lease(expires)
            polls = iter(range(4))
            worker.serve(threading.Event(), until=lambda polls=polls: next(polls, None) is None)  # 4 idle polls
            lease(time.time() - 1)  # the lease ends: the next wait is a new one
            worker._log_leased()
    finally:
        logger.remove(sink)
    waits = [ln for ln in lines if ln.startswith("waiting for")]
    assert len(waits) == 2, lines
    until = datetime.fromtimestamp(expires).strftime("%H:%M:%S")
    assert all(w.startswith(f"waiting for 1 chunk(s) leased by deadhost:4242 until {until} (in ") for w in waits)


# -- which chunks a `uflash run` takes, and one run per invocation -------------------------------------------------

def runs_in_db(db):
    with db.session() as ss:
        return ss.scalars(select(Run).order_by(Run.id)).all()


def pages_of_run(db, run_id):
    with db.session() as ss:
        return ss.execute(select(Page.document_id, Page.page_index).where(Page.run_id == run_id)
                          .order_by(Page.document_id, Page.page_index)).all()


def test_run_decodes_only_the_named_files_and_each_run_is_its_own(tmp_path, tiny_model_dir, ledger_url):
    """A 5-page document queued earlier (here: from a shelf outside the inbox, as an interrupted `uflash run` leaves
    it) and `uflash run small.pdf`: only small.pdf is decoded, the progress bar counts its one page, the backlog
    stays queued untouched and is named. Then `uflash run` with no files and an empty inbox takes the backlog, in a
    second run; each run is closed and its report shows its own pages only; a third finds nothing to do."""
    cfg = worker_config(tmp_path, tiny_model_dir, engine={"max_pages_per_chunk": 2, "max_tokens_per_page": 8},
                        database={"url": ledger_url})
    s = load_settings(cfg)
    s.ensure_folders()
    db = Database(s.database_url)
    big = intake_file(db, s, make_pdf(tmp_path / "shelf" / "big.pdf", 5)).document_id  # 3 chunks, queued
    small_pdf = make_pdf(tmp_path / "shelf" / "small.pdf", ["One page."])

    r = uflash("--config", str(cfg), "run", str(small_pdf), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "done    small.pdf: 1 page -> " in r.stdout
    assert "queued  1 document (3 chunks) more wait in the ledger" in r.stdout, r.stdout
    bars = re.findall(r"(\d+)/(\d+) \[", r.stderr)
    assert bars and bars[-1] == ("1", "1") and all(int(n) <= int(t) for n, t in bars), r.stderr
    with db.session() as ss:
        small = ss.scalar(select(Document.id).where(Document.original_name == "small.pdf"))
        backlog = ss.scalars(select(Chunk).where(Chunk.document_id == big)).all()
        assert ss.get(Document, big).status == "queued"
    assert [(c.status, c.attempts) for c in backlog] == [(ChunkStatus.QUEUED, 0)] * 3
    (run1,) = runs_in_db(db)
    assert run1.finished_at is not None
    assert pages_of_run(db, run1.id) == [(small, 1)]
    report1 = s.outbox / "reports" / f"run-{run1.id}.html"
    assert f"report  {report1}" in r.stdout
    html1 = report1.read_text(encoding="utf-8")
    assert html1.count("data:image/jpeg;base64,") == 1 and "big.pdf" not in html1

    r = uflash("--config", str(cfg), "run", timeout=600)  # no files, empty inbox: the backlog
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"taking 1 document (3 chunks) already queued in the ledger (the inbox {s.inbox} is empty)" in r.stdout
    assert "done    big.pdf: 5 pages" in r.stdout and "queued  " not in r.stdout
    run1_again, run2 = runs_in_db(db)
    assert run1_again.finished_at == run1.finished_at and run2.finished_at is not None
    assert pages_of_run(db, run2.id) == [(big, i) for i in range(1, 6)]
    html2 = (s.outbox / "reports" / f"run-{run2.id}.html").read_text(encoding="utf-8")
    assert html2.count("data:image/jpeg;base64,") == 5 and "small.pdf" not in html2
    assert report1.read_text(encoding="utf-8") == html1, "an earlier run's report is left as it was"
    rep = json.loads(uflash("--config", str(cfg), "report", "--json", "--no-html").stdout)  # default: latest run
    assert rep["run"]["id"] == run2.id and rep["pages"] == 5 and rep["run"]["finished_at"]

    r = uflash("--config", str(cfg), "run", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nothing to do: no files given" in r.stdout and "no document is queued" in r.stdout
    assert "report  " not in r.stdout and len(runs_in_db(db)) == 2  # nothing decoded: no run, no report


def test_each_watch_process_is_its_own_run_closed_on_sigterm_and_sigint(tmp_path, tiny_model_dir, ledger_url):
    """Two `uflash watch` processes one after the other, each given one file: two runs, each closed when its
    process stops (SIGTERM, then SIGINT), each holding its own document's pages only."""
    cfg = worker_config(tmp_path, tiny_model_dir, engine={"max_tokens_per_page": 8}, database={"url": ledger_url},
                        worker={"prepare_processes": 1})
    s = load_settings(cfg)
    s.ensure_folders()
    db = Database(s.database_url)
    for name, sig in (("first", signal.SIGTERM), ("second", signal.SIGINT)):
        proc = start_uflash(cfg, "watch")
        try:
            make_pdf(tmp_path / "drop" / f"{name}.pdf", 2).rename(s.inbox / f"{name}.pdf")
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and proc.poll() is None:
                with db.session() as ss:
                    if ss.scalar(select(Document.status).where(Document.original_name == f"{name}.pdf")) == "done":
                        break
                time.sleep(0.2)
            proc.send_signal(sig)
            assert proc.wait(timeout=60) == 0, "".join(proc.lines)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    first, second = runs_in_db(db)
    assert first.finished_at is not None and second.finished_at is not None and second.started_at > first.finished_at
    with db.session() as ss:
        ids = dict(ss.execute(select(Document.original_name, Document.id)).all())
    assert pages_of_run(db, first.id) == [(ids["first.pdf"], 1), (ids["first.pdf"], 2)]
    assert pages_of_run(db, second.id) == [(ids["second.pdf"], 1), (ids["second.pdf"], 2)]


def test_a_long_running_watch_closes_a_run_and_writes_its_report_each_time_the_queue_runs_dry(tmp_path,
                                                                                              tiny_model_dir):
    """One `uflash watch` process, two batches dropped one after the other: two runs, each closed when the queue
    ran dry (the process still running), each with its own HTML report of its own pages."""
    cfg = worker_config(tmp_path, tiny_model_dir, engine={"max_tokens_per_page": 8}, worker={"poll_seconds": 0.5})
    s = load_settings(cfg)
    s.ensure_folders()
    db = Database(s.database_url)
    proc = start_uflash(cfg, "watch")
    try:
        for n, name in enumerate(("evening", "morning"), start=1):
            make_pdf(tmp_path / "drop" / f"{name}.pdf", 2).rename(s.inbox / f"{name}.pdf")
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and proc.poll() is None:
                runs = runs_in_db(db)
                if len(runs) == n and runs[-1].finished_at is not None:
                    break
                time.sleep(0.2)
            assert proc.poll() is None, "".join(proc.lines)
            run = runs_in_db(db)[-1]
            assert run.finished_at is not None, "".join(proc.lines)
            assert wait_until(lambda run=run: (s.outbox / "reports" / f"run-{run.id}.html").exists(), 60)
            html = (s.outbox / "reports" / f"run-{run.id}.html").read_text(encoding="utf-8")
            assert f"{name}.pdf" in html and ("evening.pdf" not in html or name == "evening")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    first, second = runs_in_db(db)
    with db.session() as ss:
        ids = dict(ss.execute(select(Document.original_name, Document.id)).all())
    assert pages_of_run(db, first.id) == [(ids["evening.pdf"], 1), (ids["evening.pdf"], 2)]
    assert pages_of_run(db, second.id) == [(ids["morning.pdf"], 1), (ids["morning.pdf"], 2)]


def test_a_queued_file_replaced_under_the_same_name_is_not_decoded_as_the_old_document(tmp_path, tiny_model_dir):
    """The inbox file of a queued document overwritten by another scan (same name) before it was decoded: the old
    document fails with that reason (its content is gone) instead of getting the new pages under its name and
    checksum, and the new content becomes a document of its own, decoded and archived."""
    from ingest.intake.enqueue import intake_file

    cfg = worker_config(tmp_path, tiny_model_dir)
    s = load_settings(cfg)
    s.ensure_folders()
    db = Database(s.database_url)
    akte = make_pdf(s.inbox / "akte.pdf", ["The first scan."])
    old = intake_file(db, s, akte)
    touched = akte.stat()
    os.utime(akte, ns=(touched.st_atime_ns, touched.st_mtime_ns + 10**9))  # touched in place: still the same file
    replacement = make_pdf(tmp_path / "other.pdf", ["A different scan.", "With two pages."]).read_bytes()
    r = uflash("--config", str(cfg), "run", timeout=600)  # no files: the inbox and the ledger's backlog
    assert r.returncode == 0, r.stdout + r.stderr  # the touched file is decoded as its document
    with db.session() as ss:
        assert ss.get(Document, old.document_id).status == DocStatus.DONE
    second = make_pdf(s.inbox / "akte2.pdf", ["Yet another scan."])
    queued = intake_file(db, s, second)
    second.write_bytes(replacement)  # overwritten before any worker ran
    r = uflash("--config", str(cfg), "run", timeout=600)
    assert r.returncode == 4, r.stdout + r.stderr  # one document failed
    with db.session() as ss:
        gone = ss.get(Document, queued.document_id)
        new = ss.scalar(select(Document).where(Document.id > queued.document_id))
    assert gone.status == DocStatus.FAILED and "replaced by other content" in gone.error
    assert gone.failed_path == "" and not any(s.failed.iterdir()), "the file at its path is another document's"
    assert new is not None and new.status == DocStatus.DONE and new.page_count == 2
    doc = json.loads((Path(new.output_dir) / "document.json").read_text(encoding="utf-8"))
    assert doc["document"]["sha256"] == new.sha256 != gone.sha256 and len(doc["pages"]) == 2


class RunawayDecoder:
    """A scripted decoder: every page reads as ``p<n>`` except ``runaway``, which never ends (the output is cut at
    the limit on it, as by a model caught in a loop). Records the pages of every decode, and counts the orientation
    probes (one page read for ``probe_tokens``) apart."""

    mode, model_name, device = "official", "runaway", "cpu"

    def __init__(self, pdf: Path, n: int, runaway: int):
        self.page_of = {p.image.tobytes(): p.index for p in render_pages(pdf, "pdf", 1, n)}
        self.runaway, self.calls, self.probes = runaway, [], 0

    def describe(self):
        return {}

    def free_memory(self):
        pass

    def decode(self, images, context_limit, max_new_tokens=None, **hints):
        if max_new_tokens == OrientationSettings().probe_tokens:  # an orientation probe: reads nothing in particular
            self.probes += 1
            return assemble(_fake_result("<PAGE>probe", "length"), 1, hit_context=False)
        pages = [self.page_of[im.tobytes()] for im in images]
        self.calls.append(pages)
        text = ""
        for n in pages:
            text += "<PAGE>" + (f"p{n}" if n != self.runaway else "loop " * 50)
            if n == self.runaway:
                return assemble(_fake_result(text, "length"), len(pages), hit_context=True)
        return assemble(_fake_result(text, "eos"), len(pages), hit_context=False)


def test_a_runaway_page_goes_back_alone_and_its_neighbours_are_decoded_once(tmp_path, tiny_model_dir):
    """Page 3 runs away: it goes back alone, and pages 4-6 as a chunk of their own. Page 5 was scanned sideways:
    it is probed once (three probes), not again when its chunk comes back."""
    cfg = worker_config(tmp_path, tiny_model_dir, engine={"max_pages_per_chunk": 6})
    s = load_settings(cfg)
    s.ensure_folders()
    db = Database(s.database_url)
    lines = "\n".join(f"Line {i}: the council met on Tuesday and agreed the budget for the year {1900 + i}."
                      for i in range(30))
    pdf = make_pdf(s.inbox / "six.pdf", ["p1", "p2", "p3", "p4", lines, "p6"])
    with pymupdf.open(pdf) as d:  # page 5's lines run up and down, as on a sheet scanned sideways
        d[4].set_rotation(90)
        d.saveIncr()
    doc = intake_file(db, s, pdf).document_id
    decoder = RunawayDecoder(pdf, 6, runaway=3)
    serve_until_done(Worker(s, db, lambda: decoder), db)
    # before: [3-6] again, then halves [3-4], [5-6], then [3], [4]: pages 4-6 decoded three times each. Page 5's
    # scripted reading ("p5") is far shorter than its print: the checks catch it and it is read again alone, once
    assert sorted(decoder.calls) == [[1, 2, 3, 4, 5, 6], [3], [4, 5, 6], [5]]
    assert decoder.probes == 3  # as it is, 90, 270: in the first chunk only
    assert [n for _, n in pages_in_db(db, doc)] == [1] * 6
    with db.session() as ss:
        assert ss.get(Document, doc).status == "done"
        (page3,) = ss.scalars(select(Page).where(Page.document_id == doc, Page.page_index == 3)).all()
        (split,) = ss.scalars(select(Chunk).where(Chunk.document_id == doc, Chunk.status == ChunkStatus.SPLIT)).all()
    assert page3.stats["finish_reason"] == "context_limit" and page3.text.startswith("loop loop")
    assert split.note == "output reached the context limit; pages 3-3, 4-6 re-queued"


def test_a_rerun_rewrites_the_outputs_where_the_document_was_written(tmp_path, tiny_model_dir, ledger_url):
    """`uflash run --out DIR`, then `uflash rerun`: the re-run rewrites DIR/<stem>, not a second copy in the outbox
    (before, the outbox got the new text and DIR kept the old). When that folder's parent is gone, or another
    document has taken the folder, a folder of its own in the outbox."""
    cfg = worker_config(tmp_path, tiny_model_dir, engine={"max_tokens_per_page": 8}, database={"url": ledger_url})
    s = load_settings(cfg)
    s.ensure_folders()
    out = tmp_path / "share"
    r = uflash("--config", str(cfg), "run", "--out", str(out), str(make_pdf(s.inbox / "deeds.pdf", 2)), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    r = uflash("--config", str(cfg), "rerun", "--doc", "1", "--mode", "plain", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((out / "deeds" / "document.json").read_text(encoding="utf-8"))["run"]["id"] == 2
    assert not (s.outbox / "deeds").exists()
    db = Database(s.database_url)
    with db.session() as ss:
        assert ss.get(Document, 1).output_dir == str(out / "deeds")
    shutil.rmtree(out)  # the share is gone
    r = uflash("--config", str(cfg), "rerun", "--doc", "1", "--mode", "plain", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((s.outbox / "deeds" / "document.json").read_text(encoding="utf-8"))["run"]["id"] == 3
    assert f"{out / 'deeds'}, where its outputs were written before, is gone" in r.stderr
    with db.session() as ss:
        assert ss.get(Document, 1).output_dir == str(s.outbox / "deeds")
    # its folder deleted, and another document's outputs written there since (deeds.png: the archive has no file of
    # that name): the re-run does not overwrite them, and takes the next name, as its archived original would
    shutil.rmtree(s.outbox / "deeds")
    Image.new("RGB", (300, 200), "white").save(s.inbox / "deeds.png")
    r = uflash("--config", str(cfg), "run", str(s.inbox / "deeds.png"), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    r = uflash("--config", str(cfg), "rerun", "--doc", "1", "--mode", "plain", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((s.outbox / "deeds" / "document.json").read_text(encoding="utf-8"))["document"]["id"] == 2
    with db.session() as ss:
        moved = Path(ss.get(Document, 1).output_dir)
    assert moved == s.outbox / "deeds (2)" and json.loads((moved / "document.json").read_text())["run"]["id"] == 5
