"""Workers killed outright with chunks in flight (db.queue's crash rule), end to end: `uflash watch` as a real process on
the CPU with the tiny model, SIGKILLed and started again, on a SQLite ledger and on a real PostgreSQL server. The
texts must equal those of one uninterrupted `uflash run` of the same files."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from db.models import Chunk, ChunkStatus, Document, Page
from db.session import Database
from ingest.config import load_settings
from ingest.intake.enqueue import intake_file
from ingest.worker.crash_hook import VARIABLE
from tests.conftest import SQLITE_URL, make_pdf, uflash, worker_config
from tests.test_worker import start_uflash

# run in parallel, this module's tests stay on one worker: the uninterrupted run they compare with, once
pytestmark = pytest.mark.xdist_group("crashes")

DOCS, PAGES = 5, 3
MARKER = "KILLS-THE-WORKER"


def _config(folder: Path, model: Path, ledger_url: str, max_batch: int | str) -> Path:
    """One-page chunks of a few tokens, in batches of ``max_batch``; leases of 300 s (a restart takes the chunks of
    the killed process over at once: it is gone); only the outputs the test reads."""
    return worker_config(folder, model, database={"url": ledger_url},
                         engine={"mode": "lossless", "max_batch": max_batch, "max_pages_per_chunk": 1,
                                 "max_tokens_per_page": 12},
                         orientation={"auto": False}, outputs={"formats": ["md", "json"]},
                         worker={"lease_seconds": 300.0, "heartbeat_seconds": 1.0, "max_attempts": 3,
                                 "prepare_processes": 1})


def _documents(inbox: Path) -> list[Path]:
    return [make_pdf(inbox / f"d{i}.pdf", [f"Document {i} page {p}: the register of {1850 + 7 * i + p}."
                                           for p in range(PAGES)]) for i in range(DOCS)]


def _texts(db: Database) -> dict[tuple[str, int], str]:
    """(file name, page) -> text, of every stored page (each page must be stored once)."""
    with db.session() as s:
        rows = s.execute(select(Document.original_name, Page.page_index, Page.text)
                         .join(Document, Document.id == Page.document_id)).all()
    texts = {(name, i): text for name, i, text in rows}
    assert len(texts) == len(rows), "a page was stored twice"
    return texts


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model_dir) -> dict[tuple[str, int], str]:
    """The texts of one `uflash run` of the five documents, never interrupted (SQLite)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    cfg = _config(folder, tiny_model_dir, SQLITE_URL, 4)
    s = load_settings(cfg)
    s.ensure_folders()
    _documents(s.inbox)
    r = uflash("--config", str(cfg), "run", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    db = Database(s.database_url)
    texts = _texts(db)
    db.dispose()
    assert len(texts) == DOCS * PAGES
    return texts


def _setup(tmp_path, tiny_model_dir, ledger_url, max_batch, extra: list[Path] | None = None):
    cfg = _config(tmp_path, tiny_model_dir, ledger_url, max_batch)
    s = load_settings(cfg)
    s.ensure_folders()
    db = Database(s.database_url)
    ids = [intake_file(db, s, pdf).document_id for pdf in _documents(s.inbox) + (extra or [])]
    return cfg, s, db, ids


def _running(db: Database, pid: int) -> int:
    """Chunks the process ``pid`` holds (its leases: owner host:pid:started)."""
    with db.session() as ss:
        return ss.scalar(select(func.count()).select_from(Chunk).where(
            Chunk.status == ChunkStatus.RUNNING, Chunk.lease_owner.like(f"%:{pid}:%")))


def _kill_holding(proc, db: Database, quick: Database, at_least: int = 2) -> int:
    """SIGKILL ``proc`` at a moment when it holds ``at_least`` chunks: frozen (SIGSTOP) once the ledger shows them,
    looked at again while frozen (``quick``: a ledger handle that does not wait for a lock the frozen process may
    hold), killed if it still holds them, else let go on. Returns how many it held when killed."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if _running(db, proc.pid) < at_least:
            time.sleep(0.01)
            continue
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            held = _running(quick, proc.pid)
        except Exception:  # noqa: BLE001 - the frozen process holds SQLite's write lock: let it go on
            held = 0
        if held >= at_least:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            proc.reader.join(timeout=10)
            return held
        os.kill(proc.pid, signal.SIGCONT)
    raise AssertionError(f"never seen holding {at_least} chunks\n" + "".join(proc.lines))


def _settled(db: Database, ids: list[int]) -> bool:
    with db.session() as ss:
        return ss.scalar(select(func.count()).select_from(Document).where(
            Document.id.in_(ids), Document.status.not_in(["done", "failed"]))) == 0


def _stop(proc) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    proc.reader.join(timeout=10)
    out = "".join(proc.lines)
    assert code == 0, out
    return out


def _serve_until_settled(cfg: Path, db: Database, ids: list[int], timeout: float = 300):
    """`uflash watch` until every document of ``ids`` is done or failed; returns its output."""
    proc = start_uflash(cfg, "watch")
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None and not _settled(db, ids):
            time.sleep(0.2)
    finally:
        out = _stop(proc)
    assert _settled(db, ids), out
    return out


@pytest.mark.parametrize("max_batch", [4, "auto"])
def test_a_watcher_killed_three_times_with_chunks_in_flight_fails_nothing(tmp_path, tiny_model_dir, ledger_url,
                                                                         max_batch, uninterrupted):
    """Five 3-page documents; `uflash watch` SIGKILLed three times, each time holding two chunks or more, and started
    again: each restart takes the dead worker's chunks over uncharged (in smaller groups), so every document ends
    done with the texts of an uninterrupted run, each chunk decoded to the end once (one attempt), nothing failed,
    the inbox empty and nothing in failed/. Before, each kill charged every chunk in flight an attempt, and after
    three kills all five documents failed."""
    cfg, s, db, ids = _setup(tmp_path, tiny_model_dir, ledger_url, max_batch)
    quick = Database(s.database_url, busy_timeout_ms=200)
    killed = []
    for _ in range(3):
        proc = start_uflash(cfg, "watch")
        try:
            killed.append((proc.pid, _kill_holding(proc, db, quick), "".join(proc.lines)))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    out = _serve_until_settled(cfg, db, ids)
    logs = [lines for _, _, lines in killed[1:]] + [out]
    for (pid, held, _), after in zip(killed, logs):  # each restart said whose chunks it took over, and how
        assert held >= 2 and f":{pid}:" in after and "which died with them in flight" in after, after
    assert "not counted as attempts" in out or any("not counted as attempts" in lg for lg in logs)
    with db.session() as ss:
        docs = ss.scalars(select(Document).where(Document.id.in_(ids))).all()
        chunks = ss.scalars(select(Chunk)).all()
    assert [d.status for d in docs] == ["done"] * DOCS, [(d.original_name, d.error) for d in docs]
    assert _texts(db) == uninterrupted
    assert all(c.status == ChunkStatus.DONE for c in chunks)
    assert {(c.attempts, c.solo_crashes) for c in chunks} == {(1, 0)}, "a kill in company was charged"
    assert sum(c.batch_limit is not None for c in chunks) >= 2  # decoded again in smaller groups
    assert not any(s.inbox.iterdir()) and not any(s.failed.iterdir())
    assert sorted(p.name for p in s.archive.iterdir()) == [f"d{i}.pdf" for i in range(DOCS)]
    quick.dispose()
    db.dispose()


def test_a_poison_document_kills_the_worker_until_it_fails_alone_and_the_others_are_done(tmp_path, tiny_model_dir,
                                                                                          ledger_url, uninterrupted):
    """A sixth document kills the worker (SIGKILL, the test hook) whenever it is decoded; `uflash watch` is started
    again after each death. Within five restarts it has been decoded alone three times and is failed with a reason
    naming its page, its original in failed/ beside the reason; the five others are done with the texts of an
    uninterrupted run. `uflash retry --doc N` queues it again (its original back in the inbox), and without the hook
    it is then done."""
    poison = make_pdf(tmp_path / "drop" / f"ledger-{MARKER}.pdf", ["A page this worker dies on."])
    cfg, s, db, ids = _setup(tmp_path, tiny_model_dir, ledger_url, 4)
    bad = intake_file(db, s, poison.rename(s.inbox / poison.name)).document_id
    ids.append(bad)
    deaths, out = 0, ""
    for _ in range(8):
        proc = start_uflash(cfg, "watch", env={VARIABLE: MARKER})
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not _settled(db, ids):
            time.sleep(0.1)
        if proc.poll() is not None:
            proc.reader.join(timeout=10)
            assert proc.returncode == -signal.SIGKILL, "".join(proc.lines)
            deaths += 1
            continue
        out = _stop(proc)
        break
    assert _settled(db, ids), f"not done after {deaths} deaths\n{out}"
    assert 3 <= deaths <= 5, deaths  # the last death is followed by the restart that fails it
    with db.session() as ss:
        docs = {d.id: d for d in ss.scalars(select(Document))}
        (chunk,) = ss.scalars(select(Chunk).where(Chunk.document_id == bad)).all()
    assert [docs[i].status for i in ids[:-1]] == ["done"] * DOCS
    assert docs[bad].status == "failed" and (chunk.attempts, chunk.solo_crashes) == (3, 3)
    assert docs[bad].error.startswith("pages 1-1: killed the worker on every attempt (decoded alone 3 times; "), \
        docs[bad].error
    assert {k: v for k, v in _texts(db).items() if k[0] != poison.name} == uninterrupted
    kept = s.failed / poison.name
    assert docs[bad].failed_path == str(kept) and kept.exists() and not any(s.inbox.iterdir())
    assert docs[bad].error in (s.failed / f"{poison.name}.error.txt").read_text(encoding="utf-8")
    st = uflash("--config", str(cfg), "status").stdout
    assert f"#{bad} {poison.name}: pages 1-1: killed the worker on every attempt" in st and str(kept) in st, st

    r = uflash("--config", str(cfg), "retry", "--doc", str(bad))
    assert r.returncode == 0 and f"queued  #{bad} {poison.name}: 1 chunk(s) again" in r.stdout, r.stdout + r.stderr
    assert sorted(p.name for p in s.failed.iterdir()) == [] and (s.inbox / poison.name).exists()
    with db.session() as ss:
        assert ss.get(Document, bad).status == "queued"
        chunk = ss.get(Chunk, chunk.id)
    assert (chunk.status, chunk.attempts, chunk.solo_crashes, chunk.batch_limit) == ("queued", 0, 0, 1)
    r = uflash("--config", str(cfg), "run", timeout=600)  # no hook: it is decoded (alone) and done
    assert r.returncode == 0 and f"done    {poison.name}: 1 page -> " in r.stdout, r.stdout + r.stderr
    assert (s.archive / poison.name).exists() and not any(s.inbox.iterdir())
    db.dispose()
