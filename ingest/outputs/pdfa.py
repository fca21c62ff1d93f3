"""``document.pdf`` as PDF/A-2b, built by OCRmyPDF (with Ghostscript) from the words uflash decoded.

OCRmyPDF is what archives already run to make PDF/A; here it takes uflash as its OCR engine
(ingest.commands.ocrmypdf_plugin, given the ``document.json`` just written: no second decode) and does the rest: each
page's invisible text layer, word by word from the one word layout (ingest.reading.words), so that selecting a word in a
viewer selects that word; embedded fonts; the PDF/A-2b conversion and its XMP identification.

- The scan under the text: a PDF original's own pages; an image original (TIFF, PNG, JPEG) one page per frame, as
  the searchable PDF makes them (ingest.outputs.searchable_pdf: upright, at the image's DPI).
- A page the model read turned is shown turned the same way (the plugin reports the turn to OCRmyPDF, which turns
  the page), so its words fit the page as displayed. A page that already has a text layer (born digital) keeps its
  own text (OCRmyPDF's ``skip`` mode).
- When OCRmyPDF or Ghostscript is missing, or OCRmyPDF fails on the file, the log says why and ``document.pdf`` is
  the searchable PDF of ingest.outputs.searchable_pdf instead (not PDF/A).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pymupdf
from loguru import logger

from ingest.files import write_atomic
from ingest.outputs.searchable_pdf import _image_pages, _pdf_pages, write_searchable_pdf

PLUGIN = "ingest.commands.ocrmypdf_plugin"


def _scan_pdf(source: Path, kind: str, out: Path) -> bool:
    """The pages OCRmyPDF works on: the original's (decrypted). Returns whether a page has a text layer of its own."""
    doc = _pdf_pages(source) if kind == "pdf" else _image_pages(source)
    try:
        has_text = any(page.get_text("text").strip() for page in doc)
        doc.save(out, garbage=1, encryption=pymupdf.PDF_ENCRYPT_NONE)
    finally:
        doc.close()
    return has_text


def _plugins() -> list[str]:
    """The plugin, unless uflash's entry point loads it into every OCRmyPDF run already."""
    from importlib.metadata import entry_points

    return [] if any(ep.name == "uflash" for ep in entry_points(group="ocrmypdf")) else [PLUGIN]


def ocrmypdf_pdfa(out: Path, source: Path, kind: str, pages: list[dict[str, Any]], pages_json: Path) -> None:
    """Write ``out`` (PDF/A-2b) with OCRmyPDF; raises whatever stops it (ImportError without OCRmyPDF,
    ``ocrmypdf.MissingDependencyError`` without Ghostscript)."""
    import ocrmypdf

    with tempfile.TemporaryDirectory(prefix="uflash-pdfa-") as tmp:
        scan, made = Path(tmp) / "scan.pdf", Path(tmp) / "document.pdf"
        has_text = _scan_pdf(source, kind, scan)
        # born-digital pages keep their text (skip mode); a document of scans only needs no skipping (and Ghostscript
        # 10.0-10.02, refused by OCRmyPDF for skip mode, can still make its PDF/A)
        code = ocrmypdf.ocr(scan, made, output_type="pdfa-2", mode="skip" if has_text else None, plugins=_plugins(),
                            uflash_pages=str(pages_json), optimize=0, progress_bar=False, use_threads=True, jobs=2)
        if code != ocrmypdf.ExitCode.ok and not made.exists():
            raise RuntimeError(f"OCRmyPDF ended with {code!r}")
        write_atomic(out, made.read_bytes())


def write_document_pdf(out: Path, source: Path, kind: str, pages: list[dict[str, Any]], pages_json: Path) -> str:
    """``document.pdf``: PDF/A-2b by OCRmyPDF, else (logged with the reason) the searchable PDF. Returns which
    one was written: ``pdfa-2b`` or ``searchable``."""
    try:
        ocrmypdf_pdfa(out, source, kind, pages, pages_json)
        return "pdfa-2b"
    except ImportError as e:
        why = f"OCRmyPDF is not installed ({e})"
    except Exception as e:  # noqa: BLE001 - Ghostscript missing, a file OCRmyPDF refuses: the PDF still comes out
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    logger.warning("{}: document.pdf is a searchable PDF, not PDF/A: {}", out.parent.name, why)
    write_searchable_pdf(out, source, kind, pages)
    return "searchable"
