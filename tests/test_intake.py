import os
import shutil

import pytest
from loguru import logger
from PIL import Image
from sqlalchemy import func, select, update

import ingest.intake.enqueue
from db.chunks import store_chunk
from db.models import Chunk, ChunkStatus, DocStatus, Document, Duplicate, Page, Rejected, Run
from db.queue import claim, fail
from db.session import Database
from ingest.errors import InputRejected
from ingest.intake.enqueue import intake_file
from ingest.intake.probe import probe_file
from tests.badfiles import make_bad_files
from tests.conftest import SAMPLES, make_pdf


def test_good_inputs_are_recorded_with_chunks(settings, db, tmp_path):
    pdf = make_pdf(settings.inbox / "seven.pdf", 7)
    tif = settings.inbox / "scan.tiff"
    frames = [Image.new("RGB", (200, 300), c) for c in ("white", "gray", "black")]
    frames[0].save(tif, save_all=True, append_images=frames[1:])
    png = settings.inbox / "page.png"
    Image.new("RGB", (100, 100), "white").save(png)
    jpg = settings.inbox / "photo.JPG"
    Image.new("RGB", (100, 100), "white").save(jpg, "JPEG")
    results = {p.name: intake_file(db, settings, p) for p in (pdf, tif, png, jpg)}
    assert {r.outcome for r in results.values()} == {"document"}
    with db.session() as s:
        docs = {d.original_name: d for d in s.scalars(select(Document))}
        assert docs["seven.pdf"].page_count == 7 and docs["seven.pdf"].kind == "pdf"
        assert docs["scan.tiff"].page_count == 3 and docs["scan.tiff"].kind == "tiff"
        assert docs["photo.JPG"].kind == "jpeg"
        for d in docs.values():  # chunks cover every page once, in order
            pages = [p for c in d.chunks for p in c.pages]
            assert pages == list(range(1, d.page_count + 1))


def test_same_content_twice_is_one_document_and_one_duplicate(settings, db):
    a = make_pdf(settings.inbox / "a.pdf", ["same words"])
    b = settings.inbox / "copy of a.pdf"
    shutil.copyfile(a, b)
    assert intake_file(db, settings, a).outcome == "document"
    r = intake_file(db, settings, b)
    assert r.outcome == "duplicate" and r.moved_to.parent == settings.archive / "duplicates"
    assert intake_file(db, settings, a).outcome == "known"  # the original seen again: nothing new
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Document)) == 1
        assert s.scalar(select(func.count()).select_from(Duplicate)) == 1


def test_every_bad_input_class_is_rejected_with_reason(settings, db, tmp_path):
    settings.watch.max_page_pixels = 1_000_000
    bad = make_bad_files(settings.inbox, tmp_path)
    for name, (path, why) in bad.items():
        r = intake_file(db, settings, path)
        assert r.outcome == "rejected", name
        assert why in r.reason, (name, r.reason)
        assert not path.exists()
        assert r.moved_to.parent == settings.failed and r.moved_to.exists()
        err = r.moved_to.with_name(r.moved_to.name + ".error.txt")
        assert why in err.read_text(encoding="utf-8")
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Rejected)) == len(bad)
        assert s.scalar(select(func.count()).select_from(Document)) == 0


def test_rejected_name_clash_never_overwrites(settings, db):
    for _ in range(2):
        (settings.inbox / "empty.pdf").write_bytes(b"")
        intake_file(db, settings, settings.inbox / "empty.pdf")
    names = sorted(p.name for p in settings.failed.iterdir())
    assert names == ["empty (2).pdf", "empty (2).pdf.error.txt", "empty.pdf", "empty.pdf.error.txt"]


def test_chunks_respect_page_cap(settings, db):
    settings.engine.max_pages_per_chunk = 4
    pdf = make_pdf(settings.inbox / "ten.pdf", 10)
    intake_file(db, settings, pdf)
    with db.session() as s:
        ranges = [(c.first_page, c.last_page) for c in s.scalars(select(Chunk).order_by(Chunk.first_page))]
    assert ranges == [(1, 4), (5, 8), (9, 10)]


