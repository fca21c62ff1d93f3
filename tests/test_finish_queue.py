"""Documents finished beside the decode loop (ingest.worker.finish_queue): the loop never waits for a finish, an
error of a finish is raised on the loop's thread, nothing is finished twice, and a worker killed while it finishes a
document leaves it to the next worker, which finishes it."""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time

import pytest
from sqlalchemy import select

from db.models import Chunk, ChunkStatus, Document, Page
from db.session import Database
from ingest.config import load_settings
from ingest.errors import infrastructure_problem
from ingest.worker.finish_queue import FinishQueue
from tests.conftest import make_pdf, uflash, worker_config
from tests.test_worker import freeze_while, start_uflash


class SlowFinisher:
    """Finishes nothing; each finish waits for ``go`` and is recorded; documents in ``waiting`` are unfinished."""

    def __init__(self):
        self.go, self.finished, self.waiting, self.fail = threading.Event(), [], set(), None

    def finish(self, doc_id):
        self.go.wait(30)
        if self.fail is not None:
            e, self.fail = self.fail, None
            raise e
        self.finished.append(doc_id)
        self.waiting.discard(doc_id)

    def finish_ready(self, skip=lambda doc_id: False):
        for doc_id in sorted(self.waiting):
            if not skip(doc_id):
                self.finish(doc_id)

    def rewrite_after_rerun(self, run_id, doc_ids):
        for doc_id in doc_ids:
            self.finish(doc_id)


def test_the_loop_does_not_wait_and_nothing_is_finished_twice():
    f = SlowFinisher()
    with FinishQueue(f) as q:
        t0 = time.monotonic()
        f.waiting |= {1, 2}
        q.finish_ready()  # 1 and 2, in the finishing thread
        q.finish(2)  # queued behind: the look for documents left leaves 2 to it
        q.finish(2)  # asked twice before it started: once
        assert time.monotonic() - t0 < 1 and q.busy
        f.go.set()
        q.wait(30)
        assert not q.busy
    assert sorted(f.finished) == [1, 2] and f.finished.count(2) == 1


def test_an_error_of_a_finish_is_raised_on_the_loop_thread():
    f = SlowFinisher()
    f.fail = OSError(errno.ENOSPC, "No space left on device", "/outbox/d/document.pdf")
    f.go.set()
    with FinishQueue(f) as q:
        q.finish(7)
        q.wait(30)
        with pytest.raises(OSError) as e:
            q.check()
        assert infrastructure_problem(e.value) is not None
        q.check()  # raised once
        q.finish(7)  # the next try finishes it
    assert f.finished == [7]


def test_leaving_on_an_error_finishes_only_what_is_in_hand():
    f = SlowFinisher()
    with pytest.raises(RuntimeError), FinishQueue(f) as q:
        q.finish(1)
        q.finish(2)
        q.finish(3)
        threading.Timer(0.5, f.go.set).start()
        raise RuntimeError("the worker failed")
    assert f.finished in ([], [1])  # 2 and 3 wait for the next start's look for documents left


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_a_worker_killed_while_it_finishes_a_document_leaves_it_to_the_next(tmp_path, tiny_model_dir):
    """`uflash watch` frozen and killed (SIGKILL) once a document's chunks are all stored and before it is finished:
    the restart finishes it (outputs written, original archived), its pages stored once."""
    cfg = worker_config(tmp_path, tiny_model_dir, engine={"max_pages_per_chunk": 1}, worker={"prepare_processes": 1})
    s = load_settings(cfg)
    s.ensure_folders()
    make_pdf(s.inbox / "three.pdf", 3)
    proc = start_uflash(cfg, "watch")
    db = Database(s.database_url)

    def finishing(ss):
        doc = ss.scalar(select(Document))
        chunks = ss.scalars(select(Chunk)).all()
        stored = doc is not None and chunks and all(c.status == ChunkStatus.DONE for c in chunks)
        return [doc] if stored and doc.status != "done" else []

    freeze_while(proc, db, finishing)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    with db.session() as ss:
        assert ss.scalar(select(Document)).status != "done"
    r = uflash("--config", str(cfg), "run", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    with db.session() as ss:
        doc = ss.scalar(select(Document))
        pages = ss.scalars(select(Page.page_index)).all()
    assert doc.status == "done" and sorted(pages) == [1, 2, 3]
    out = json.loads((s.outbox / "three" / "document.json").read_text(encoding="utf-8"))
    assert [p["index"] for p in out["pages"]] == [1, 2, 3]
    assert (s.archive / "three.pdf").exists() and not (s.inbox / "three.pdf").exists()
    db.dispose()
