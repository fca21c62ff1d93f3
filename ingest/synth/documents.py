"""Deterministic synthetic documents with Unlimited-OCR labels (for the demo model, tests and benchmarks).

    pdf_bytes, labels = make_document(seed, n_pages, scan=False)

Same seed -> same PDF and labels. Pages have headings, paragraphs, bullet and numbered lists, simple tables,
sometimes two columns, headers and page numbers; Helvetica, Times, Courier and a CJK font (Droid Sans
Fallback, pymupdf's "china-s"), English-like text plus some Chinese. `labels[i]` is page i's target text
(`<|det|>label [x1, y1, x2, y2]<|/det|>text` per element, 0-999 boxes); `join_pages` builds the model's
output for a chunk (multi-page output puts `<PAGE>` before each page). scan=True writes image-only pages
(raster with noise, blur and a slight rotation, no text layer).
"""

from __future__ import annotations

import io
import random
import re

import pymupdf
from PIL import Image

from ingest.synth.doc import char_grid, char_slots, draw_page, layout_page, make_style, page_label
from ingest.synth.raster import render_long_side, scanify, to_square

PAGE_SEPARATOR = "<PAGE>"
HELD_OUT_LIMIT = 1_000_000  # seeds below this are reserved for evaluation; training uses seeds >= it
SCAN_DPI = 150


def _page_rng(seed: int, index: int) -> random.Random:
    return random.Random((seed << 8) + index)


def build_pages(seed: int, n_pages: int, difficulty: float = 1.0, kind: str = "document",
                open_words: float = 0.0) -> tuple[pymupdf.Document, list[str]]:
    """An in-memory pymupdf document with a text layer, and the label of each page.
    kind="words": one title of 1-3 big words a page (over-fit tests); kind="sparse": nearly empty pages, one to
    three elements anywhere on the page (`doc.PageBuilder.build_sparse`). open_words: share of words replaced by
    pseudo-words that no word list holds (`text.pseudo_word`); 0 keeps every seed's document as it was."""
    doc, labels, _, _ = _build(seed, n_pages, difficulty, kind, open_words)
    return doc, labels


def _build(seed: int, n_pages: int, difficulty: float, kind: str, open_words: float = 0.0):
    if not 1 <= n_pages < 256:
        raise ValueError(f"n_pages must be in 1..255, not {n_pages}")
    if not 0.0 <= open_words <= 1.0:
        raise ValueError(f"open_words must be in [0, 1], not {open_words}")
    style = make_style(random.Random(seed), difficulty, open_words)
    doc = pymupdf.open()
    labels, layouts = [], []
    for i in range(n_pages):
        elements = layout_page(_page_rng(seed, i), style, i, n_pages, difficulty, kind)
        page = doc.new_page(width=style.page[0], height=style.page[1])
        draw_page(page, elements)
        labels.append(page_label(elements, style.page))
        layouts.append(elements)
    return doc, labels, layouts, style.page


def layout_labels(seed: int, n_pages: int = 1, difficulty: float = 1.0, open_words: float = 0.0) -> list[str]:
    """The labels of `build_pages(seed, n_pages, difficulty, open_words=...)` without drawing anything (fast)."""
    style = make_style(random.Random(seed), difficulty, open_words)
    return [page_label(layout_page(_page_rng(seed, i), style, i, n_pages, difficulty), style.page)
            for i in range(n_pages)]


def scanned_copy(doc: pymupdf.Document, seed: int, degrade, quality: int) -> pymupdf.Document:
    """An image-only copy of ``doc`` (``doc`` is closed): each page rendered at SCAN_DPI, ``degrade(array, rng)``,
    stored as a JPEG of this quality."""
    out = pymupdf.open()
    for i, page in enumerate(doc):
        arr = degrade(render_long_side(page, int(max(page.rect.width, page.rect.height) * SCAN_DPI / 72)),
                      _page_rng(seed, 200 + i))
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=quality)
        new = out.new_page(width=page.rect.width, height=page.rect.height)
        new.insert_image(new.rect, stream=buf.getvalue())
    doc.close()
    return out


def make_document(seed: int, n_pages: int = 1, scan: bool = False, difficulty: float = 1.0,
                  kind: str = "document", open_words: float = 0.0) -> tuple[bytes, list[str]]:
    """(PDF bytes, one label string per page). scan=True: image-only pages, no text layer."""
    doc, labels = build_pages(seed, n_pages, difficulty, kind, open_words)
    if scan:
        doc = scanned_copy(doc, seed, scanify, quality=85)
    data = doc.tobytes(garbage=3, deflate=True, no_new_id=True)
    doc.close()
    return data, labels


def render_pages(pdf_bytes: bytes, size: int = 1024) -> list[Image.Image]:
    """RGB page images with the longer side = `size`, as the project's renderer produces them (the processor
    then makes the base-mode square)."""
    with pymupdf.open(stream=pdf_bytes, filetype="pdf") as doc:
        return [Image.fromarray(render_long_side(page, size)).convert("RGB") for page in doc]


def page_arrays(seed: int, n_pages: int, size: int, scan_prob: float = 0.0, difficulty: float = 1.0,
                kind: str = "document", chars: bool = False, slots: bool = False,
                open_words: float = 0.0) -> list[tuple]:
    """Fast path for training: each page's base-mode square (uint8, one channel) and its label; with
    chars=True also its character grid (`doc.char_grid`; None for scan-like pages, whose slight rotation
    moves the characters); with slots=True also, per label character, the vision token showing it
    (`doc.char_slots`, -1 for markup)."""
    doc, labels, layouts, page_size = _build(seed, n_pages, difficulty, kind, open_words)
    out = []
    for i, page in enumerate(doc):
        arr = render_long_side(page, size)
        rng = _page_rng(seed, 200 + i)
        scanned = rng.random() < scan_prob
        if scanned:
            arr = scanify(arr, rng, strength=rng.uniform(0.3, 1.0))
        item = (to_square(arr, size), labels[i])
        if chars:
            item += (None if scanned else char_grid(layouts[i], page_size, size),)
        if slots:  # a scan's slight rotation (<= 1.5 degrees) moves a character by far less than one token
            item += (char_slots(layouts[i], page_size, size, labels[i]),)
        out.append(item)
    doc.close()
    return out


def join_pages(labels: list[str]) -> str:
    """The model's target for a chunk: one page as is; several pages each preceded by `<PAGE>`."""
    if len(labels) == 1:
        return labels[0]
    return "".join(PAGE_SEPARATOR + label for label in labels)


_DET = re.compile(r"<\|det\|>.*?<\|/det\|>", flags=re.DOTALL)
_TAGS = re.compile(r"</?(table|tr|td|th|thead|tbody)>|<\|/?ref\|>|<\|grounding\|>")


def strip_markup(text: str) -> str:
    """Plain text of a label or model output: no `<|det|>..<|/det|>` headers, no table tags, no page
    separators; all whitespace collapsed to single spaces (CER is computed on this)."""
    text = _DET.sub(" ", text.replace(PAGE_SEPARATOR, " "))
    text = _TAGS.sub(" ", text)
    return " ".join(text.split())
