"""document.pdf: the scan with the recognised text over it, invisible, searchable; originals of every kind."""

import pymupdf
import pytest
from PIL import Image

from ingest.outputs.searchable_pdf import write_searchable_pdf
from tests.conftest import SAMPLES, make_pdf, probed_samples

PAGE = {"index": 1, "text": "", "boxes": [
    {"label": "title", "box": [100, 50, 900, 120], "text": "Stadtrat Protokoll 1923"},
    {"label": "table", "box": [100, 200, 900, 400], "text": "Erste Zeile äöü\n<table><tr><td>Miete</td><td>12</td>"},
    {"label": "text", "box": [100, 500, 900, 560], "text": "Ελληνικά 中文"},
]}


def scanned_pdf(path, size=(576, 768)):
    """An image-only page, as a scanner writes it (no text layer)."""
    img = path.with_suffix(".png")
    Image.new("L", (1200, 1600), 255).save(img)
    doc = pymupdf.open()
    page = doc.new_page(width=size[0], height=size[1])
    page.insert_image(page.rect, filename=str(img))
    doc.save(path)
    return path


def words(pdf_path):
    with pymupdf.open(pdf_path) as doc:
        return [doc[i].get_text("text") for i in range(doc.page_count)]


@pytest.mark.parametrize("kind", ["pdf", "png", "jpeg", "tiff"])
def test_the_text_is_searchable_invisible_and_inside_its_box(tmp_path, kind):
    if kind == "pdf":
        src = scanned_pdf(tmp_path / "scan.pdf")
    else:
        src = tmp_path / f"scan.{ {'png': 'png', 'jpeg': 'jpg', 'tiff': 'tif'}[kind] }"
        Image.new("L" if kind != "jpeg" else "RGB", (1200, 1600), "white").save(src, dpi=(150, 150))
    out = write_searchable_pdf(tmp_path / "document.pdf", src, kind, [PAGE])
    with pymupdf.open(out) as doc:
        page = doc[0]
        assert page.rect.width == pytest.approx(576, abs=1) and page.rect.height == pytest.approx(768, abs=1)
        text = page.get_text("text")
        for w in ("Stadtrat Protokoll 1923", "Erste Zeile äöü", "Miete 12", "Ελληνικά 中文"):
            assert w in text, text
        (hit,) = page.search_for("Protokoll")
        title = pymupdf.Rect(576 * 100 / 999, 768 * 50 / 999, 576 * 900 / 999, 768 * 120 / 999)
        assert title.contains(hit) or title.intersects(hit)
        pix = page.get_pixmap(dpi=30)
        assert min(pix.samples) >= 250  # a white scan stays white: the text is invisible


def test_born_digital_pages_keep_their_own_text_only_and_pages_without_boxes_get_their_text(tmp_path):
    doc = pymupdf.open(make_pdf(tmp_path / "digital.pdf", ["Original layer text"]))
    doc.insert_pdf(pymupdf.open(scanned_pdf(tmp_path / "scan.pdf", size=(595, 842))))
    doc.save(tmp_path / "mixed.pdf")
    pages = [{"index": 1, "text": "model text one", "boxes": [], "stats": {"orientation": {"turned": 90}}},
             {"index": 2, "text": "Plain page text without boxes", "boxes": []}]
    out = write_searchable_pdf(tmp_path / "out.pdf", tmp_path / "mixed.pdf", "pdf", pages)
    first, second = words(out)
    assert "Original layer text" in first and "model text one" not in first
    assert "Plain page text without boxes" in second
    with pymupdf.open(out) as d:  # left as it is: not even turned as the model read it
        assert d[0].rotation == 0


def test_multipage_tiff_with_exif_rotation(tmp_path):
    frames = [Image.new("1", (1000, 500), 1) for _ in range(3)]
    frames[0].save(tmp_path / "m.tif", save_all=True, append_images=frames[1:], compression="group4", dpi=(200, 200))
    pages = [{"index": i, "text": f"page {i}", "boxes": [{"label": "text", "box": [0, 0, 999, 999],
                                                          "text": f"Seite {i}"}]} for i in (1, 2, 3)]
    out = write_searchable_pdf(tmp_path / "out.pdf", tmp_path / "m.tif", "tiff", pages)
    with pymupdf.open(out) as doc:
        assert doc.page_count == 3 and doc[0].rect.width == pytest.approx(360) and doc[0].rect.height == pytest.approx(180)
    assert [t.strip() for t in words(out)] == ["Seite 1", "Seite 2", "Seite 3"]
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: shown (and read by the model) upright, as a portrait page
    Image.new("RGB", (1000, 500), "white").save(tmp_path / "cam.jpg", exif=exif, dpi=(100, 100))
    out = write_searchable_pdf(tmp_path / "cam.pdf", tmp_path / "cam.jpg", "jpeg", pages[:1])
    with pymupdf.open(out) as doc:
        assert doc[0].rect.width == pytest.approx(360) and doc[0].rect.height == pytest.approx(720)


@pytest.mark.skipif(not SAMPLES.is_dir(), reason="../shared/samples/real not present")
def test_real_samples_become_searchable_pdfs(tmp_path):
    made = 0
    for src, probed in probed_samples():
        pages = [{"index": i, "text": "", "boxes": [{"label": "text", "box": [50, 50, 950, 150],
                                                    "text": f"probe word {i}"}]} for i in range(1, probed.page_count + 1)]
        out = write_searchable_pdf(tmp_path / f"{src.stem}.pdf", src, probed.kind, pages)
        own = words(src) if probed.kind == "pdf" else [""] * probed.page_count
        # a page with its own text layer keeps it; every other page carries the text it was given, read back
        expected = [o if chars else f"probe word {i}" for i, (o, chars) in
                    enumerate(zip(own, probed.text_chars or (0,) * probed.page_count), start=1)]
        got = words(out)
        assert len(got) == probed.page_count, src.name
        assert [" ".join(t.split()) for t in got] == [" ".join(t.split()) for t in expected], src.name
        made += 1
    assert made >= 10
