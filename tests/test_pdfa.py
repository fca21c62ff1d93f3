"""document.pdf as PDF/A-2b without Ghostscript (OCRmyPDF's internal backend, pikepdf's PDF/A validator), with
Ghostscript on the PATH (Debian 12's 10.0.0 included) and hidden from it, for scans and for born-digital pages; the
standard 14 fonts a page names without embedding, embedded; a failed conversion or check never labelled PDF/A."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pikepdf
import pymupdf
import pytest
from PIL import Image, ImageDraw

from ingest.reading.words import plain_words
from tests.conftest import ROOT, assert_pdfa_2b, make_pdf

MODEL_TEXT = "<|det|>title [100, 60, 900, 120]<|/det|>Stadtrat Protokoll 1923\n" \
             "<|det|>text [100, 150, 900, 300]<|/det|>Die Sitzung begann um neun Uhr.\nAnwesend waren zwölf Räte."
BORN_DIGITAL = "Haushaltsplan der Stadt für 1924, beschlossen am 3. März"


def path_without_ghostscript(folder: Path) -> str:
    """A PATH with every program of the current PATH except Ghostscript (links in ``folder``)."""
    folder.mkdir(parents=True, exist_ok=True)
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(d):
            continue
        for entry in os.scandir(d):
            if entry.name not in ("gs", "gswin64c") and not (folder / entry.name).exists():
                (folder / entry.name).symlink_to(entry.path)
    return str(folder)


@pytest.fixture(params=["without Ghostscript", "with Ghostscript"])
def ghostscript(request, tmp_path, monkeypatch):
    if request.param == "with Ghostscript":
        if shutil.which("gs") is None:
            pytest.skip("Ghostscript is not installed (apt-get install ghostscript)")
    else:
        monkeypatch.setenv("PATH", path_without_ghostscript(tmp_path / "bin"))
        assert shutil.which("gs") is None
    return request.param


def scan_pdf(path: Path, n: int = 1) -> Path:
    doc = pymupdf.open()
    for i in range(n):
        img = Image.new("L", (1200, 1600), 255)
        ImageDraw.Draw(img).text((200, 200 + 100 * i), f"page {i + 1}", fill=0)
        png = path.with_name(f"{path.stem}-{i}.png")
        img.save(png)
        doc.new_page(width=576, height=768).insert_image(pymupdf.Rect(0, 0, 576, 768), filename=str(png))
    doc.save(path)
    return path


def write(tmp_path: Path, source: Path, texts: list[str]) -> tuple[str, Path, list[str]]:
    """``write_document_pdf`` for ``source`` with the model's ``texts``; returns (kind, document.pdf, warnings)."""
    from loguru import logger

    from ingest.outputs.pdfa import write_document_pdf

    pages = [{"index": i + 1, "text": t, "stats": {"image_size": [768, 1024]}} for i, t in enumerate(texts)]
    (tmp_path / "document.json").write_text(json.dumps({"pages": pages}), encoding="utf-8")
    said: list[str] = []
    sink = logger.add(said.append, level="WARNING", format="{message}")
    try:
        kind = write_document_pdf(tmp_path / "document.pdf", source, "pdf", pages, tmp_path / "document.json")
    finally:
        logger.remove(sink)
    return kind, tmp_path / "document.pdf", said


def test_a_scan_is_pdfa_2b(tmp_path, ghostscript):
    kind, out, said = write(tmp_path, scan_pdf(tmp_path / "scan.pdf", 2), [MODEL_TEXT, MODEL_TEXT])
    assert (kind, said) == ("pdfa-2b", [])
    assert_pdfa_2b(out)
    with pymupdf.open(out) as doc:
        assert [[w[4] for w in page.get_text("words")] for page in doc] == [plain_words(MODEL_TEXT)] * 2


def test_born_digital_pages_keep_their_text_and_are_pdfa_2b(tmp_path, ghostscript):
    """A born-digital page (Helvetica, not embedded: as PDF writers name the standard fonts) before a scanned one."""
    doc = pymupdf.open(make_pdf(tmp_path / "digital.pdf", [BORN_DIGITAL]))
    doc.insert_pdf(pymupdf.open(scan_pdf(tmp_path / "scan.pdf")))
    doc.save(tmp_path / "mixed.pdf")
    kind, out, said = write(tmp_path, tmp_path / "mixed.pdf",
                            ["<|det|>text [100, 100, 900, 200]<|/det|>model text one", MODEL_TEXT])
    assert (kind, said) == ("pdfa-2b", [])
    assert_pdfa_2b(out)
    with pymupdf.open(out) as doc:
        assert [w[4] for w in doc[0].get_text("words")] == BORN_DIGITAL.split()  # its own text, not the model's
        assert [w[4] for w in doc[1].get_text("words")] == plain_words(MODEL_TEXT)


def test_the_readme_example_is_pdfa_2b_and_looks_and_reads_as_the_original(tmp_path, ghostscript):
    """examples/sample.pdf: born digital, its text in CID fonts with a CFF program that is not CID-keyed (PyMuPDF's),
    which pikepdf's validator does not check until the program is rewritten CID-keyed."""
    sample = ROOT / "examples" / "sample.pdf"
    kind, out, said = write(tmp_path, sample, [MODEL_TEXT, MODEL_TEXT])
    assert (kind, said) == ("pdfa-2b", [])
    assert_pdfa_2b(out)
    with pymupdf.open(sample) as before, pymupdf.open(out) as after:
        assert any(f[2] == "Type0" for f in before.get_page_fonts(0))
        for a, b in zip(before, after, strict=True):
            assert a.get_text("words") == b.get_text("words")
            assert a.get_pixmap(dpi=50).samples == b.get_pixmap(dpi=50).samples


