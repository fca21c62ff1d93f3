"""What became of every file, said where a person looks: `uflash run`'s output, `uflash report` (JSON), the run's review
page and `uflash status` each name every file a run touched (done, a duplicate, refused) with where it is now; refused
files and duplicates are tied to the run that took them in (a watcher's too); `uflash retry` puts refused files back
into the inbox; an original archived under a name in use has its outputs under the same name; and a ledger of the
schema before is migrated, on SQLite and on PostgreSQL."""

from __future__ import annotations

import html
import json
import re
import shutil
import threading
import time

from sqlalchemy import MetaData, Table, inspect, select, text

from db.models import Document, Duplicate, Rejected, SchemaVersion
from db.session import Database
from ingest.config import load_settings
from ingest.intake.enqueue import intake_file
from ingest.intake.watch import InboxWatcher
from ingest.ledger.owners import this_process
from ingest.review.report import collect_report
from ingest.worker.lifecycle import RunHandle
from tests.conftest import make_pdf, reopened, uflash, worker_config

GARBAGE = b"this is not a PDF at all\n" * 20


def _one_line_each(lines: list[str], expected: dict[str, tuple[str, str]]) -> None:
    """Each file named in exactly one of ``lines``, as ``OUTCOME NAME: ...`` with where it is now."""
    for name, (outcome, where) in expected.items():
        said = [line for line in lines if re.search(rf"(^|\s){re.escape(name)}: ", line)]
        assert len(said) == 1, (name, said, lines)
        assert said[0].strip().startswith(f"{outcome:<7} {name}: ") and where in said[0], (name, said[0])


def test_every_file_a_run_touched_is_named_with_what_became_of_it(tmp_path, tiny_model_dir):
    """Into the inbox: a good 2-page deed.pdf, its duplicate under another name, and three bad files (empty, not a PDF,
    of a type uflash does not read), one named like a file refused earlier. One `uflash run`: its output, `uflash
    report --json`, the review page and `uflash status` each name every file with what became of it and where it is:
    the deed done (archived as "deed (2).pdf", the archive holding a "deed.pdf" already, and its outputs in the
    folder of the same name), the duplicate moved aside with nothing decoded, each refused file in failed/ under the
    name it is stored as, with its reason; the earlier refusal of x.pdf is not this run's. (The same ledger queries
    run on PostgreSQL in the tests below.)"""
    cfg = worker_config(tmp_path, tiny_model_dir, engine={"max_tokens_per_page": 8})
    s = load_settings(cfg)
    s.ensure_folders()
    db = Database(s.database_url)
    (s.archive / "deed.pdf").write_bytes(b"an earlier original of that name")
    (s.inbox / "x.pdf").write_bytes(b"")
    assert intake_file(db, s, s.inbox / "x.pdf").outcome == "rejected"  # refused before, by no run: failed/x.pdf
    deed = make_pdf(s.inbox / "deed.pdf", ["Deed of sale, 1851.", "Witnesses."])
    shutil.copyfile(deed, s.inbox / "deed_copy.pdf")
    (s.inbox / "empty.pdf").write_bytes(b"")
    (s.inbox / "x.pdf").write_bytes(GARBAGE)
    (s.inbox / "notes.docx").write_bytes(b"PK\x03\x04 not really a docx")

    r = uflash("--config", str(cfg), "run", timeout=600)
    assert r.returncode == 4, r.stdout + r.stderr  # files refused
    with db.session() as ss:
        doc = ss.scalar(select(Document))
    expected = {"deed.pdf": ("done", f"-> {s.outbox / 'deed (2)'}; original archived as {s.archive / 'deed (2).pdf'}"),
                "deed_copy.pdf": ("duplicate", f"the same content as document {doc.id} (deed.pdf), nothing decoded; "
                                               f"moved to {s.archive / 'duplicates' / 'deed_copy.pdf'}"),
                "empty.pdf": ("refused", f"empty file (0 bytes); in {s.failed / 'empty.pdf'}"),
                "x.pdf": ("refused", f"; in {s.failed / 'x (2).pdf'}"),
                "notes.docx": ("refused", f"; in {s.failed / 'notes.docx'}")}
    said = [line for line in r.stdout.splitlines() if line.split(" ", 1)[0] in ("done", "duplicate", "refused")]
    assert len(said) == 5, r.stdout
    _one_line_each(said, expected)
    assert (s.outbox / "deed (2)" / "document.md").exists() and (s.archive / "deed (2).pdf").exists()
    assert (s.archive / "deed.pdf").read_bytes() == b"an earlier original of that name"
    assert not any(s.inbox.iterdir())
    note = (s.failed / "x (2).pdf.error.txt").read_text(encoding="utf-8")
    assert note.endswith(f'\nretry: uflash --config {cfg} retry --file "{s.failed / "x (2).pdf"}"\n'), note

    rep = json.loads(uflash("--config", str(cfg), "report", "--json", "--no-html").stdout)
    run_id = rep["run"]["id"]
    assert f"report  {s.outbox / 'reports' / f'run-{run_id}.html'}" in r.stdout
    assert rep["pages"] == 2 and len(rep["files"]) == 5, rep["files"]
    _one_line_each([f"{f['outcome']:<7} {f['words']}" for f in rep["files"]], expected)
    by_name = {f["name"]: f for f in rep["files"]}
    assert by_name["deed.pdf"]["original"] == str(s.archive / "deed (2).pdf")
    assert by_name["deed_copy.pdf"]["document_id"] == doc.id
    assert by_name["x.pdf"]["original"] == str(s.failed / "x (2).pdf") and "not a PDF" in by_name["x.pdf"]["reason"]

    page = (s.outbox / "reports" / f"run-{run_id}.html").read_text(encoding="utf-8")
    files = page[page.index("<section class='files'"):]
    files = files[:files.index("</section>")]
    items = re.findall(r"<li class='f-(\w+)'><strong>\1</strong> (.*?)</li>", files)
    assert len(items) == 5 and len(re.findall("<li", files)) == 5, files
    _one_line_each([f"{outcome:<7} {html.unescape(words)}" for outcome, words in items], expected)

    st = uflash("--config", str(cfg), "status").stdout
    assert "refused files: 4 (4 in failed/, 0 put back into the inbox)" in st, st
    for name, (_, where) in expected.items():
        assert re.search(rf"  \w+ +{re.escape(name)}: .*{re.escape(where)}", st), (name, st)
    assert f"refused x.pdf: empty file (0 bytes); in {s.failed / 'x.pdf'}" in st, st  # the earlier refusal, named apart
    db.dispose()


