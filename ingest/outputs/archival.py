"""The archival outputs of a finished document, after document.md/json (ingest.outputs.write): ALTO per page
(ingest.outputs.alto), hOCR (ingest.outputs.hocr) and document.pdf (PDF/A-2b by OCRmyPDF: ingest.outputs.pdfa), as
``[outputs] formats`` asks. All come from one word layout per page (ingest.reading.words). A failure to write a file
(disk full, access denied) fails the document like any output; any other failure of one format is logged and the others
are written."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from loguru import logger

from ingest.reading.words import document_layouts


def write_archival_outputs(folder: Path, document: dict[str, Any], run: dict[str, Any], pages: list[dict[str, Any]],
                           source: Path | None, formats: Collection[str], pages_json: Path) -> None:
    name = document.get("name") or folder.name
    if "alto" in formats or "hocr" in formats:
        from ingest.outputs.alto import write_alto
        from ingest.outputs.hocr import write_hocr

        try:
            layouts = document_layouts(pages, source, document.get("kind") or "pdf")
            if len(layouts) < len(pages):
                logger.warning("{}: {} page(s) stored without their image size and the original is gone: left out of "
                               "ALTO/hOCR", name, len(pages) - len(layouts))
            if "alto" in formats:
                write_alto(folder, layouts, document, run, pages)
            if "hocr" in formats:
                write_hocr(folder / "document.hocr", layouts, document, str(run.get("engine_version") or ""))
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 - one format that cannot be made must not cost the others
            logger.opt(exception=True).warning("{}: ALTO/hOCR not written: {}: {}", name, type(e).__name__, e)
    if "pdf" in formats and source is not None:
        from ingest.outputs.pdfa import write_document_pdf

        try:
            write_document_pdf(folder / "document.pdf", source, document["kind"], pages, pages_json)
        except Exception as e:  # noqa: BLE001 - an extra output: never the reason a document fails
            logger.warning("{}: document.pdf not written: {}: {}", name, type(e).__name__, e)