# Each real sample's kind and page count, counted by hand from the files (multipage.pdf holds six scans,
# cardinal.pdf one page rotated four ways); the two that are not documents are refused.
REAL_SAMPLES = {
    "aspect.pdf": ("pdf", 1), "baiona.png": ("png", 1), "c02-22.pdf": ("pdf", 1), "cardinal.pdf": ("pdf", 4),
    "ccitt.pdf": ("pdf", 1), "epson.pdf": ("pdf", 1), "francais.pdf": ("pdf", 1), "graph_ocred.pdf": ("pdf", 1),
    "jbig2.pdf": ("pdf", 1), "kcs.pdf": ("pdf", 1), "linn.pdf": ("pdf", 1), "multipage.pdf": ("pdf", 6),
    "no_contents.pdf": ("pdf", 1), "skew.pdf": ("pdf", 1), "trivial.pdf": ("pdf", 1), "typewriter.png": ("png", 1),
}
REAL_REFUSED = {"invalid.pdf", "linn.txt"}


@pytest.mark.skipif(not SAMPLES.is_dir(), reason="../shared/samples/real not present")
def test_real_world_samples(settings):
    names = {p.name for p in SAMPLES.iterdir()}
    assert names == set(REAL_SAMPLES) | REAL_REFUSED, "every sample has its expected kind and page count here"
    for name in sorted(REAL_REFUSED):
        with pytest.raises(InputRejected):
            probe_file(SAMPLES / name, settings.watch.max_page_pixels)
    got = {name: probe_file(SAMPLES / name, settings.watch.max_page_pixels) for name in REAL_SAMPLES}
    assert {name: (p.kind, p.page_count) for name, p in got.items()} == REAL_SAMPLES


@pytest.mark.skipif(not SAMPLES.is_dir(), reason="../shared/samples/real not present")
def test_real_scans_saved_as_tiff_and_jpeg(settings, tmp_path):
    """The real scans the samples hold only as PNG, saved as a three-page TIFF and as JPEG: same pages."""
    pages = [Image.open(SAMPLES / n).convert("RGB") for n in ("typewriter.png", "baiona.png", "typewriter.png")]
    tif, jpg = tmp_path / "scans.tif", tmp_path / "typewriter.jpg"
    pages[0].save(tif, save_all=True, append_images=pages[1:])
    pages[0].save(jpg, "JPEG")
    got = {p.name: probe_file(p, settings.watch.max_page_pixels) for p in (tif, jpg)}
    assert {name: (p.kind, p.page_count) for name, p in got.items()} == {"scans.tif": ("tiff", 3),
                                                                        "typewriter.jpg": ("jpeg", 1)}


def test_files_named_outside_the_inbox_are_copied_never_moved(settings, db, tmp_path):
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    empty = shelf / "empty.pdf"
    empty.write_bytes(b"")
    r = intake_file(db, settings, empty)
    assert r.outcome == "rejected" and empty.exists(), "a refused file outside the inbox stays where it is"
    assert r.moved_to.parent == settings.failed and r.moved_to.exists()
    a = make_pdf(shelf / "a.pdf", ["same words"])
    assert intake_file(db, settings, a).outcome == "document" and a.exists()
    b = shelf / "b.pdf"
    shutil.copyfile(a, b)
    dup = intake_file(db, settings, b)
    assert dup.outcome == "duplicate" and dup.moved_to is None and b.exists()


def _half_done_then_failed(db) -> int:
    """Chunk 1-2 of the only document done (its pages stored), chunk 3-4 failed for good: a failed document."""
    with db.session() as s, s.begin():
        run = Run(mode="plain", model="test", engine_version="test")
        s.add(run)
        s.flush()
        run_id = run.id
    c = claim(db, "w", lease_seconds=60, max_attempts=3)
    store_chunk(db, c, run_id, [dict(page_index=i, text=f"page {i}") for i in (1, 2)])
    c2 = claim(db, "w", lease_seconds=60, max_attempts=3)
    assert fail(db, c2, "original file is gone", max_attempts=3, backoff_seconds=0, permanent=True) == "failed"
    return c.document_id