def test_uflash_retry_all_puts_refused_files_back_and_only_what_is_still_bad_is_refused_again(settings, db,
                                                                                              config_path):
    """Two refused files; one mended where it lies in failed/. `uflash retry --all` puts both back into the inbox under
    the names they were dropped with, their notes gone; taken in again, the mended one is a document and the other
    is refused again (a new refusal, in failed/ again); `uflash retry --file PATH` takes that one back, and a path
    that is no refused file is refused with the reason, changing nothing."""
    for name in ("empty.pdf", "scan.pdf"):
        (settings.inbox / name).write_bytes(b"" if name == "empty.pdf" else GARBAGE)
        assert intake_file(db, settings, settings.inbox / name).outcome == "rejected"
    make_pdf(settings.failed / "scan.pdf", ["The scan, copied again whole."])  # mended where it lies

    r = uflash("--config", str(config_path), "retry", "--all")
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("empty.pdf", "scan.pdf"):
        assert f"back    {name}: in the inbox as {settings.inbox / name}, to be taken in again" in r.stdout, r.stdout
    assert not any(settings.failed.iterdir()) and sorted(p.name for p in settings.inbox.iterdir()) == \
        ["empty.pdf", "scan.pdf"]
    assert intake_file(db, settings, settings.inbox / "scan.pdf").outcome == "document"
    again = intake_file(db, settings, settings.inbox / "empty.pdf")
    assert (again.outcome, again.moved_to) == ("rejected", settings.failed / "empty.pdf")
    st = json.loads(uflash("--config", str(config_path), "status", "--json").stdout)
    assert (st["rejected"], st["rejected_waiting"]) == (3, 1)
    assert [(f["name"], f["moved_to"]) for f in st["rejected_files"]] == [("empty.pdf", str(again.moved_to))]

    r = uflash("--config", str(config_path), "retry", "--file", str(settings.inbox / "scan.pdf"))
    assert r.returncode == 2 and "is neither a refused file nor a failed document's original: nothing retried" \
        in r.stderr, r.stdout + r.stderr
    assert (settings.failed / "empty.pdf").exists()
    r = uflash("--config", str(config_path), "retry", "--file", str(settings.failed / "empty.pdf"))
    assert r.returncode == 0 and f"back    empty.pdf: in the inbox as {settings.inbox / 'empty.pdf'}" in r.stdout
    r = uflash("--config", str(config_path), "retry", "--all")
    assert r.returncode == 0 and "nothing to retry: no document is failed and no refused file waits in failed/" \
        in r.stdout, r.stdout + r.stderr
    with db.session() as s:
        assert [r.retried_at is not None for r in s.scalars(select(Rejected).order_by(Rejected.id))] == [True] * 3


