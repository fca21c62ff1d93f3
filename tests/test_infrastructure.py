"""Errors of the ledger or of the machine are not the file's fault: classified in one place, never a reason to reject
a file, waited out with a backoff, and shown by `uflash status`, even with the ledger down."""

from __future__ import annotations

import errno
import json
import sqlite3
import time

import pytest
from sqlalchemy import event, select
from sqlalchemy.exc import DataError, IntegrityError, InterfaceError, OperationalError

from db.models import Document, Rejected
from db.session import Database
from ingest.errors import InputRejected, infrastructure_problem
from ingest.intake.watch import InboxWatcher
from ingest.ledger.health import Trouble, format_trouble, read_trouble
from tests.conftest import make_pdf, uflash, write_config


def test_ledger_and_machine_errors_are_told_apart_from_file_errors():
    locked = OperationalError("INSERT ...", {}, sqlite3.OperationalError("database is locked"))
    assert infrastructure_problem(locked) == "the ledger failed: OperationalError: database is locked"
    assert "out of range" in infrastructure_problem(DataError("SELECT", {}, Exception("integer out of range")))
    assert infrastructure_problem(InterfaceError("SELECT", {}, Exception("connection already closed"))) == \
        "the ledger failed: Exception: connection already closed"
    assert infrastructure_problem(IntegrityError("INSERT", {}, Exception("duplicate key"))) == \
        "the ledger failed: Exception: duplicate key"  # the ledger's, not the file's
    assert infrastructure_problem(sqlite3.OperationalError("disk I/O error")) == \
        "the ledger failed: OperationalError: disk I/O error"  # a driver error SQLAlchemy did not wrap
    full = OSError(errno.ENOSPC, "No space left on device", "/var/uflash/outbox/x/document.pdf")
    assert infrastructure_problem(full) == "the machine failed: No space left on device (/var/uflash/outbox/x/document.pdf)"
    assert infrastructure_problem(OSError(errno.EIO, "Input/output error")) == "the machine failed: Input/output error"
    for the_files in (InputRejected("not a PDF"), FileNotFoundError(errno.ENOENT, "gone"),
                      PermissionError(errno.EACCES, "denied"), ValueError("cannot parse"), RuntimeError("mupdf"),
                      MemoryError()):
        assert infrastructure_problem(the_files) is None, the_files


def _watcher(settings, db):
    """The inbox watcher, retrying every 0.1 s when the ledger or the machine fails."""
    return InboxWatcher(settings, db, trouble=Trouble(settings.logs, "intake", backoff=(0.1,)))


def _poll_until(watcher, done, timeout: float = 120) -> list:
    """Poll the watcher until ``done(results so far)`` holds (a generous deadline: a busy machine is slow, never
    wrong); the results."""
    results, end = [], time.monotonic() + timeout
    while not done(results):
        assert time.monotonic() < end, f"timed out; results so far: {results}"
        results += watcher.poll()
        time.sleep(0.05)
    return results


def _outcomes(results) -> list[str]:
    return [r.outcome for r in results]


@pytest.fixture
def quick_settings(tmp_path):
    from ingest.config import load_settings

    s = load_settings(write_config(tmp_path, watch={"settle_seconds": 0.0, "rescan_seconds": 0.2}))
    s.ensure_folders()
    return s