def test_the_standard_fonts_are_embedded_and_the_page_looks_and_reads_as_before(tmp_path):
    from ingest.outputs.pdfa_fonts import embed_standard_fonts

    doc = pymupdf.open()
    page = doc.new_page()
    for y, font in zip((100, 200, 300, 400), ("helv", "tiro", "cobi", "symb")):
        page.insert_text((72, y), "Zwölf Räte, 12,50 Mark" if font != "symb" else "abgd", fontname=font, fontsize=16)
    def seen(page):  # each character, where and in which font it is drawn, and the page's pixels
        chars = [(span["font"], span["size"], c["c"], c["origin"]) for block in page.get_text("rawdict")["blocks"]
                 for line in block["lines"] for span in line["spans"] for c in span["chars"]]
        return chars, page.get_pixmap(dpi=72).samples

    before = seen(page)
    assert sorted(embed_standard_fonts(doc)) == ["Courier-BoldOblique", "Helvetica", "Symbol", "Times-Roman"]
    doc.save(tmp_path / "embedded.pdf")
    with pymupdf.open(tmp_path / "embedded.pdf") as again:
        assert all(ext != "n/a" for _, ext, *_ in again.get_page_fonts(0))
        page = again[0]
        assert seen(page) == before and len(before[0]) == 3 * 22 + 4


def test_an_unembedded_font_outside_the_standard_14_without_ghostscript_gives_the_searchable_pdf(tmp_path,
                                                                                                 monkeypatch):
    """Arial named, not embedded: the internal backend refuses it and no Ghostscript can convert it; said so."""
    monkeypatch.setenv("PATH", path_without_ghostscript(tmp_path / "bin"))
    src = make_pdf(tmp_path / "arial.pdf", ["Bericht"])
    with pikepdf.open(src, allow_overwriting_input=True) as pdf:
        for _, font in pdf.pages[0].Resources.Font.items():
            font.BaseFont = pikepdf.Name("/Arial")
            font.Subtype = pikepdf.Name("/TrueType")
            font.FirstChar, font.LastChar, font.Widths = 32, 126, [600] * 95
        pdf.save(src)
    kind, out, said = write(tmp_path, src, ["<|det|>text [100, 100, 900, 200]<|/det|>Bericht"])
    assert kind == "searchable"
    assert len(said) == 1 and "not PDF/A" in said[0] and "internal:" in said[0] and "ghostscript:" in said[0]
    with pikepdf.open(out) as pdf:
        assert not pdf.open_metadata().pdfa_status
    with pymupdf.open(out) as doc:
        assert doc[0].get_text("text").split() == ["Bericht"]


def test_ocrmypdf_exit_10_is_never_labelled_pdfa(tmp_path, monkeypatch):
    """OCRmyPDF's ``pdfa_conversion_failed`` (10): it wrote a valid PDF that is not PDF/A. Both backends say so:
    document.pdf is the searchable PDF, the reason logged."""
    import ocrmypdf

    calls = []

    def ocr(input_file, output_file, **kw):
        calls.append(kw["pdfa_backend"])
        shutil.copy(input_file, output_file)
        return ocrmypdf.ExitCode.pdfa_conversion_failed

    monkeypatch.setattr(ocrmypdf, "ocr", ocr)
    kind, out, said = write(tmp_path, scan_pdf(tmp_path / "scan.pdf"), [MODEL_TEXT])
    assert kind == "searchable" and calls == ["internal", "ghostscript"]
    assert len(said) == 1 and "not PDF/A" in said[0] and "pdfa_conversion_failed (10)" in said[0]
    with pikepdf.open(out) as pdf:
        assert not pdf.open_metadata().pdfa_status
    with pymupdf.open(out) as doc:
        assert doc[0].get_text("text").split() == plain_words(MODEL_TEXT)


def test_a_file_that_claims_pdfa_but_fails_the_check_is_not_labelled_pdfa(tmp_path, monkeypatch):
    """OCRmyPDF ends with success, the file says PDF/A-2b in its XMP, pikepdf's validator refuses it (no output
    intent, a font not embedded): the searchable PDF, with the check's findings logged."""
    import ocrmypdf

    def ocr(input_file, output_file, **kw):
        make_pdf(Path(output_file), ["claims PDF/A"])
        with pikepdf.open(output_file, allow_overwriting_input=True) as pdf:
            with pdf.open_metadata() as meta:
                meta["pdfaid:part"], meta["pdfaid:conformance"] = "2", "B"
            pdf.save(output_file)
        return ocrmypdf.ExitCode.ok

    monkeypatch.setattr(ocrmypdf, "ocr", ocr)
    kind, out, said = write(tmp_path, scan_pdf(tmp_path / "scan.pdf"), [MODEL_TEXT])
    assert kind == "searchable"
    assert len(said) == 1 and "the PDF/A check failed: PDF/A-2b: " in said[0]
    with pikepdf.open(out) as pdf:
        assert not pdf.open_metadata().pdfa_status