def test_failed_document_is_retried_when_its_content_is_dropped_again(settings, db):
    settings.engine.max_pages_per_chunk = 2
    a = make_pdf(settings.inbox / "a.pdf", 4)
    doc_id = intake_file(db, settings, a).document_id
    _half_done_then_failed(db)
    with db.session() as s:
        assert s.get(Document, doc_id).status == DocStatus.FAILED
    assert intake_file(db, settings, a).outcome == "known", "the failed original seen again by a rescan: no retry"
    content = a.read_bytes()
    a.unlink()
    again = settings.inbox / "a again.pdf"
    again.write_bytes(content)
    messages = []
    sink = logger.add(lambda m: messages.append(m.record["message"]), level="INFO")
    try:
        r = intake_file(db, settings, again)
    finally:
        logger.remove(sink)
    assert r.outcome == "requeued" and r.document_id == doc_id and again.exists()
    assert any(m.startswith(f"re-queued failed document {doc_id} from a again.pdf") for m in messages), messages
    with db.session() as s:
        doc = s.get(Document, doc_id)
        assert (doc.status, doc.error, doc.archived_path) == (DocStatus.QUEUED, None, None)
        assert (doc.original_path, doc.original_name) == (str(again), "a again.pdf")
        chunks = s.scalars(select(Chunk).order_by(Chunk.first_page)).all()
        assert [(c.status, c.attempts, c.last_error) for c in chunks] == [
            (ChunkStatus.DONE, 1, None), (ChunkStatus.QUEUED, 0, None)], "done pages stay done"
        assert s.scalar(select(func.count()).select_from(Page)) == 2
        assert s.scalar(select(func.count()).select_from(Duplicate)) == 0
    c = claim(db, "w2", lease_seconds=60, max_attempts=3)
    assert (c.document_id, c.first_page, c.attempts) == (doc_id, 3, 1)
    assert intake_file(db, settings, again).outcome == "known"


def test_failed_document_is_retried_when_its_file_is_touched(settings, db):
    a = make_pdf(settings.inbox / "a.pdf", 1)
    doc_id = intake_file(db, settings, a).document_id
    c = claim(db, "w", lease_seconds=60, max_attempts=3)
    fail(db, c, "cannot render: boom", max_attempts=3, backoff_seconds=0, permanent=True)
    st = a.stat()
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    assert intake_file(db, settings, a).outcome == "requeued" and a.exists()
    with db.session() as s:
        assert s.get(Document, doc_id).status == DocStatus.QUEUED
        assert s.scalar(select(Chunk.status)) == ChunkStatus.QUEUED


def test_a_failed_file_named_again_on_purpose_is_retried_but_not_by_a_rescan(settings, db, tmp_path):
    """`uflash run PATH` on the unchanged file of a failed document re-queues it (retry_failed); the watcher's
    rescan of the same file does not (it would retry it forever)."""
    outside = make_pdf(tmp_path / "elsewhere" / "a.pdf", 1)
    doc_id = intake_file(db, settings, outside, retry_failed=True).document_id
    c = claim(db, "w", lease_seconds=60, max_attempts=3)
    fail(db, c, "cannot render: boom", max_attempts=3, backoff_seconds=0, permanent=True)
    assert intake_file(db, settings, outside).outcome == "known"
    r = intake_file(db, settings, outside, retry_failed=True)
    assert (r.outcome, r.document_id) == ("requeued", doc_id) and outside.exists()
    with db.session() as s:
        assert s.get(Document, doc_id).status == DocStatus.QUEUED
        assert s.scalar(select(Chunk.status)) == ChunkStatus.QUEUED
    assert intake_file(db, settings, outside, retry_failed=True).outcome == "known", "queued: nothing to retry"


