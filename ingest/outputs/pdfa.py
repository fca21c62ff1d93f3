"""``document.pdf`` as PDF/A-2b, built by OCRmyPDF from the words uflash decoded, checked before it is called PDF/A.

OCRmyPDF is what archives already run to make PDF/A; here it takes uflash as its OCR engine
(ingest.commands.ocrmypdf_plugin, given the ``document.json`` just written: no second decode) and does the rest: each
page's invisible text layer, word by word from the one word layout (ingest.reading.words), so that selecting a word in a
viewer selects that word; embedded fonts; the PDF/A-2b declarations and its XMP identification.

- The scan under the text: a PDF original's own pages; an image original (TIFF, PNG, JPEG) one page per frame, as
  the searchable PDF makes them (ingest.outputs.searchable_pdf: upright, at the image's DPI).
- A page the model read turned is shown turned the same way (the plugin reports the turn to OCRmyPDF, which turns
  the page), so its words fit the page as displayed. A page that already has a text layer (born digital) keeps its
  own text (OCRmyPDF's ``skip`` mode); the standard 14 fonts it names without embedding are embedded first, and
  CID fonts with a CFF program that is not CID-keyed (PyMuPDF's) rewritten CID-keyed (ingest.outputs.pdfa_fonts).
- The PDF/A is made without Ghostscript: OCRmyPDF's internal backend (``pdfa_backend="internal"``) adds the PDF/A
  structures with pikepdf and keeps the file only if pikepdf's PDF/A validator approves it, on any machine and
  with any Ghostscript installed. Only when that backend refuses the file (a font that is not embedded and not one
  of the standard 14, colours PDF/A-2b does not allow) is Ghostscript asked to convert it, where a Ghostscript
  OCRmyPDF accepts for the document is installed (newer than 10.02.0 for a document with a text layer).
- Whatever made it, the file written is ``pdfa-2b`` only when OCRmyPDF ended with success and pikepdf's PDF/A
  validator approves the file. Otherwise (OCRmyPDF missing, its exit 10 ``pdfa_conversion_failed``, a file it
  refuses, a failed check) the log says why and ``document.pdf`` is the searchable PDF of
  ingest.outputs.searchable_pdf instead (not PDF/A).
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path
from typing import Any

import pymupdf
from loguru import logger

from ingest.files import write_atomic
from ingest.outputs.searchable_pdf import _image_pages, _pdf_pages, write_searchable_pdf

PLUGIN = "ingest.commands.ocrmypdf_plugin"
FLAVOUR = "2b"


class NotPdfa(RuntimeError):
    """OCRmyPDF wrote no PDF/A-2b that passes the check; the message says why."""


def _scan_pdf(source: Path, kind: str, out: Path) -> bool:
    """The pages OCRmyPDF works on: the original's (decrypted), their fonts made checkable (ingest.outputs.pdfa_fonts).
    Returns whether a page has a text layer of its own."""
    import pikepdf

    from ingest.outputs.pdfa_fonts import cid_key_cff_fonts, embed_standard_fonts

    doc = _pdf_pages(source) if kind == "pdf" else _image_pages(source)
    try:
        has_text = any(page.get_text("text").strip() for page in doc)
        if has_text:
            embed_standard_fonts(doc)
        data = doc.tobytes(garbage=1, encryption=pymupdf.PDF_ENCRYPT_NONE)
    finally:
        doc.close()
    # MuPDF writes the document information into the catalog, where PDF/A allows no /Info: it belongs in the trailer
    with pikepdf.open(io.BytesIO(data)) as pdf:
        if has_text:
            cid_key_cff_fonts(pdf)
        info = pdf.Root.get("/Info")
        if info is not None:
            del pdf.Root["/Info"]
            if "/Info" not in pdf.trailer and isinstance(info, pikepdf.Dictionary):
                pdf.trailer.Info = pdf.make_indirect(info)
        pdf.save(out)
    return has_text


def check_pdfa(path: Path) -> str | None:
    """None when pikepdf's PDF/A validator approves ``path`` as PDF/A-2b, else why not (its first findings)."""
    from pikepdf.pdfa import validate_written

    report = validate_written(path, FLAVOUR)
    if report.passed:
        return None
    return " ".join(report.summary(limit=3).split())


def _why(e: BaseException) -> str:
    """The error's first line, with the first findings of a PDF/A check it quotes."""
    lines = str(e).strip().splitlines()
    findings = [line.strip() for line in lines[1:] if line.strip().startswith("[")][:3]
    return " ".join([f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": "), *findings])


def ocrmypdf_pdfa(out: Path, source: Path, kind: str, pages: list[dict[str, Any]], pages_json: Path) -> str:
    """Write ``out`` (PDF/A-2b, checked) with OCRmyPDF: its internal backend first, Ghostscript when that refuses
    the file. Returns the backend that made it; raises ``NotPdfa`` (or ImportError without OCRmyPDF) with the
    reasons when neither gives a file that passes the check."""
    import ocrmypdf

    with tempfile.TemporaryDirectory(prefix="uflash-pdfa-") as tmp:
        scan = Path(tmp) / "scan.pdf"
        has_text = _scan_pdf(source, kind, scan)
        reasons = []
        for backend in ("internal", "ghostscript"):
            made = Path(tmp) / f"document-{backend}.pdf"
            try:
                # born-digital pages keep their text (skip mode); no other OCRmyPDF option changes the pages
                code = ocrmypdf.ocr(scan, made, output_type="pdfa-2", pdfa_backend=backend,
                                    mode="skip" if has_text else None, plugins=[PLUGIN], uflash_pages=str(pages_json),
                                    optimize=0, progress_bar=False, use_threads=True, jobs=2)
                if code != ocrmypdf.ExitCode.ok:  # 10, pdfa_conversion_failed: a valid PDF that is not PDF/A
                    raise NotPdfa(f"OCRmyPDF ended with {ocrmypdf.ExitCode(code).name} ({int(code)})")
                if not made.is_file():
                    raise NotPdfa("OCRmyPDF wrote no file")
                if failed := check_pdfa(made):
                    raise NotPdfa(f"the PDF/A check failed: {failed}")
            except Exception as e:  # noqa: BLE001 - each backend's reason is reported; the searchable PDF follows
                reasons.append(f"{backend}: {_why(e)}")
                continue
            write_atomic(out, made.read_bytes())
            return backend
        raise NotPdfa("; ".join(reasons))


def write_document_pdf(out: Path, source: Path, kind: str, pages: list[dict[str, Any]], pages_json: Path) -> str:
    """``document.pdf``: PDF/A-2b by OCRmyPDF that passes the PDF/A check, else (logged with the reason) the
    searchable PDF. Returns which one was written: ``pdfa-2b`` or ``searchable``."""
    try:
        ocrmypdf_pdfa(out, source, kind, pages, pages_json)
        return "pdfa-2b"
    except ImportError as e:
        why = f"OCRmyPDF is not installed ({e})"
    except Exception as e:  # noqa: BLE001 - a file OCRmyPDF refuses, a failed check: the PDF still comes out
        why = _why(e)
    logger.warning("{}: document.pdf is a searchable PDF, not PDF/A: {}", out.parent.name, why)
    write_searchable_pdf(out, source, kind, pages)
    return "searchable"