def test_a_ledger_locked_past_its_timeout_rejects_no_file(quick_settings):
    """Another process holds the SQLite ledger's write lock longer than the busy timeout: every intake fails with
    'database is locked', many more times than a file's own errors are allowed (5), and still no file is refused or
    moved, an unsupported file included; the trouble is recorded where `uflash status` reads it. Once the lock is
    released, the files are taken in (and the unsupported one refused for what it is)."""
    s = quick_settings
    db = Database(s.database_url, busy_timeout_ms=100)
    make_pdf(s.inbox / "good.pdf", 2)
    (s.inbox / "notes.txt").write_text("not a scan")
    blocker = sqlite3.connect(s.database_url[len("sqlite:///"):], isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        watcher = _watcher(s, db)
        assert _poll_until(watcher, lambda _: watcher.trouble.tries > InboxWatcher.MAX_ERRORS) == []
        assert sorted(p.name for p in s.inbox.iterdir()) == ["good.pdf", "notes.txt"]
        assert not any(s.failed.iterdir())
        (rec,) = read_trouble(s.logs)
        assert rec["loop"] == "intake" and rec["over_at"] is None and "database is locked" in rec["problem"]
        assert rec["tries"] == watcher.trouble.tries
        assert format_trouble([rec])[0].startswith("TROUBLE:   intake of ")
    finally:
        blocker.rollback()
        blocker.close()
    outcomes = _outcomes(_poll_until(watcher, lambda res: "known" in _outcomes(res)))  # good.pdf looked at again
    assert (outcomes.count("document"), outcomes.count("rejected")) == (1, 1)  # then "known": it waits to be decoded
    assert sorted(p.name for p in s.failed.iterdir()) == ["notes.txt", "notes.txt.error.txt"]
    (rec,) = read_trouble(s.logs)
    assert rec["over_at"] is not None
    assert format_trouble([rec])[0].startswith("last infrastructure error: intake of ")
    db.dispose()


def test_a_full_disk_under_the_ledger_rejects_no_file(quick_settings):
    """SQLite's own 'database or disk is full' (the ledger capped at its current size): the file waits in the inbox;
    once there is room again it is taken in."""
    s = quick_settings
    db = Database(s.database_url)
    with db.session() as ss, ss.begin():  # a document whose long path leaves no room on the table's (and index's) page
        ss.add(Document(sha256="f" * 64, original_path="/" + "x" * 3500, original_name="filler.pdf", size_bytes=1,
                        mtime_ns=1, kind="pdf", page_count=1, status="done"))
    full = {"on": True}

    @event.listens_for(db.engine, "connect")
    def _cap(dbapi_conn, _record):  # noqa: ANN001
        if full["on"]:
            pages = dbapi_conn.execute("PRAGMA page_count").fetchone()[0]
            dbapi_conn.execute(f"PRAGMA max_page_count = {pages}")

    db.engine.dispose()
    for i in range(3):
        make_pdf(s.inbox / f"scan{i}.pdf", [f"page of scan {i} " * 200] * 3)
    watcher = _watcher(s, db)
    taken = _outcomes(_poll_until(watcher, lambda _: watcher.trouble.tries > InboxWatcher.MAX_ERRORS))
    assert set(taken) <= {"document", "known"} and taken.count("document") < 3  # the ledger took what had room
    assert "database or disk is full" in read_trouble(s.logs)[0]["problem"]
    assert read_trouble(s.logs)[0]["over_at"] is None  # reads that work are no sign that the ledger takes writes
    assert len(list(s.inbox.iterdir())) == 3 and not any(s.failed.iterdir())
    full["on"] = False
    db.engine.dispose()
    seen_again = lambda res: len({r.document_id for r in res if r.outcome == "known"}) == 3  # noqa: E731
    later = _outcomes(_poll_until(watcher, seen_again))  # every file in the ledger, and looked at again since
    assert later.count("document") == 3 - taken.count("document")
    assert read_trouble(s.logs)[0]["over_at"] is not None
    with db.session() as ss:
        assert ss.scalar(select(Rejected)) is None and len(ss.scalars(select(Document)).all()) == 1 + 3
    db.dispose()


def test_status_says_what_is_wrong_while_the_ledger_is_down(tmp_path, pg_server):
    """A ledger on a PostgreSQL server that is not running: `uflash status` cannot read it, says so with exit code
    5, and shows the trouble the watcher of this machine recorded."""
    from ingest.config import load_settings

    url = pg_server.url_of("uflash_nowhere").replace(f"port={pg_server.port}", "port=9")  # nothing listens there
    cfg = write_config(tmp_path, database={"url": url})
    s = load_settings(cfg)
    Trouble(s.logs, "intake").failed("cannot take a.pdf in: the ledger failed: OperationalError: connection refused")
    r = uflash("--config", str(cfg), "status")
    assert r.returncode == 5, r.stdout + r.stderr
    assert "the ledger cannot be read: the ledger failed: OperationalError" in r.stdout
    assert "TROUBLE:   intake of " in r.stdout and "connection refused" in r.stdout
    st = json.loads(uflash("--config", str(cfg), "status", "--json").stdout)
    assert st["error"].startswith("the ledger failed") and st["infrastructure"][0]["loop"] == "intake"
    r = uflash("--config", str(cfg), "run", str(make_pdf(tmp_path / "x.pdf", 1)))
    assert r.returncode == 5 and "uflash: error: the ledger failed: OperationalError" in r.stderr, r.stderr
    assert (tmp_path / "x.pdf").exists()


class _Decoder:
    """The real decoder of the tiny model, with something done before each decode (``before(n)``, n: decodes so
    far)."""

    def __init__(self, inner, before):
        self.inner, self.before, self.calls = inner, before, 0
        self.mode, self.model_name, self.device = inner.mode, inner.model_name, inner.device

    def describe(self):
        return self.inner.describe()

    def free_memory(self):
        self.inner.free_memory()

    def decode(self, images, context_limit, max_new_tokens=None, **hints):
        self.calls += 1
        self.before(self.calls)
        return self.inner.decode(images, context_limit, max_new_tokens, **hints)


def _worker_setup(tmp_path, tiny_model_dir, before, **worker_keys):
    from engine.chunk_decode import OfficialDecoder
    from engine.model.load import load_model
    from ingest.config import load_settings
    from ingest.intake.enqueue import intake_file
    from ingest.worker.worker import Worker
    from tests.conftest import worker_config

    s = load_settings(worker_config(tmp_path, tiny_model_dir, engine={"max_pages_per_chunk": 1},
                                    worker={"max_attempts": 1, **worker_keys}))
    s.ensure_folders()
    db = Database(s.database_url, busy_timeout_ms=100)
    docs = [intake_file(db, s, make_pdf(s.inbox / f"d{i}.pdf", 2)).document_id for i in range(2)]
    decoder = _Decoder(OfficialDecoder(load_model(str(tiny_model_dir), "cpu", "float32")), before)
    worker = Worker(s, db, lambda: decoder, trouble=Trouble(s.logs, "worker", backoff=(0.2,)))
    return s, db, docs, worker


def _finished(db):
    from sqlalchemy import func

    def done() -> bool:
        with db.session() as ss:
            return ss.scalar(select(func.count()).select_from(Document).where(
                Document.status.not_in(["done", "failed"]))) == 0
    return done


def _pages_once(db) -> bool:
    from sqlalchemy import func

    from db.models import Page

    with db.session() as ss:
        counts = ss.execute(select(func.count()).select_from(Page).group_by(Page.document_id, Page.page_index)).all()
    return len(counts) == 4 and all(n == 1 for (n,) in counts)


def test_a_chunk_decoded_while_the_ledger_is_locked_is_stored_once_when_it_is_free(tmp_path, tiny_model_dir):
    """The ledger is locked by another process from the start of the second decode until the worker has failed to
    store its pages: the worker keeps the decoded pages, retries the store with a backoff, and stores them once (one
    attempt, nothing failed)."""
    import threading

    from db.models import Chunk
    from tests.conftest import serve_until, wait_until

    holder = {}

    def release_once_the_store_failed(blocker):
        wait_until(lambda: any("cannot store" in r["problem"] for r in read_trouble(tmp_path / "logs")), timeout=120)
        blocker.rollback()
        blocker.close()

    def lock_on_second(n):
        if n == 2:
            blocker = sqlite3.connect(str(tmp_path / "uflash.db"), isolation_level=None, check_same_thread=False)
            blocker.execute("BEGIN EXCLUSIVE")
            holder["released"] = threading.Thread(target=release_once_the_store_failed, args=(blocker,))
            holder["released"].start()

    s, db, docs, worker = _worker_setup(tmp_path, tiny_model_dir, lock_on_second)
    serve_until(worker, _finished(db), timeout=120)
    holder["released"].join()
    with db.session() as ss:
        assert all(ss.get(Document, d).status == "done" for d in docs)
        assert [c.attempts for c in ss.scalars(select(Chunk))] == [1, 1, 1, 1]
    assert _pages_once(db)
    (rec,) = read_trouble(s.logs)  # the store of d0's page 2, or the claim of the next chunk, met the lock first
    assert rec["loop"] == "worker" and "database is locked" in rec["problem"] and rec["over_at"]
    db.dispose()


def test_a_ledger_error_in_the_middle_of_a_chunk_fails_nothing(tmp_path, tiny_model_dir):
    """An error of the ledger while a chunk is in hand (here raised by the decode, as a read of the drafts would),
    with one attempt allowed: the chunk is given back uncounted and decoded again, not failed."""
    from db.models import Chunk
    from tests.conftest import serve_until

    def fail_once(n):
        if n == 1:
            raise OperationalError("SELECT pages", {}, sqlite3.OperationalError("disk I/O error"))

    s, db, docs, worker = _worker_setup(tmp_path, tiny_model_dir, fail_once)
    serve_until(worker, _finished(db), timeout=120)
    with db.session() as ss:
        assert all(ss.get(Document, d).status == "done" for d in docs)
        assert [c.attempts for c in ss.scalars(select(Chunk))] == [1, 1, 1, 1]
    assert _pages_once(db)
    db.dispose()


def test_a_full_disk_for_the_outputs_fails_no_document(tmp_path, tiny_model_dir, monkeypatch):
    """The outbox's disk is full when a document is finished: the document is not failed; it is finished once
    there is room (here: after three tries)."""
    import ingest.worker.finish

    real, tries = ingest.worker.finish.write_document_outputs, []

    def full_disk(folder, *args, **kw):
        tries.append(folder)
        if len(tries) <= 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(folder / "document.pdf"))
        return real(folder, *args, **kw)

    monkeypatch.setattr(ingest.worker.finish, "write_document_outputs", full_disk)
    s, db, docs, worker = _worker_setup(tmp_path, tiny_model_dir, lambda n: None)
    from tests.conftest import serve_until

    serve_until(worker, _finished(db), timeout=120)
    with db.session() as ss:
        assert [ss.get(Document, d).status for d in docs] == ["done", "done"]
        assert all(ss.get(Document, d).error is None for d in docs)
    assert len(tries) == 3 + 2 and all((s.outbox / f"d{i}" / "document.md").exists() for i in range(2))
    assert "No space left on device" in read_trouble(s.logs)[0]["problem"]
    assert not any(s.inbox.iterdir()) and len(list(s.archive.iterdir())) == 2
    db.dispose()


def test_the_trouble_of_a_process_that_ended_is_shown_as_past(tmp_path):
    """A watcher killed while the ledger was down left its record unfinished: status shows it as the last error (until
    its process ended), not as trouble now."""
    import socket

    from ingest.ledger.health import FOLDER

    owner = f"{socket.gethostname()}:999999999:1"  # no such process
    (tmp_path / FOLDER).mkdir()
    (tmp_path / FOLDER / "x.json").write_text(json.dumps({"owner": owner, "loops": {"worker": {
        "problem": "the ledger failed: OperationalError: connection refused", "since": "2026-12-01T10:00:00+00:00",
        "last_seen": "2026-12-01T10:05:00+00:00", "tries": 9, "next_try": "2026-12-01T10:05:15+00:00",
        "over_at": None}}}))
    (rec,) = read_trouble(tmp_path)
    assert rec["owner_gone"]
    assert format_trouble([rec]) == [
        f"last infrastructure error: worker of {owner}, 2026-12-01T10:00:00 until its process ended (last seen "
        "2026-12-01T10:05:00) (9 failed tries): the ledger failed: OperationalError: connection refused"]