def _failed_and_filed(settings, db, path) -> int:
    """``path`` taken in, its only chunk failed for good, and failed documents filed away (as the worker does)."""
    from ingest.intake.failed import file_failed

    doc_id = intake_file(db, settings, path).document_id
    c = claim(db, "w", lease_seconds=60, max_attempts=3)
    assert fail(db, c, "cannot render: boom", max_attempts=3, backoff_seconds=0, permanent=True) == "failed"
    assert file_failed(settings, db) == [settings.failed / path.name]
    return doc_id


def test_a_failed_documents_original_goes_to_failed_and_dropped_again_it_is_retried(settings, db):
    """A failed document's original goes to failed/ beside its reason (once). The rule for failed content still
    holds: dropped into the inbox again, it is retried; also when it is the very file moved back (same name, same
    mtime), and failed/ keeps nothing of it then. A copy dropped under another name is retried the same way (the
    copy left in failed/ is removed)."""
    from ingest.intake.failed import file_failed

    a = make_pdf(settings.inbox / "a.pdf", 1)
    doc_id = _failed_and_filed(settings, db, a)
    kept = settings.failed / "a.pdf"
    assert not a.exists() and kept.exists()
    note = (settings.failed / "a.pdf.error.txt").read_text(encoding="utf-8")
    assert f"file: {a}\n" in note and "reason: pages 1-1: cannot render: boom\n" in note, note
    assert note.endswith(f"\nretry: uflash --config {settings.config_file} retry --doc {doc_id}\n"), note
    assert file_failed(settings, db) == []  # filed once
    with db.session() as s:
        assert s.get(Document, doc_id).failed_path == str(kept)
    shutil.move(kept, a)  # dropped into the inbox again: the very file, under its name and mtime
    r = intake_file(db, settings, a)
    assert (r.outcome, r.document_id) == ("requeued", doc_id)
    assert not any(settings.failed.iterdir())
    with db.session() as s:
        doc = s.get(Document, doc_id)
        assert (doc.status, doc.failed_path, doc.original_path) == (DocStatus.QUEUED, None, str(a))
    assert intake_file(db, settings, a).outcome == "known", "waiting in the inbox: a rescan leaves it"
    c = claim(db, "w", lease_seconds=60, max_attempts=3)
    fail(db, c, "cannot render: boom again", max_attempts=3, backoff_seconds=0, permanent=True)
    assert file_failed(settings, db) == [kept] and not a.exists()
    copy = settings.inbox / "a copy.pdf"
    shutil.copyfile(kept, copy)
    assert intake_file(db, settings, copy).outcome == "requeued" and copy.exists()
    assert not any(settings.failed.iterdir())


def test_a_failed_original_that_cannot_be_moved_stays_and_is_not_retried_by_a_rescan(settings, db, monkeypatch):
    """An original that cannot be moved into failed/ (access denied) stays in the inbox, recorded there: a rescan
    of the inbox does not retry it (it would fail again, for ever), as before."""
    import ingest.intake.failed

    def denied(src, dest):
        raise PermissionError(13, "Permission denied", src)

    monkeypatch.setattr(ingest.intake.failed.shutil, "move", denied)
    a = make_pdf(settings.inbox / "a.pdf", 1)
    doc_id = intake_file(db, settings, a).document_id
    fail(db, claim(db, "w", 60, 3), "cannot render: boom", 3, 0, permanent=True)
    assert ingest.intake.failed.file_failed(settings, db) == [] and a.exists()
    with db.session() as s:
        assert s.get(Document, doc_id).failed_path == str(a)
    assert not any(settings.failed.iterdir())
    assert intake_file(db, settings, a).outcome == "known"
    assert ingest.intake.failed.file_failed(settings, db) == []  # not tried again at every look


