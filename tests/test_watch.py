"""The real watcher in a real process, fed by real copies and slow writers."""

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import func, select

from db.models import Document, Duplicate, Rejected
from db.session import Database
from ingest.config import load_settings
from tests.badfiles import make_bad_files
from tests.conftest import ROOT, make_pdf, wait_until, write_config


def start_watch(cfg):
    """Start ``uflash watch`` and return once it says it is watching."""
    proc = subprocess.Popen([sys.executable, "-m", "ingest.commands.cli", "--config", str(cfg), "watch", "--intake-only"],
                            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc.lines = []
    reader = threading.Thread(target=lambda: proc.lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    proc.reader = reader
    assert wait_until(lambda: any("watching" in line for line in proc.lines), timeout=60), proc.lines
    return proc


def counts(db):
    with db.session() as s:
        return (s.scalar(select(func.count()).select_from(Document)),
                s.scalar(select(func.count()).select_from(Duplicate)),
                s.scalar(select(func.count()).select_from(Rejected)))


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    proc.reader.join(timeout=10)
    out = "".join(proc.lines)
    assert proc.returncode == 0, out
    return out


def sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_200_files_dropped_at_once_become_200_documents(tmp_path):
    cfg = write_config(tmp_path, watch={"settle_seconds": 2.0, "rescan_seconds": 3.0})
    settings = load_settings(cfg)
    stage = tmp_path / "stage"
    sources = [make_pdf(stage / f"doc{i:03d}.pdf", [f"document {i}\n" + "lorem ipsum " * (i % 7 + 1)])
               for i in range(200)]
    expected = {sha(p) for p in sources}
    assert len(expected) == 200
    proc = start_watch(cfg)
    try:

        def copy(p):
            shutil.copyfile(p, settings.inbox / p.name)

        def slow_write(p, pieces=6, gap=0.6):
            data = p.read_bytes()
            step = len(data) // pieces + 1
            with open(settings.inbox / p.name, "wb") as f:
                for k in range(0, len(data), step):
                    f.write(data[k : k + step])
                    f.flush()
                    time.sleep(gap)

        with ThreadPoolExecutor(max_workers=60) as pool:
            futs = [pool.submit(slow_write, p) for p in sources[:50]] + [pool.submit(copy, p) for p in sources[50:]]
            for f in futs:
                f.result()
        db = Database(settings.database_url)
        assert wait_until(lambda: counts(db)[0] + counts(db)[2] >= 200, timeout=120), counts(db)
        time.sleep(3)  # a late double-take would show up now
        assert counts(db) == (200, 0, 0)
        with db.session() as s:
            shas = set(s.scalars(select(Document.sha256)))
        assert shas == expected  # every document is the complete file, never a partial one
    finally:
        out = stop(proc)
    assert "Traceback" not in out


def test_watcher_survives_bad_files_and_duplicates(tmp_path, ledger_url):
    cfg = write_config(tmp_path, watch={"settle_seconds": 0.5, "rescan_seconds": 1.0, "max_page_pixels": 1_000_000,
                                        "incomplete_grace_seconds": 2},  # truncated files: refused after 2 s
                       database={"url": ledger_url})
    settings = load_settings(cfg)
    proc = start_watch(cfg)
    try:
        bad = make_bad_files(settings.inbox, tmp_path)
        db = Database(settings.database_url)
        assert wait_until(lambda: counts(db)[2] == len(bad), timeout=60), counts(db)
        a = make_pdf(tmp_path / "a.pdf", ["the same text"])
        shutil.copyfile(a, settings.inbox / "first.pdf")
        shutil.copyfile(a, settings.inbox / "second name.pdf")
        make_pdf(settings.inbox / "other.pdf", 2)
        assert wait_until(lambda: counts(db)[:2] == (2, 1), timeout=60), counts(db)
        assert proc.poll() is None, "the watcher must still be running"
        for name, (_, why) in bad.items():
            err = settings.failed / (name + ".error.txt")
            assert err.exists() and why in err.read_text(encoding="utf-8"), name
        assert sorted(p.name for p in settings.inbox.iterdir()) == ["first.pdf", "other.pdf"] or \
            sorted(p.name for p in settings.inbox.iterdir()) == ["other.pdf", "second name.pdf"]
    finally:
        stop(proc)


def test_restart_does_not_record_files_twice(tmp_path, ledger_url):
    cfg = write_config(tmp_path, watch={"settle_seconds": 0.3, "rescan_seconds": 0.5}, database={"url": ledger_url})
    settings = load_settings(cfg)
    for i in range(5):
        make_pdf(settings.inbox / f"d{i}.pdf", [f"text {i}"])
    db = Database(settings.database_url)
    for start in range(2):  # the second start finds the same files still queued in the inbox
        proc = start_watch(cfg)
        assert wait_until(lambda: counts(db)[0] == 5, timeout=60)
        if start == 1:  # a file dropped now is taken after the 5 it found at its start: once it is in, they were seen
            make_pdf(settings.inbox / "later.pdf", ["later text"])
            assert wait_until(lambda: counts(db)[0] == 6, timeout=60), counts(db)
        stop(proc)
    assert counts(db) == (6, 0, 0)


def test_a_stalled_copy_waits_in_the_inbox_and_is_taken_once_complete(tmp_path):
    """A PDF whose writer pauses longer than the settle time looks cut short (no %%EOF): it stays in the inbox
    (said once in the log) and becomes a document when the rest arrives; one still cut short after the grace time
    is refused. Folders and temporary names in the inbox are named in the log, not ignored unseen."""
    cfg = write_config(tmp_path, watch={"settle_seconds": 0.5, "rescan_seconds": 1.0, "incomplete_grace_seconds": 8})
    settings = load_settings(cfg)
    data = make_pdf(tmp_path / "slow.pdf", 3).read_bytes()
    settings.inbox.mkdir(parents=True, exist_ok=True)
    (settings.inbox / "Batch 2024-12").mkdir()
    (settings.inbox / "~scan.pdf").write_bytes(data)
    proc = start_watch(cfg)
    try:
        db = Database(settings.database_url)
        with open(settings.inbox / "slow.pdf", "wb") as f:
            f.write(data[: len(data) // 2])
        (settings.inbox / "cut.pdf").write_bytes(data[: len(data) // 2])
        # both looked at once settled (the next look comes 8 s later, or when a file changes): kept, nothing recorded
        assert wait_until(lambda: all(any(f"{name} looks incomplete" in line for line in proc.lines)
                                      for name in ("slow.pdf", "cut.pdf")), timeout=60), proc.lines
        assert counts(db) == (0, 0, 0) and (settings.inbox / "slow.pdf").exists()
        with open(settings.inbox / "slow.pdf", "ab") as f:
            f.write(data[len(data) // 2:])
        assert wait_until(lambda: counts(db)[0] == 1, timeout=60), counts(db)
        assert wait_until(lambda: counts(db)[2] == 1, timeout=60), counts(db)  # cut.pdf, after the grace time
        err = (settings.failed / "cut.pdf.error.txt").read_text(encoding="utf-8")
        assert "truncated PDF" in err and "unchanged for 8 s" in err
    finally:
        out = stop(proc)
    assert out.count("slow.pdf looks incomplete") == 1
    assert "folder Batch 2024-12 in the inbox is not looked into" in out and "~scan.pdf in the inbox is not taken" in out
