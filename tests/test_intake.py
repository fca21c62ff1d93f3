import io
import shutil

import pytest
from PIL import Image
from sqlalchemy import func, select

from db.models import Chunk, Document, Duplicate, Rejected
from ingest.errors import InputRejected
from ingest.intake import intake_file
from ingest.probe import probe_file
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


@pytest.mark.skipif(not SAMPLES.is_dir(), reason="../shared/samples/real not present")
def test_real_world_samples(settings):
    expect_bad = {"invalid.pdf", "linn.txt"}
    for p in sorted(SAMPLES.iterdir()):
        if p.name in expect_bad:
            with pytest.raises(InputRejected):
                probe_file(p, settings.watch.max_page_pixels)
        elif p.suffix.lower() in (".pdf", ".png"):
            assert probe_file(p, settings.watch.max_page_pixels).page_count >= 1, p.name


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