def test_retry_puts_a_failed_original_back_and_queues_its_document(settings, db, tmp_path):
    """`uflash retry`: the original moved into failed/ goes back to the inbox, a copy of a file named outside the
    inbox is removed (the file stays where the user keeps it), the notes go, the failed chunks are queued with their
    attempts reset; an unknown id and a document that is not failed are refused, changing nothing."""
    from ingest.intake.failed import file_failed, retry_document

    a = make_pdf(settings.inbox / "a.pdf", 1)
    doc_a = _failed_and_filed(settings, db, a)
    outside = make_pdf(tmp_path / "shelf" / "b.pdf", ["b"])
    doc_b = intake_file(db, settings, outside).document_id
    fail(db, claim(db, "w", 60, 3), "ValueError: boom", 3, 0, permanent=True)
    assert file_failed(settings, db) == [settings.failed / "b.pdf"] and outside.exists()
    for bad, error in ((999, LookupError), (doc_b + 1, LookupError)):
        with pytest.raises(error, match=f"no document {bad}"):
            retry_document(settings, db, bad)
    doc, n, where = retry_document(settings, db, doc_a)
    assert (n, where, doc.error) == (1, a, "pages 1-1: cannot render: boom") and a.exists()
    with pytest.raises(ValueError, match=f"document {doc_a} \\(a.pdf\\) is queued, not failed"):
        retry_document(settings, db, doc_a)
    doc, n, where = retry_document(settings, db, doc_b)
    assert (n, where) == (1, outside) and outside.exists()
    assert not any(settings.failed.iterdir())
    with db.session() as s:
        docs = [s.get(Document, d) for d in (doc_a, doc_b)]
        chunks = s.scalars(select(Chunk).order_by(Chunk.id)).all()
    assert [(d.status, d.failed_path, d.original_path) for d in docs] == [
        (DocStatus.QUEUED, None, str(a)), (DocStatus.QUEUED, None, str(outside))]
    assert [(c.status, c.attempts, c.last_error) for c in chunks] == [(ChunkStatus.QUEUED, 0, None)] * 2


def test_retry_puts_the_original_back_beside_another_file_that_took_its_name(settings, db):
    """While a.pdf waited in failed/, another a.pdf was dropped into the inbox (a document of its own): the retried
    original goes back as "a (2).pdf", and that is its original from now on; the other file is left alone."""
    from ingest.intake.failed import retry_document

    doc_id = _failed_and_filed(settings, db, make_pdf(settings.inbox / "a.pdf", 1))
    other = make_pdf(settings.inbox / "a.pdf", ["another scan under the same name"])
    _, n, where = retry_document(settings, db, doc_id)
    assert (n, where) == (1, settings.inbox / "a (2).pdf") and where.exists() and other.exists()
    with db.session() as s:
        doc = s.get(Document, doc_id)
    assert (doc.status, doc.original_path, doc.original_name) == (DocStatus.QUEUED, str(where), "a (2).pdf")
    assert intake_file(db, settings, where).outcome == "known" and intake_file(db, settings, other).outcome == "document"


def test_uflash_retry_says_what_it_did_and_refuses_unknown_ids(settings, db, config_path):
    from tests.conftest import uflash

    r = uflash("--config", str(config_path), "retry", "--all")
    assert r.returncode == 0 and "nothing to retry: no document is failed" in r.stdout, r.stdout + r.stderr
    doc_id = _failed_and_filed(settings, db, make_pdf(settings.inbox / "a.pdf", 1))
    r = uflash("--config", str(config_path), "retry", "--doc", str(doc_id), "--doc", "77")
    assert r.returncode == 2 and "no document 77 in the ledger: nothing retried" in r.stderr, r.stdout + r.stderr
    assert (settings.failed / "a.pdf").exists()
    r = uflash("--config", str(config_path), "retry", "--all")
    assert r.returncode == 0 and f"queued  #{doc_id} a.pdf: 1 chunk(s) again, its original at " \
        f"{settings.inbox / 'a.pdf'}" in r.stdout, r.stdout + r.stderr
    assert (settings.inbox / "a.pdf").exists() and not any(settings.failed.iterdir())
    r = uflash("--config", str(config_path), "retry", "--doc", str(doc_id))
    assert r.returncode == 2 and f"document {doc_id} (a.pdf) is queued, not failed" in r.stderr, r.stderr


