import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from sqlalchemy import select

from db.chunks import complete_chunk
from db.models import Chunk, ChunkStatus, Document
from db.queue import claim, end_leases_of_gone_owners, fail, heartbeat, release, room_left, take_over_dead
from db.session import Database
from ingest.ledger.owners import is_gone, this_process
from tests.conftest import ROOT, reopened


@pytest.fixture
def any_db(db):
    """The same queue tests on a SQLite file and on a real PostgreSQL server (conftest.ledger_url)."""
    return db


def add_document(db, n_chunks: int, name: str = "doc.pdf") -> int:
    with db.session() as s, s.begin():
        d = Document(sha256=name.ljust(64, "0")[:64], original_path=f"/in/{name}", original_name=name, size_bytes=1,
                     mtime_ns=0, kind="pdf", page_count=n_chunks)
        s.add(d)
        s.flush()
        s.add_all(Chunk(document_id=d.id, first_page=i, last_page=i) for i in range(1, n_chunks + 1))
        return d.id


def start_claimer(db, owner, out, mode, lease, idle=2.0, go=None):
    return subprocess.Popen([sys.executable, "-m", "tests.claimer", db.url, owner, str(out), mode, str(lease), str(idle),
                             *([str(go)] if go else [])], cwd=ROOT)


def read_log(path):
    if not path.exists():
        return []
    return [line.split() for line in path.read_text().splitlines()]


def lease_expiry(db) -> float:
    with db.session() as s:
        return s.scalars(select(Chunk.lease_expires_at)).one()