def test_a_watchers_refusals_and_duplicates_are_named_in_its_batchs_run(settings, db):
    """A watcher's intake records what it refuses and the duplicates it finds in its worker's run (opened by the first
    of them, without loading a model), which names them when it is closed; after that a new one opens."""
    make_pdf(settings.inbox / "a.pdf", ["a"])
    doc = intake_file(db, settings, settings.inbox / "a.pdf").document_id
    shutil.copyfile(settings.inbox / "a.pdf", settings.inbox / "a again.pdf")
    (settings.inbox / "bad.pdf").write_bytes(GARBAGE)
    settings.watch.settle_seconds = 0.0
    run = RunHandle(db, settings, this_process())
    watcher = InboxWatcher(settings, db, intake_run=run)
    watcher.rescan()
    closing = threading.Thread(target=run.close)  # a worker closing the run meanwhile waits for the file recorded
    with run.taking_in() as first:
        closing.start()
        closing.join(0.5)
        assert closing.is_alive() and run.id == first
    closing.join()
    deadline = time.monotonic() + 30
    taken = []
    while len(taken) < 3 and time.monotonic() < deadline:
        taken += watcher.poll()
    assert sorted(t.outcome for t in taken) == ["duplicate", "known", "rejected"]
    run_id, _ = run.close()
    assert run_id == first + 1
    rep = collect_report(db, run_id)
    assert [(f["outcome"], f["name"], f.get("document_id")) for f in rep["files"]] == [
        ("duplicate", "a again.pdf", doc), ("refused", "bad.pdf", None)]
    assert collect_report(db)["run"]["id"] == run_id  # the latest run: it took files in, though it stored no page
    assert run.close() == (None, [])


def _as_version_4(db: Database) -> None:
    """The ledger as version 4 made it: duplicates and rejected_files without run_id (nor its index) and retried_at,
    their rows kept (rebuilt: SQLite cannot drop a column that holds a foreign key)."""
    added = {"duplicates": {"run_id"}, "rejected_files": {"run_id", "retried_at"}}
    with db.engine.begin() as conn:
        meta = MetaData()
        meta.reflect(conn, only=["documents", "runs"])
        for table in (Duplicate.__table__, Rejected.__table__):
            kept = [c for c in table.columns if c.name not in added[table.name]]
            rows = [{k: v for k, v in r._mapping.items() if k != "id"} for r in conn.execute(select(*kept))]
            conn.execute(text(f"DROP TABLE {table.name}"))
            old = Table(table.name, meta, *(c._copy() for c in kept))
            old.create(conn)
            conn.execute(old.insert(), rows)
        conn.execute(SchemaVersion.__table__.delete())
        conn.execute(SchemaVersion.__table__.insert().values(version=4))


def test_a_version_4_ledger_is_migrated_to_runs_of_refusals_and_duplicates(settings, db):
    """Version 5 added duplicates.run_id, rejected_files.run_id (indexed) and rejected_files.retried_at: a version 4
    ledger gets them on open, its files kept with no run and not retried, and takes files in with a run after."""
    make_pdf(settings.inbox / "a.pdf", ["a"])
    doc = intake_file(db, settings, settings.inbox / "a.pdf").document_id
    shutil.copyfile(settings.inbox / "a.pdf", settings.inbox / "b.pdf")
    intake_file(db, settings, settings.inbox / "b.pdf")
    (settings.inbox / "bad.pdf").write_bytes(b"")
    intake_file(db, settings, settings.inbox / "bad.pdf")
    _as_version_4(db)
    with reopened(db) as again:
        with again.engine.connect() as conn:
            for table in ("duplicates", "rejected_files"):
                assert f"ix_{table}_run_id" in {i["name"] for i in inspect(conn).get_indexes(table)}
        with again.session() as s:
            assert [(d.document_id, d.run_id) for d in s.scalars(select(Duplicate))] == [(doc, None)]
            assert [(r.name, r.run_id, r.retried_at) for r in s.scalars(select(Rejected))] == [("bad.pdf", None, None)]
        run = RunHandle(again, settings, this_process())
        (settings.inbox / "bad.pdf").write_bytes(b"")
        intake_file(again, settings, settings.inbox / "bad.pdf", run=run)
        run_id, _ = run.close()
        assert [f["name"] for f in collect_report(again, run_id)["files"]] == ["bad.pdf"]