def test_renamed_waiting_file_stays_its_document(settings, db):
    a = make_pdf(settings.inbox / "a.pdf", ["renamed while it waits"])
    doc_id = intake_file(db, settings, a).document_id
    renamed = a.rename(settings.inbox / "A b.pdf")
    r = intake_file(db, settings, renamed)
    assert r.outcome == "moved" and r.document_id == doc_id and renamed.exists()
    with db.session() as s:
        doc = s.get(Document, doc_id)
        assert (doc.original_path, doc.original_name, doc.status) == (str(renamed), "A b.pdf", DocStatus.QUEUED)
        assert s.scalar(select(func.count()).select_from(Duplicate)) == 0
    assert intake_file(db, settings, renamed).outcome == "known"
    copy = settings.inbox / "copy.pdf"
    shutil.copyfile(renamed, copy)
    assert intake_file(db, settings, copy).outcome == "duplicate", "a copy beside the original is still a duplicate"
    assert renamed.exists() and not copy.exists()


def test_two_intakes_of_one_file_at_once_leave_it_in_place(settings, db, monkeypatch):
    """The loser of the race (IntegrityError on the sha) must not move the winner's only copy aside."""
    a = make_pdf(settings.inbox / "a.pdf", 2)
    real_probe = ingest.intake.enqueue.probe_file
    won = []

    def probe_while_another_intake_wins(path, max_pixels):
        monkeypatch.setattr(ingest.intake.enqueue, "probe_file", real_probe)
        other = Database(settings.database_url)  # the other process, with its own connection
        try:
            won.append(intake_file(other, settings, path))
        finally:
            other.dispose()
        return real_probe(path, max_pixels)

    monkeypatch.setattr(ingest.intake.enqueue, "probe_file", probe_while_another_intake_wins)
    r = intake_file(db, settings, a)
    assert won[0].outcome == "document"
    assert r.outcome == "known" and r.document_id == won[0].document_id
    assert a.exists() and not (settings.archive / "duplicates").exists()
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Document)) == 1
        assert s.scalar(select(func.count()).select_from(Duplicate)) == 0


def test_finished_document_dropped_again_under_its_name_is_a_duplicate(settings, db):
    a = make_pdf(settings.inbox / "a.pdf", ["done already"])
    doc_id = intake_file(db, settings, a).document_id
    content = a.read_bytes()
    archived = shutil.move(a, settings.archive / "a.pdf")
    with db.engine.begin() as conn:
        conn.execute(update(Document.__table__).where(Document.id == doc_id)
                     .values(status=DocStatus.DONE, archived_path=str(archived)))
    a.write_bytes(content)
    r = intake_file(db, settings, a)
    assert r.outcome == "duplicate" and r.moved_to.parent == settings.archive / "duplicates" and not a.exists()


def test_a_cut_short_file_within_the_grace_time_is_left_in_place(settings, db, tmp_path):
    data = make_pdf(tmp_path / "a.pdf", 2).read_bytes()
    path = settings.inbox / "arriving.pdf"
    path.write_bytes(data[: len(data) // 2])
    res = intake_file(db, settings, path, incomplete_grace_s=60)
    assert res.outcome == "incomplete" and "truncated PDF" in res.reason and path.exists()
    with db.session() as s:
        assert s.scalar(select(func.count()).select_from(Rejected)) == 0
    os.utime(path, (path.stat().st_atime, path.stat().st_mtime - 120))  # unchanged for two minutes: refused
    res = intake_file(db, settings, path, incomplete_grace_s=60)
    assert res.outcome == "rejected" and "unchanged for 60 s" in res.reason and not path.exists()