def wait_for(pred, timeout=30.0, every=0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(every)
    return False


def test_two_processes_never_claim_the_same_chunk(any_db, tmp_path):
    db = any_db
    add_document(db, 100)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    go = tmp_path / "go"  # both start claiming together, however long each took to start on a busy machine
    procs = [start_claimer(db, f"worker-{i}", logs[i], "drain", 30, go=go) for i in range(2)]
    assert wait_for(lambda: all(any(r[0] == "ready" for r in read_log(lg)) for lg in logs), timeout=120)
    go.touch()
    for p in procs:
        assert p.wait(timeout=120) == 0
    claimed = [[int(r[1]) for r in read_log(lg) if r[0] == "claimed"] for lg in logs]
    assert len(claimed[0]) + len(claimed[1]) == 100
    assert not set(claimed[0]) & set(claimed[1])
    assert claimed[0] and claimed[1], "both processes should have taken work"
    with db.session() as s:
        chunks = s.scalars(select(Chunk)).all()
    assert all(c.status == ChunkStatus.DONE and c.attempts == 1 and c.lease_owner is None for c in chunks)


def test_killed_lease_holder_chunk_is_taken_over(any_db, tmp_path):
    db = any_db
    add_document(db, 1)
    lease = 3.0  # the holder beats every lease / 12: a beat may come 2.7 s late on a busy machine
    a_log, b_log = tmp_path / "a.log", tmp_path / "b.log"
    a = b = start_claimer(db, "holder", a_log, "hold", lease)
    try:
        assert wait_for(lambda: any(r[0] == "claimed" for r in read_log(a_log)), timeout=120)
        first_expiry = lease_expiry(db)
        b = start_claimer(db, "rescuer", b_log, "drain", lease, idle=120)
        # While the holder lives its heartbeat keeps the lease: the rescuer, polling every 0.05 s from well before
        # the first term ran out until well after, gets nothing.
        assert wait_for(lambda: any(r[0] == "ready" for r in read_log(b_log)), timeout=120)
        polling_since = max(first_expiry, float(next(r for r in read_log(b_log) if r[0] == "ready")[1]))
        assert wait_for(lambda: time.time() > polling_since + lease, timeout=120)
        assert not any(r[0] == "claimed" for r in read_log(b_log))
        assert lease_expiry(db) > first_expiry + lease  # renewed, term after term
        os.kill(a.pid, signal.SIGKILL)
        killed_at = time.time()
        a.wait(timeout=10)
        assert wait_for(lambda: any(r[0] == "done" for r in read_log(b_log)), timeout=120)
        rec = next(r for r in read_log(b_log) if r[0] == "claimed")
        assert int(rec[2]) == 2  # second attempt
        assert float(rec[3]) >= killed_at  # not before the holder died
    finally:
        for proc in (a, b):  # the holder too, when an assertion failed before its kill
            proc.kill()
            proc.wait()
    with db.session() as s:
        c = s.scalars(select(Chunk)).one()
    assert c.status == ChunkStatus.DONE and c.attempts == 2


def test_retry_with_backoff_then_failed_with_reason(any_db):
    db = any_db
    doc = add_document(db, 1)
    c1 = claim(db, "w", lease_seconds=60, max_attempts=2)
    assert fail(db, c1, "CUDA out of memory", max_attempts=2, backoff_seconds=100) == ChunkStatus.QUEUED
    assert claim(db, "w", 60, 2) is None  # backing off
    later = time.time() + 101
    c2 = claim(db, "w", 60, 2, now=later)
    assert c2 is not None and c2.attempts == 2
    assert fail(db, c2, "CUDA out of memory again", max_attempts=2, backoff_seconds=100) == ChunkStatus.FAILED
    assert claim(db, "w", 60, 2, now=later + 10_000) is None
    with db.session() as s:
        chunk = s.scalars(select(Chunk)).one()
        d = s.get(Document, doc)
    assert chunk.status == ChunkStatus.FAILED and "again" in chunk.last_error
    assert d.status == "failed" and "CUDA out of memory again" in d.error


def test_expired_lease_of_a_chunk_alone_on_its_last_attempt_ends_failed_naming_its_pages(db):
    doc = add_document(db, 1)
    c = claim(db, "ghost", lease_seconds=1, max_attempts=1)
    assert (c.first_page, c.attempts) == (1, 1)
    assert claim(db, "other", 1, 1, now=time.time() + 5) is None
    with db.session() as s:
        chunk = s.scalars(select(Chunk)).one()
        d = s.get(Document, doc)
    assert chunk.status == ChunkStatus.FAILED and (chunk.attempts, chunk.solo_crashes) == (1, 1)
    assert chunk.last_error == "killed the worker on every attempt (decoded alone 1 time; last worker ghost)"
    assert d.status == "failed" and d.error.startswith("pages 1-1: killed the worker on every attempt")


def test_lost_lease_cannot_complete_or_renew(db):
    add_document(db, 1)
    a = claim(db, "a", lease_seconds=1, max_attempts=5)
    b = claim(db, "b", lease_seconds=60, max_attempts=5, now=time.time() + 2)
    assert b is not None and b.chunk_id == a.chunk_id
    assert heartbeat(db, a, 60) is False
    assert complete_chunk(db, a) is False
    assert complete_chunk(db, b) is True


def test_release_gives_chunk_back_without_counting(db):
    add_document(db, 1)
    c = claim(db, "a", 60, 3)
    assert release(db, c)
    c2 = claim(db, "b", 60, 3)
    assert c2.chunk_id == c.chunk_id and c2.attempts == 1


def test_claim_limited_to_some_documents_leaves_the_others_queued(any_db):
    """`uflash run FILE`: the claim takes only chunks of the given documents, a backlog queued before them stays
    untouched (not claimed, no attempt counted), an expired lease of a given document is still taken over, and a
    claim without the filter (`uflash watch`) takes the backlog in order."""
    db = any_db
    backlog = add_document(db, 3, "backlog.pdf")  # queued first: an unfiltered claim would take it first
    named = add_document(db, 2, "named.pdf")
    a = claim(db, "run", 60, 3, document_ids={named})
    assert a is not None and a.document_id == named and a.first_page == 1
    b = claim(db, "run-b", 1, 3, document_ids=[named])
    assert b is not None and b.document_id == named and b.first_page == 2
    assert claim(db, "run", 60, 3, document_ids={named}) is None  # both held: nothing else for this run
    assert claim(db, "run", 60, 3, document_ids=set()) is None
    taken_over = claim(db, "run-2", 60, 3, now=time.time() + 5, document_ids={named})  # b's lease expired (alone)
    assert taken_over is not None and taken_over.chunk_id == b.chunk_id and taken_over.attempts == 2
    with db.session() as s:
        rest = s.scalars(select(Chunk).where(Chunk.document_id == backlog)).all()
        assert s.get(Document, backlog).status == "queued"
    assert [(c.status, c.attempts, c.lease_owner) for c in rest] == [(ChunkStatus.QUEUED, 0, None)] * 3
    w = claim(db, "watch", 60, 3)
    assert w is not None and (w.document_id, w.first_page) == (backlog, 1)
    assert claim(db, "run", 60, 3, document_ids=list(range(100_000, 140_000)) + [backlog]).document_id == backlog


def test_status_names_who_holds_the_running_chunks_and_flags_expired_leases(tmp_path):
    from ingest.commands.status import collect_status, format_status

    db = Database(f"sqlite:///{tmp_path / 'q.db'}")
    add_document(db, 3)
    now = time.time()
    assert claim(db, "host:111", lease_seconds=300, max_attempts=3, now=now)
    assert claim(db, "host:222", lease_seconds=10, max_attempts=3, now=now - 100)  # its worker died long ago
    text = format_status(collect_status(db))
    (alive,) = [line for line in text.splitlines() if "host:111" in line]
    (dead,) = [line for line in text.splitlines() if "host:222" in line]
    assert "1 chunk(s) leased by host:111 until" in alive and "expired" not in alive
    assert "expired" in dead


# -- owners that are gone: their leases end at once ------------------------------------------------------------------

def _dead_process_owner() -> str:
    """The owner string of a process that ran on this host and has ended."""
    import psutil

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    owner = f"{socket.gethostname()}:{child.pid}:{int(psutil.Process(child.pid).create_time())}"
    assert not is_gone(owner)  # alive
    child.kill()
    child.wait()
    return owner


def test_an_owner_is_gone_only_when_this_host_knows_its_process_ended():
    host, pid = socket.gethostname(), os.getpid()
    me = this_process()
    assert me.startswith(f"{host}:{pid}:") and not is_gone(me)
    assert is_gone(_dead_process_owner())
    started = int(me.rsplit(":", 1)[1])
    assert is_gone(f"{host}:{pid}:{started - 3600}")  # this pid, given to an earlier process (e.g. before a reboot)
    assert is_gone(f"{host}:{pid}")  # an older uflash's owner (no start time) with this pid: not this process
    for unknown in (f"otherhost:{pid}:{started - 3600}", "otherhost:1", f"{host}:{os.getppid()}", None, "", "holder"):
        assert not is_gone(unknown), unknown  # another host, an older uflash's owner whose pid lives, or no owner


def test_the_lease_of_an_owner_that_is_gone_ends_at_once(any_db):
    db = any_db
    add_document(db, 2)
    dead = _dead_process_owner()
    assert claim(db, dead, lease_seconds=300, max_attempts=3)
    assert claim(db, this_process(), lease_seconds=300, max_attempts=3)
    assert claim(db, "rescuer", lease_seconds=300, max_attempts=3) is None  # both leases run for 5 more minutes
    assert end_leases_of_gone_owners(db, is_gone) == 1
    c = claim(db, "rescuer", lease_seconds=300, max_attempts=3)
    assert (c.first_page, c.attempts) == (1, 2)  # the dead owner's chunk, at once, as its second attempt
    assert end_leases_of_gone_owners(db, is_gone) == 0  # the live owner keeps its lease
    assert claim(db, "rescuer", lease_seconds=300, max_attempts=3) is None


def test_a_version_1_ledger_is_migrated_to_run_owners_and_ends(any_db):
    """Version 2 added runs.owner (from runs.settings) and runs.end_reason; a version 1 ledger is upgraded on open."""
    from sqlalchemy import text

    from db.models import Run, SchemaVersion

    db = any_db
    with db.engine.begin() as conn:
        conn.execute(text("ALTER TABLE runs DROP COLUMN owner"))
        conn.execute(text("ALTER TABLE runs DROP COLUMN end_reason"))
        conn.execute(SchemaVersion.__table__.delete())
        conn.execute(SchemaVersion.__table__.insert().values(version=1))
        for i, finished in ((1, "2026-12-01 10:00:00+00:00"), (2, None)):
            conn.execute(text("INSERT INTO runs (id, mode, model, engine_version, settings, started_at, finished_at) "
                              "VALUES (:i, 'lossless', 'm', '1', :s, '2026-12-01 09:00:00+00:00', :f)"),
                         {"i": i, "s": f'{{"owner": "host:{i}"}}', "f": finished})
    with reopened(db) as again, again.session() as s:
        runs = s.scalars(select(Run).order_by(Run.id)).all()
    assert [(r.owner, r.end_reason) for r in runs] == [("host:1", "closed"), ("host:2", None)]


def test_status_shows_pages_decoded_pages_left_and_when_they_should_be_done(tmp_path):
    """A 10-page document, 4 pages stored by a run opened 2 hours ago (2 pages an hour): 6 pages left, about 3 h.
    A run whose process is gone gives no pace."""
    from datetime import datetime, timedelta, timezone

    from db.models import Page, Run
    from ingest.commands.status import collect_status, format_status

    db = Database(f"sqlite:///{tmp_path / 'q.db'}")
    doc = add_document(db, 10, "long.pdf")
    started = datetime.now(timezone.utc) - timedelta(hours=2)
    with db.session() as s, s.begin():
        s.add(Run(id=1, mode="lossless", model="m", engine_version="1", owner=this_process(), started_at=started))
        s.add(Run(id=2, mode="lossless", model="m", engine_version="1", owner=_dead_process_owner(),
                  started_at=started))
        s.flush()
        s.add_all(Page(document_id=doc, run_id=1, page_index=i) for i in range(1, 5))
        s.add(Page(document_id=doc, run_id=2, page_index=4))  # the same page again: counted once as decoded
        for c in s.scalars(select(Chunk).where(Chunk.first_page <= 4)):
            c.status = ChunkStatus.DONE
        s.get(Document, doc).status = "running"
    st = collect_status(db)
    assert st["waiting_documents"] == [{"id": doc, "name": "long.pdf", "status": "running", "pages_decoded": 4,
                                        "page_count": 10, "original": "/in/long.pdf"}]
    assert [(r["id"], r["pages"], r["pages_per_hour"]) for r in st["open_runs"]] == [(1, 4, 2.0), (2, 1, None)]
    assert st["pages_left"] == 6 and abs(st["eta_seconds"] - 3 * 3600) < 60
    text = format_status(st)
    assert "waiting:   #1 long.pdf: 4/10 pages decoded (running); its original: /in/long.pdf" in text
    assert "left:      6 pages to decode, about 3.0 h at the open runs' pace" in text
    assert "open:      run 1 (lossless) of " in text and "4 pages (2 an hour)" in text
    assert "(its process is gone: the next worker closes it as crashed)" in text
    add_document(db, 1, "next.pdf")
    assert "waiting:   ... and 1 more (--limit)" in format_status(collect_status(db, limit=1))


def test_a_rerun_on_another_host_is_closed_once_its_own_chunk_waited_a_lease(any_db):
    """No pid to look at on another host (a shared PostgreSQL ledger): a re-run whose reserved chunk has been running
    on an ended lease for longer than a lease is gone (a live one takes its own chunk back within a poll). Its run
    closes as crashed and what it left is cancelled; a re-run whose lease ended only just now is left alone."""
    from datetime import datetime, timezone

    from db.models import Run
    from db.runs import close_runs_of_gone_owners

    db = any_db
    doc = add_document(db, 2)
    now = time.time()
    with db.session() as s, s.begin():
        for run_id in (1, 2):
            s.add(Run(id=run_id, mode="lossless", model="m", engine_version="1", owner=f"otherhost:{run_id}:1",
                      started_at=datetime.now(timezone.utc)))
        s.flush()
        for c, run_id, ended in zip(s.scalars(select(Chunk).order_by(Chunk.id)), (1, 2), (now - 400, now - 100)):
            c.run_id, c.status, c.lease_expires_at = run_id, ChunkStatus.RUNNING, ended
            c.lease_owner = f"otherhost:{run_id}:1"
    assert close_runs_of_gone_owners(db, is_gone) == {}  # without the stale rule: another host is never judged
    assert close_runs_of_gone_owners(db, is_gone, stale_before=now - 300) == {1: [doc]}
    with db.session() as s:
        runs = {r.id: r for r in s.scalars(select(Run))}
        chunks = s.scalars(select(Chunk).order_by(Chunk.id)).all()
    assert (runs[1].end_reason, runs[2].end_reason) == ("crashed", None)
    assert [c.status for c in chunks] == [ChunkStatus.CANCELLED, ChunkStatus.RUNNING]


# -- the crash rule: a worker that died with chunks in flight (db.queue) ---------------------------------------------

def _chunks(db) -> list[Chunk]:
    with db.session() as s:
        return s.scalars(select(Chunk).order_by(Chunk.first_page)).all()


def _die(db, owner: str) -> None:
    """``owner``'s process dies: its leases end (as end_leases_of_gone_owners or their expiry end them)."""
    with db.engine.begin() as conn:
        conn.execute(Chunk.__table__.update().where(Chunk.lease_owner == owner)
                     .values(lease_expires_at=time.time() - 1))


def _claim_all(db, owner: str, max_attempts: int = 3) -> list:
    taken = []
    while (c := claim(db, owner, 300, max_attempts)) is not None:
        taken.append(c)
    return taken


def test_a_worker_that_died_with_several_chunks_gives_them_back_uncharged_in_halved_groups(any_db):
    """A worker dies holding 5 chunks: none is charged (the claim's attempt is given back), each may decode beside at
    most one other (5 // 2); the next worker takes two of them, and dies: each of those goes alone from then on."""
    db = any_db
    add_document(db, 7)
    first = [claim(db, "w1", 300, 3) for _ in range(5)]
    assert [c.batch_limit for c in first] == [None] * 5
    _die(db, "w1")
    told = []
    second = [claim(db, "w2", 300, 3, on_takeover=told.append)] + _claim_all(db, "w2")
    (t,) = told
    assert (t.owner, len(t.chunks), t.charged, t.batch_limit) == ("w1", 5, False, 2)
    assert [(c.first_page, c.attempts, c.batch_limit) for c in second] == [(1, 1, 2), (2, 1, 2)]  # uncharged
    chunks = _chunks(db)
    assert [(c.status, c.attempts, c.batch_limit) for c in chunks[2:5]] == [(ChunkStatus.QUEUED, 0, 2)] * 3
    assert [(c.status, c.batch_limit) for c in chunks[5:]] == [(ChunkStatus.QUEUED, None)] * 2
    assert "died with 5 chunks in flight: not counted as an attempt" in chunks[2].last_error
    _die(db, "w2")
    third = _claim_all(db, "w4", max_attempts=3)
    assert [(c.first_page, c.attempts, c.batch_limit) for c in third] == [(1, 1, 1)]  # alone: limit 1
    chunks = _chunks(db)
    assert [(c.attempts, c.batch_limit, c.solo_crashes) for c in chunks[:2]] == [(1, 1, 0), (0, 1, 0)]
    _die(db, "w4")  # it died with chunk 1 alone: charged
    told = []
    assert claim(db, "w5", 300, 3, on_takeover=told.append).first_page == 1
    (t,) = told
    assert (t.owner, [p[2] for p in t.chunks], t.charged, t.failed, t.batch_limit) == ("w4", [1], True, False, 1)
    chunk1 = _chunks(db)[0]
    assert (chunk1.attempts, chunk1.solo_crashes, chunk1.status) == (2, 1, ChunkStatus.RUNNING)


def test_a_claim_never_makes_a_worker_hold_more_than_the_smallest_limit_in_hand(any_db):
    """A worker holding an unlimited chunk does not take a chunk of limit 1 that is next in line (nor pass it over):
    it takes it once it holds nothing, and then nothing beside it. A chunk of limit 2 is taken with one other."""
    db = any_db
    add_document(db, 5)
    with db.engine.begin() as conn:
        for page, limit in ((2, 1), (4, 2)):
            conn.execute(Chunk.__table__.update().where(Chunk.first_page == page).values(batch_limit=limit))
    a = claim(db, "w", 300, 3)
    assert (a.first_page, a.batch_limit) == (1, None)
    assert claim(db, "w", 300, 3) is None  # page 2 (limit 1) is next: not beside page 1, and not passed over
    assert claim(db, "other", 300, 3).first_page == 2  # a worker holding nothing takes it
    assert claim(db, "other", 300, 3) is None  # ... and nothing beside it
    assert complete_chunk(db, a)
    b = claim(db, "w", 300, 3)
    c = claim(db, "w", 300, 3)
    assert (b.first_page, c.first_page, c.batch_limit) == (3, 4, 2)
    assert claim(db, "w", 300, 3) is None  # it holds 2: page 4's limit
    assert room_left([b, c]) == 0 and room_left([b]) is None and room_left([c]) == 1


def test_a_chunk_that_kills_its_worker_alone_is_charged_and_fails_naming_its_pages(any_db):
    """Pages 4-6 kill every worker that decodes them alone: charged each time, failed after max_attempts with a reason
    that names them; the document's other chunk is done, and the takeover said what it did."""
    db = any_db
    with db.session() as s, s.begin():
        d = Document(sha256="p" * 64, original_path="/in/poison.pdf", original_name="poison.pdf", size_bytes=1,
                     mtime_ns=0, kind="pdf", page_count=6)
        s.add(d)
        s.flush()
        s.add_all([Chunk(document_id=d.id, first_page=1, last_page=3),
                   Chunk(document_id=d.id, first_page=4, last_page=6, batch_limit=1)])
        doc = d.id
    assert complete_chunk(db, claim(db, "w0", 300, 3))
    told = []
    for attempt in (1, 2, 3):
        c = claim(db, f"w{attempt}", 300, 3, on_takeover=told.append)
        assert (c.first_page, c.attempts) == (4, attempt)
        _die(db, f"w{attempt}")
    assert claim(db, "w4", 300, 3, on_takeover=told.append) is None
    assert [(t.charged, t.failed) for t in told] == [(True, False), (True, False), (True, True)]
    with db.session() as s:
        chunk = s.scalar(select(Chunk).where(Chunk.first_page == 4))
        d = s.get(Document, doc)
    assert (chunk.status, chunk.attempts, chunk.solo_crashes) == (ChunkStatus.FAILED, 3, 3)
    assert d.status == "failed" and d.error == ("pages 4-6: killed the worker on every attempt (decoded alone 3 times;"
                                                " last worker w3)")


def test_crashes_in_company_cost_no_attempt_and_errors_a_chunk_raises_keep_max_attempts(any_db):
    """Two crashes of the worker with page 1 in company (4 chunks in hand, then 2) charge it nothing, although
    max_attempts is 2; then its own errors fail it after 2 of them, as before."""
    db = any_db
    add_document(db, 4)
    assert len(_claim_all(db, "w0", max_attempts=2)) == 4
    _die(db, "w0")
    assert [c.first_page for c in _claim_all(db, "w1", max_attempts=2)] == [1, 2]
    _die(db, "w1")
    assert take_over_dead(db, None, max_attempts=2)[0].charged is False
    assert [(c.attempts, c.batch_limit, c.status) for c in _chunks(db)[:2]] == [(0, 1, ChunkStatus.QUEUED)] * 2
    c = claim(db, "z", 300, 2)
    assert (c.first_page, c.attempts) == (1, 1)
    assert fail(db, c, "ValueError: boom", max_attempts=2, backoff_seconds=0) == ChunkStatus.QUEUED
    c = claim(db, "z", 300, 2)
    assert (c.first_page, c.attempts) == (1, 2)
    assert fail(db, c, "ValueError: boom again", max_attempts=2, backoff_seconds=0) == ChunkStatus.FAILED
    assert _chunks(db)[0].last_error == "ValueError: boom again"


def test_a_version_3_ledger_is_migrated_to_batch_limits_and_failed_paths(any_db):
    """Version 4 added chunks.batch_limit and solo_crashes, and documents.failed_path: a version 3 ledger gets them on
    open; its chunks have no limit, and a document failed before keeps its original where it is."""
    from sqlalchemy import text

    from db.models import SchemaVersion

    db = any_db
    doc = add_document(db, 2)
    with db.engine.begin() as conn:
        conn.execute(text("UPDATE documents SET status = 'failed', error = 'boom'"))
        for table, column in (("chunks", "batch_limit"), ("chunks", "solo_crashes"), ("documents", "failed_path")):
            conn.execute(text(f"ALTER TABLE {table} DROP COLUMN {column}"))
        conn.execute(SchemaVersion.__table__.delete())
        conn.execute(SchemaVersion.__table__.insert().values(version=3))
    with reopened(db) as again:
        with again.session() as s:
            assert [(c.batch_limit, c.solo_crashes) for c in s.scalars(select(Chunk))] == [(None, 0)] * 2
            assert s.get(Document, doc).failed_path == "/in/doc.pdf"
        s2 = add_document(again, 1, "new.pdf")
        assert claim(again, "w", 60, 3).document_id in (doc, s2)


def test_one_worker_at_a_time_finishes_a_document(any_db):
    """The finishing claim (db.documents.claim_finish): the first owner holds it and may renew it, another is refused
    until it is released by the document's end, runs out, or its holder is named gone; claims of other documents and
    the queue's leases are untouched."""
    from db.documents import claim_finish, fail_document, finish_document, finishing_owner, release_finish

    doc, other = add_document(any_db, 2), add_document(any_db, 1, "other.pdf")
    for c in [claim(any_db, "w", 60, 3) for _ in range(3)]:
        assert complete_chunk(any_db, c)
    assert claim_finish(any_db, doc, "a") and claim_finish(any_db, doc, "a")  # taken, then renewed
    assert not claim_finish(any_db, doc, "b") and finishing_owner(any_db, doc) == "a"
    assert claim_finish(any_db, other, "b")  # another document: its own claim
    assert claim_finish(any_db, doc, "b", gone=["a"]) and finishing_owner(any_db, doc) == "b"  # a died
    finish_document(any_db, doc, ROOT, None, None)  # done: released
    assert finishing_owner(any_db, doc) is None and claim_finish(any_db, doc, "c")  # (a re-run's rewrite)
    release_finish(any_db, doc, "someone else")  # only its holder gives it back
    assert finishing_owner(any_db, doc) == "c"
    release_finish(any_db, doc, "c")
    assert claim_finish(any_db, doc, "d", lease_seconds=-1) and claim_finish(any_db, doc, "e")  # d's ran out
    fail_document(any_db, other, "a reason")  # failed: released too
    assert finishing_owner(any_db, other) is None
    with any_db.session() as s:  # no chunk looks leased to the queue (only running chunks hold its leases)
        assert not s.scalars(select(Chunk).where(Chunk.status == ChunkStatus.RUNNING)).all()
