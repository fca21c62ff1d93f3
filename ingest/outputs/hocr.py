"""hOCR, one file per document: ``<outbox>/<doc>/document.hocr`` (XHTML), from the same word layout as ALTO.

``ocr_page`` per page (``bbox 0 0 W H`` of the page image the model read, ``ppageno``, and ``x_rotation`` when it
was read turned: degrees clockwise the scan was turned), ``ocr_carea`` + ``ocr_par`` per element (``x_label``: the
model's label), ``ocr_photo`` for a picture, ``ocr_line`` per line, ``ocrx_word`` per word with ``bbox`` and
``x_wconf`` (the word confidence of ingest.reading.confidence, 0-100). Word boxes are estimated (ingest.reading.words).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lxml import etree

from ingest.files import write_atomic
from ingest.reading.words import PageLayout

XHTML = "http://www.w3.org/1999/xhtml"
DOCTYPE = ('<!DOCTYPE html PUBLIC "-//W3C//DTD XHTML 1.0 Transitional//EN" '
           '"http://www.w3.org/TR/xhtml1/DTD/xhtml1-transitional.dtd">')
CAPABILITIES = "ocr_page ocr_carea ocr_par ocr_line ocrx_word ocr_photo"


def _bbox(b) -> str:
    return f"bbox {b.x0} {b.y0} {b.x1} {b.y1}"


def _el(parent: etree._Element, tag: str, cls: str, ident: str, title: str, text: str | None = None):
    el = etree.SubElement(parent, f"{{{XHTML}}}{tag}", {"class": cls, "id": ident, "title": title})
    el.text = text
    return el


def document_hocr(layouts: list[PageLayout], document: dict[str, Any], version: str = "") -> bytes:
    html = etree.Element(f"{{{XHTML}}}html", nsmap={None: XHTML})
    html.set("{http://www.w3.org/XML/1998/namespace}lang", "und")
    head = etree.SubElement(html, f"{{{XHTML}}}head")
    etree.SubElement(head, f"{{{XHTML}}}title").text = document.get("name") or "document"
    etree.SubElement(head, f"{{{XHTML}}}meta", {"http-equiv": "Content-Type", "content": "text/html;charset=utf-8"})
    etree.SubElement(head, f"{{{XHTML}}}meta", {"name": "ocr-system",
                                                "content": f"uflash {version} (Unlimited-OCR)".replace("  ", " ")})
    etree.SubElement(head, f"{{{XHTML}}}meta", {"name": "ocr-capabilities", "content": CAPABILITIES})
    body = etree.SubElement(html, f"{{{XHTML}}}body")
    name = (document.get("name") or "").replace('"', "'")
    for layout in layouts:
        p = layout.index
        title = f'image "{name}"; bbox 0 0 {layout.width} {layout.height}; ppageno {p - 1}'
        if layout.rotation:
            title += f"; x_rotation {layout.rotation}"
        page = _el(body, "div", "ocr_page", f"page_{p}", title)
        for bn, block in enumerate(layout.blocks, start=1):
            bid = f"{p}_{bn}"
            if block.kind == "picture":
                _el(page, "div", "ocr_photo", f"photo_{bid}", f"{_bbox(block.box)}; x_label {block.label}")
                if not block.lines:
                    continue
            area = _el(page, "div", "ocr_carea", f"block_{bid}", f"{_bbox(block.box)}; x_label {block.label}")
            par = _el(area, "p", "ocr_par", f"par_{bid}", _bbox(block.box))
            for ln, line in enumerate(block.lines, start=1):
                lid = f"{bid}_{ln}"
                span = _el(par, "span", "ocr_line", f"line_{lid}", _bbox(line.box))
                for wn, w in enumerate(line.words, start=1):
                    title = _bbox(w.box)
                    if w.confidence is not None:
                        title += f"; x_wconf {round(100 * min(1.0, max(0.0, w.confidence)))}"
                    word = _el(span, "span", "ocrx_word", f"word_{lid}_{wn}", title, w.text)
                    word.tail = " " if wn < len(line.words) else None
    return (b'<?xml version="1.0" encoding="UTF-8"?>\n' + DOCTYPE.encode() + b"\n"
            + etree.tostring(html, encoding="UTF-8", pretty_print=True))


def write_hocr(path: Path, layouts: list[PageLayout], document: dict[str, Any], version: str = "") -> Path:
    write_atomic(path, document_hocr(layouts, document, version))
    return path
