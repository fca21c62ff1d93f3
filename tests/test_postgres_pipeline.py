"""The whole pipeline on a real PostgreSQL server: `uflash watch` workers taking files from the inbox to their outputs,
two of them at once on one ledger, and the database server stopped in the middle of a batch and started again."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from db.models import Chunk, ChunkStatus, Document, Duplicate, Page, Rejected, Run
from db.session import Database
from ingest.config import load_settings
from tests.conftest import DEMO, ROOT, fresh_pg_database, make_pdf, needs_demo, uflash, wait_until, worker_config
from tests.pg_server import start_postgres

OUTAGE_S = 30  # how long the database server stays down in the middle of a batch


def start_watch(cfg: Path) -> subprocess.Popen:
    """``uflash watch`` as a child process; its output lines collect in ``proc.lines``."""
    proc = subprocess.Popen([sys.executable, "-m", "ingest.commands.cli", "--config", str(cfg), "watch"], cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    proc.lines = []
    proc.reader = threading.Thread(target=lambda: proc.lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    proc.reader.start()
    return proc


def stop_watch(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    proc.reader.join(timeout=10)
    out = "".join(proc.lines)
    assert code == 0, out
    return out


def documents_by_status(db: Database) -> dict[str, int]:
    try:
        with db.session() as s:
            return dict(s.execute(select(Document.status, func.count()).group_by(Document.status)).all())
    except Exception:  # the server is down
        return {}


def texts_by_name(db: Database) -> dict[tuple[str, int], str]:
    """(file name, page index) -> the page's latest text."""
    with db.session() as s:
        latest = select(func.max(Page.id)).group_by(Page.document_id, Page.page_index)
        rows = s.execute(select(Document.original_name, Page.page_index, Page.text)
                         .join(Document, Document.id == Page.document_id).where(Page.id.in_(latest))).all()
    return {(name, i): text for name, i, text in rows}


def pages_stored_twice(db: Database) -> list:
    with db.session() as s:
        return s.execute(select(Page.document_id, Page.page_index, func.count()).group_by(
            Page.document_id, Page.page_index).having(func.count() > 1)).all()


@pytest.fixture
def own_pg_server():
    """A PostgreSQL server of this test's own, to stop and start again."""
    server = start_postgres(Path(tempfile.mkdtemp(prefix="uflash-pg-")))
    if server is None:
        pytest.skip("PostgreSQL server binaries not installed (.ci/run installs them)")
    yield server
    server.stop()
    shutil.rmtree(server.folder, ignore_errors=True)


def test_the_database_stopped_mid_batch_rejects_nothing_and_loses_nothing(tmp_path, tiny_model_dir, own_pg_server):
    """`uflash watch` decodes a batch on PostgreSQL; the server is stopped (immediate shutdown, as a crash) once the
    first pages are stored, kept down OUTAGE_S seconds while more files arrive, and started again. No good file is
    rejected or moved, `uflash status` says what is wrong meanwhile, the watcher survives, and after the server is
    back every document is done with each page stored once; only the file that is bad in itself is refused."""
    server = own_pg_server
    _, url = fresh_pg_database(server)
    cfg = worker_config(tmp_path, tiny_model_dir, database={"url": url},
                        engine={"max_pages_per_chunk": 1, "max_tokens_per_page": 100},
                        watch={"settle_seconds": 0.3, "rescan_seconds": 1.0})
    s = load_settings(cfg)
    s.ensure_folders()
    for i in range(6):
        make_pdf(s.inbox / f"before{i}.pdf", [f"register {i} page one", f"register {i} page two"])
    db = Database(url)
    proc = start_watch(cfg)
    try:
        assert wait_until(lambda: _pages(db) >= 2, timeout=180), "".join(proc.lines)
        server.stop()
        down_at = time.monotonic()
        assert _pages(db) is None, "the server should be down"
        stored_before = len([line for line in proc.lines if "tok/s), finish" in line])
        for i in range(2):  # files dropped while the ledger is down wait in the inbox
            make_pdf(s.inbox / f"during{i}.pdf", [f"letter {i} page one", f"letter {i} page two"])
        (s.inbox / "bad.pdf").write_bytes(b"this is not a PDF at all\n" * 40)
        assert wait_until(lambda: any("TROUBLE" in line for line in _status_lines(cfg)), timeout=OUTAGE_S / 2)
        st = uflash("--config", str(cfg), "status")
        assert st.returncode == 5 and "the ledger cannot be read: the ledger failed: OperationalError" in st.stdout, \
            st.stdout + st.stderr
        assert "TROUBLE:   " in st.stdout
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))
        assert proc.poll() is None, "the watcher must survive the database going away"
        assert {"during0.pdf", "during1.pdf", "bad.pdf"} <= {p.name for p in s.inbox.iterdir()}
        assert not any(s.failed.iterdir()), "nothing is refused while the ledger is down"
        server.start()
        assert wait_until(lambda: documents_by_status(db).get("done") == 8, timeout=240), \
            (documents_by_status(db), "".join(proc.lines[-40:]))
        assert wait_until(lambda: (s.failed / "bad.pdf.error.txt").exists(), timeout=30)
    finally:
        out = stop_watch(proc)
    (tmp_path / "watch.out").write_text(out)
    assert "Traceback" not in out, out
    assert "working again after" in out, out
    stored = len([line for line in out.splitlines() if "tok/s), finish" in line])  # one line per chunk stored
    assert stored_before < stored <= 16, (stored_before, stored)  # stored after the outage too, none stored twice
    assert sorted(p.name for p in s.failed.iterdir()) == ["bad.pdf", "bad.pdf.error.txt"]
    assert "not a PDF" in (s.failed / "bad.pdf.error.txt").read_text(encoding="utf-8")
    assert not any(s.inbox.iterdir())
    assert sorted(p.name for p in s.archive.iterdir() if p.is_file()) == sorted(
        [f"before{i}.pdf" for i in range(6)] + ["during0.pdf", "during1.pdf"])
    with db.session() as ss:
        chunks = ss.scalars(select(Chunk)).all()
        assert ss.scalar(select(func.count()).select_from(Rejected)) == 1
        assert ss.scalar(select(func.count()).select_from(Page)) == 16
    assert all(c.status == ChunkStatus.DONE for c in chunks) and len(chunks) == 16
    assert max(c.attempts for c in chunks) <= 2  # a chunk in hand when the server went away: stored or redone once
    assert pages_stored_twice(db) == []
    assert all((s.outbox / f"{stem}" / "document.md").exists() for stem in ("before0", "during1"))
    st = uflash("--config", str(cfg), "status").stdout
    assert "last infrastructure error: " in st and "TROUBLE" not in st, st
    db.dispose()


