"""The plain searchable PDF: the scanned pages with the recognised text laid over them invisibly, so a PDF viewer can
search, select and copy it. ``document.pdf`` is this when OCRmyPDF cannot make the PDF/A (ingest.outputs.pdfa says why);
ingest.outputs.pdfa also takes its scan pages (``_pdf_pages``, ``_image_pages``) from here.

- A PDF original keeps its own pages (the scan at full quality, /Rotate and all); a page that already has a text
  layer (born digital) is left as it is (its rotation too), so nothing is found twice.
- An image original (TIFF, PNG, JPEG) becomes one PDF page per frame, upright (EXIF orientation applied, as the
  model saw it), at the image's own DPI (300 when it says none); bilevel and grey frames stay lossless (PNG),
  colour ones become JPEG (quality 90).
- A page the model read turned (``stats.orientation.turned``, a scan turned sideways or upside down:
  ingest/pages/orientation.py) is shown turned the same way (its /Rotate changed, the scan itself untouched).
- Each element the model returned (``boxes``: label, box on the 0-999 grid of the page, text) is written inside
  its box with render mode 3 (invisible), one line of the element per line of the box, the font size fitted to
  the box. A page without boxes gets its whole text at the top of the page. Markup (table tags) becomes spaces.
- Text that Latin-1 can carry uses Helvetica (a base font: nothing embedded); other text (Greek, Cyrillic, CJK)
  uses the built-in Droid Sans Fallback, subset to the glyphs used.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pymupdf
from PIL import Image, ImageSequence

from ingest.files import write_atomic
from ingest.pages.orientation import page_turn
from ingest.pages.render import EXIF_ORIENTATION, UPRIGHT, flatten_to_rgb
from ingest.reading.text import page_markdown

DEFAULT_DPI = 300
_TAG = re.compile(r"<[^>]{1,40}>")


def write_searchable_pdf(out: Path, source: Path, kind: str, pages: list[dict[str, Any]]) -> Path:
    """Write ``out`` from the original ``source`` (``kind`` pdf/tiff/png/jpeg) and the document's pages (dicts
    with ``index`` (1-based), ``text`` and ``boxes``). Atomic, like the other outputs."""
    doc = _pdf_pages(source) if kind == "pdf" else _image_pages(source)
    try:
        fonts: dict[str, pymupdf.Font] = {}
        for p in pages:
            if 1 <= p["index"] <= doc.page_count:
                _overlay(doc[p["index"] - 1], p, fonts)
        if "cjk" in fonts:
            doc.subset_fonts()
        data = doc.tobytes(garbage=3, deflate=True)
    finally:
        doc.close()
    write_atomic(out, data)
    return out


def _pdf_pages(source: Path) -> pymupdf.Document:
    doc = pymupdf.open(source, filetype="pdf")
    if doc.needs_pass:
        doc.authenticate("")  # an owner password only (intake refused a user password)
    return doc


def _image_pages(source: Path) -> pymupdf.Document:
    doc = pymupdf.open()
    with Image.open(source) as im:
        for frame in ImageSequence.Iterator(im):
            upright = UPRIGHT.get(frame.getexif().get(EXIF_ORIENTATION, 1))
            dpi = frame.info.get("dpi") or (DEFAULT_DPI, DEFAULT_DPI)
            img = frame.copy()
            if img.mode not in ("1", "L", "RGB"):
                img = flatten_to_rgb(img)
            if upright is not None:
                img = img.transpose(upright)
            buf = io.BytesIO()
            if img.mode == "RGB":
                img.save(buf, "JPEG", quality=90)
            else:
                img.save(buf, "PNG", optimize=False)
            dx, dy = (float(d) if d and float(d) > 1 else DEFAULT_DPI for d in dpi)
            if upright in (Image.Transpose.TRANSPOSE, Image.Transpose.ROTATE_270, Image.Transpose.TRANSVERSE,
                           Image.Transpose.ROTATE_90):
                dx, dy = dy, dx
            page = doc.new_page(width=img.width * 72.0 / dx, height=img.height * 72.0 / dy)
            page.insert_image(page.rect, stream=buf.getvalue())
    return doc


def _plain(text: str) -> str:
    return " ".join(_TAG.sub(" ", text).split())


def _font(text: str, fonts: dict[str, pymupdf.Font]) -> pymupdf.Font:
    try:
        text.encode("latin-1")
        name = "helv"
    except UnicodeEncodeError:
        name = "cjk"
    if name not in fonts:
        fonts[name] = pymupdf.Font(name)
    return fonts[name]


def _overlay(page: pymupdf.Page, p: dict[str, Any], fonts: dict[str, pymupdf.Font]) -> None:
    if page.get_text("text").strip():
        return  # born digital: it has its own text layer, and is left as it is (its rotation too)
    if turned := page_turn(p.get("stats")):  # shown as the model read it, so its boxes fit the page as displayed
        page.set_rotation((page.rotation + turned) % 360)
    rect = page.rect
    elements = [(b["box"], b.get("text", "")) for b in p.get("boxes") or [] if b.get("text", "").strip()]
    if not elements and (whole := page_markdown(p.get("text") or "").strip()):
        elements = [([20, 20, 979, 979], whole)]
    writer = pymupdf.TextWriter(rect)
    for box, text in elements:
        x0, y0, x1, y1 = (rect.width * box[0] / 999, rect.height * box[1] / 999,
                          rect.width * box[2] / 999, rect.height * box[3] / 999)
        lines = [line for line in (_plain(t) for t in text.split("\n")) if line]
        if not lines or x1 <= x0 or y1 <= y0:
            continue
        step = (y1 - y0) / len(lines)
        for i, line in enumerate(lines):
            font = _font(line, fonts)
            size = max(1.0, step * 0.8)
            width = font.text_length(line, fontsize=size)
            if width > x1 - x0:
                size = max(1.0, size * (x1 - x0) / width)
            writer.append((x0, y0 + step * i + size), line, font=font, fontsize=size)
    writer.write_text(page, render_mode=3)