def _pages(db: Database) -> int | None:
    try:
        with db.session() as s:
            return s.scalar(select(func.count()).select_from(Page))
    except Exception:
        return None


def _status_lines(cfg: Path) -> list[str]:
    return uflash("--config", str(cfg), "status").stdout.splitlines()


BURST = 20


def _burst(folder: Path) -> list[Path]:
    """20 small letters, 5 of them of 2 pages, each page with its own words (so that a page read for another shows)."""
    words = ["parish", "harbour", "tithe", "orchard", "mill", "ledger", "bridge", "chapel", "granary", "ferry"]
    files = []
    for i in range(BURST):
        pages = [f"Letter {i}. The {words[i % 10]} of {words[(i + 3) % 10]} was sold in {1850 + i}."]
        if i % 4 == 0:
            pages.append(f"Letter {i}, page 2. Witnessed by the {words[(i + 5) % 10]} clerk.")
        files.append(make_pdf(folder / f"letter{i:02d}.pdf", pages))
    return files


@needs_demo
def test_two_watch_workers_on_postgresql_take_a_burst_of_20_documents(tmp_path, pg_server):
    """Two `uflash watch` processes on one PostgreSQL ledger and one shared inbox, 20 documents dropped at once: all
    are done, both workers decode, each page is stored once, and the texts equal those of one `uflash run` on a
    SQLite ledger of the same files (the demo model on the CPU, decoding is deterministic)."""
    stage = tmp_path / "stage"
    files = _burst(stage)
    # a chunk per page, 32 tokens each (the demo model reads the letter's number within them): ~25 decodes a side
    engine = {"max_tokens_per_page": 32, "max_pages_per_chunk": 1}
    # the reference: one worker, SQLite
    one = tmp_path / "sqlite"
    one.mkdir()
    cfg_one = worker_config(one, DEMO, engine=engine)
    s_one = load_settings(cfg_one)
    s_one.ensure_folders()
    for f in files:
        shutil.copyfile(f, s_one.inbox / f.name)
    started = time.monotonic()
    r = uflash("--config", str(cfg_one), "run", timeout=900)
    one_worker_s = time.monotonic() - started
    assert r.returncode == 0, r.stdout + r.stderr
    # two workers, PostgreSQL
    _, url = fresh_pg_database(pg_server)
    two = tmp_path / "postgresql"
    two.mkdir()
    cfg_two = worker_config(two, DEMO, engine=engine, database={"url": url},
                            watch={"settle_seconds": 0.5, "rescan_seconds": 1.0}, worker={"lease_seconds": 60.0})
    s_two = load_settings(cfg_two)
    s_two.ensure_folders()
    procs = [start_watch(cfg_two) for _ in range(2)]
    db = Database(url)
    try:
        assert wait_until(lambda: all(any("watching" in line for line in p.lines) for p in procs), timeout=120)
        started = time.monotonic()
        for f in files:  # the burst
            shutil.copyfile(f, s_two.inbox / f.name)
        assert wait_until(lambda: documents_by_status(db).get("done") == BURST, timeout=900), \
            (documents_by_status(db), [p.lines[-20:] for p in procs])
        two_workers_s = time.monotonic() - started
    finally:
        outs = [stop_watch(p) for p in procs]
    assert all("Traceback" not in out for out in outs)
    print(f"one worker on SQLite {one_worker_s:.0f} s (with its model load); two on PostgreSQL {two_workers_s:.0f} s")
    reference = texts_by_name(Database(s_one.database_url))
    assert len(reference) == sum(1 + (i % 4 == 0) for i in range(BURST)) == 25
    assert len(set(reference.values())) == 25, "each page's text is its own: a page stored for another would show"
    assert texts_by_name(db) == reference
    assert pages_stored_twice(db) == []
    with db.session() as ss:
        assert ss.scalar(select(func.count()).select_from(Page)) == 25
        assert ss.scalar(select(func.count()).select_from(Rejected)) == 0
        assert ss.scalar(select(func.count()).select_from(Duplicate)) == 0
        owners = ss.scalars(select(Run.owner).join(Page, Page.run_id == Run.id).distinct()).all()
    assert len(set(owners)) == 2, "both workers should have decoded pages"
    assert not any(s_two.inbox.iterdir()) and not any(s_two.failed.iterdir())
    assert len([p for p in s_two.archive.iterdir() if p.is_file()]) == BURST
    db.dispose()
