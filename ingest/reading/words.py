"""The one word layout that every archival output uses (ALTO, hOCR, the PDF/A text layer): a page's words, each
with a box in the pixel space of the page image the model read, and its confidence.

What comes from the model and what is estimated:
- The model gives, per element, ``<|det|>label [x1, y1, x2, y2]<|/det|>text``: a label and a box on a 0-999 grid
  of the page it read. Those boxes are the model's. Text before the first element (a model that writes no
  elements) gets the page inside a margin (``WHOLE_PAGE``), as the searchable PDF does.
- Lines and words inside an element are **estimated**: the element's box is split into equal bands, one per line
  of its text (a table: one per row), and each line is laid out left to right with the advance widths of
  Helvetica (a CJK character one em, other characters Helvetica lacks 0.6 em), scaled so that the widest line
  fills the box. A short line keeps its natural width, left-aligned.
- Word confidences come from the model's own token probabilities (``ingest.reading.confidence``, computed when the
  page is stored).

What a word is (``page_words``): the page's text with its markup removed, split at white space: element headers
(``<|det|>...<|/det|>``, one cut off by the end of the output too), ``<|ref|>``/``<|/ref|>``/``<|grounding|>``,
and HTML table tags (``<table>``, ``<tr>``, ``<td>``...; a row starts a new line, a cell a new word) never become
words. Characters that XML cannot carry separate words like spaces. Nothing else is changed: words join back to
the text the model wrote, without markup.

Pixel space: the page image as the model read it (``stats.image_size``: the rendered page, longer side 1024 px,
turned when the page was read turned: ``stats.orientation.turned``, degrees clockwise from the scan).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ingest.pages.orientation import page_turn

GRID = 999  # the model's boxes are on a 0-999 grid of the page
WHOLE_PAGE = (20, 20, 979, 979)  # where text outside any element goes (as the searchable PDF places it)
PICTURE_LABELS = frozenset({"image", "figure", "picture", "photo", "chart", "graphic", "diagram", "illustration",
                            "logo", "seal", "stamp"})
TABLE_LABELS = frozenset({"table"})
LAYOUT_NOTE = ("word positions are estimated: each element's box (given by the model) is split into one band per "
               "line of its text and each line laid out with Helvetica's character widths, the widest line filling "
               "the box")

_MARKUP = re.compile(
    r"(?P<det><\|det\|>(?P<header>.*?)<\|/det\|>)"
    r"|(?P<cut><\|det\|>(?:(?!<\|/det\|>).)*\Z)"
    r"|(?P<row></?(?:table|thead|tbody|tfoot|tr|caption|br)\b[^<>]{0,200}>)"
    r"|(?P<cell><\|/?(?:ref|grounding)\|>|</?(?:td|th|colgroup|col)\b[^<>]{0,200}>)",
    re.S | re.I)
_HEADER = re.compile(r"\s*(\S+)\s*\[\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\]\s*\Z", re.S)
_WORD = re.compile(r"[^\s\x00-\x08\x0e-\x1f\ufffe\uffff\ud800-\udfff]+")
_TABLE_TAG = re.compile(r"</?t[rdh]\b", re.I)


@dataclass(frozen=True)
class WordSpan:
    text: str
    start: int  # offsets of the word in the page's raw text (markup included)
    end: int


@dataclass
class Segment:
    """One element of the page's text: its label and grid box (None when the model gave none), its lines."""

    label: str | None
    grid_box: tuple[int, int, int, int] | None
    lines: list[list[WordSpan]] = field(default_factory=list)
    table: bool = False


def page_segments(text: str) -> list[Segment]:
    """The page's elements in the order the model wrote them, with their lines of words (markup removed)."""
    segments = [Segment(None, None)]
    line: list[WordSpan] = []

    def words_of(start: int, end: int) -> None:
        nonlocal line
        for part in re.finditer(r"[^\r\n]+|\r\n|\r|\n", text[start:end]):
            if part.group() in ("\n", "\r", "\r\n"):
                new_line()
                continue
            line += [WordSpan(m.group(), start + part.start() + m.start(), start + part.start() + m.end())
                     for m in _WORD.finditer(part.group())]

    def new_line() -> None:
        nonlocal line
        if line:
            segments[-1].lines.append(line)
        line = []

    pos = 0
    for m in _MARKUP.finditer(text):
        words_of(pos, m.start())
        pos = m.end()
        if m.group("det") is not None:
            new_line()
            h = _HEADER.match(m.group("header"))
            if h:
                x1, y1, x2, y2 = (min(GRID, max(0, int(v))) for v in h.groups()[1:])
                segments.append(Segment(h.group(1), (min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2))))
            else:
                label = m.group("header").split()
                segments.append(Segment(label[0] if label else None, None))
        elif m.group("cut") is not None:
            break
        elif m.group("row") is not None:
            new_line()
            segments[-1].table = segments[-1].table or bool(_TABLE_TAG.match(m.group("row")))
        else:
            segments[-1].table = segments[-1].table or bool(_TABLE_TAG.match(m.group("cell")))
    else:
        words_of(pos, len(text))
    new_line()
    return [s for s in segments if s.lines or s.grid_box is not None]


def page_words(text: str) -> list[WordSpan]:
    """The page's words in order: its text with the markup removed, split at white space."""
    return [w for s in page_segments(text) for line in s.lines for w in line]


def plain_words(text: str) -> list[str]:
    return [w.text for w in page_words(text)]


# -- geometry ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Box:
    x0: int
    y0: int
    x1: int
    y1: int

    @property
    def width(self) -> int:
        return self.x1 - self.x0

    @property
    def height(self) -> int:
        return self.y1 - self.y0

    def contains(self, other: Box) -> bool:
        return self.x0 <= other.x0 and self.y0 <= other.y0 and other.x1 <= self.x1 and other.y1 <= self.y1


@dataclass
class Word:
    text: str
    box: Box
    confidence: float | None  # 0-1, None when the decoder gave no probabilities


@dataclass
class TextLine:
    box: Box
    words: list[Word]


@dataclass
class Block:
    label: str  # the model's label ("text" for text outside any element)
    kind: str  # text | table | picture
    box: Box
    lines: list[TextLine]


@dataclass
class PageLayout:
    index: int  # 1-based page number in the document
    width: int  # pixels of the page image as read
    height: int
    rotation: int  # degrees clockwise the scan was turned to be read (0: as it came)
    blocks: list[Block]

    def words(self) -> list[Word]:
        return [w for b in self.blocks for line in b.lines for w in line.words]


@lru_cache(maxsize=1)
def _helvetica():
    import pymupdf

    return pymupdf.Font("helv")


@lru_cache(maxsize=8192)
def char_width(ch: str) -> float:
    """Advance width of ``ch`` in em: Helvetica's, one em for wide (CJK) characters, else 0.6."""
    if unicodedata.east_asian_width(ch) in ("W", "F"):
        return 1.0
    font = _helvetica()
    cp = ord(ch)
    return font.glyph_advance(cp) if font.has_glyph(cp) else 0.6


def text_width(s: str) -> float:
    return sum(char_width(c) for c in s)


def _pixels(grid_box: tuple[int, int, int, int], width: int, height: int) -> Box:
    x0, y0, x1, y1 = (round(v * size / GRID) for v, size in zip(grid_box, (width, height, width, height)))
    x0, x1 = min(max(x0, 0), width - 1), min(max(x1, 0), width)
    y0, y1 = min(max(y0, 0), height - 1), min(max(y1, 0), height)
    return Box(x0, y0, max(x1, x0 + 1), max(y1, y0 + 1))


def _lay_lines(lines: list[list[WordSpan]], box: Box, conf: list[float | None]) -> list[TextLine]:
    if not lines:
        return []
    space = char_width(" ")
    natural = [text_width(" ".join(w.text for w in line)) for line in lines]
    scale = box.width / max(max(natural), 1e-6)
    out = []
    k = 0
    for i, line in enumerate(lines):
        top = box.y0 + round(box.height * i / len(lines))
        bottom = max(top + 1, box.y0 + round(box.height * (i + 1) / len(lines)))
        x, words = 0.0, []
        for w in line:
            wx0 = min(box.x0 + round(x * scale), box.x1 - 1)
            x += text_width(w.text)
            wx1 = min(max(box.x0 + round(x * scale), wx0 + 1), box.x1)
            words.append(Word(w.text, Box(wx0, top, wx1, bottom), conf[k]))
            x += space
            k += 1
        out.append(TextLine(Box(words[0].box.x0, top, words[-1].box.x1, bottom), words))
    return out


def layout_page(text: str, index: int, width: int, height: int, rotation: int = 0,
                confidences: list[float | None] | None = None) -> PageLayout:
    """The page's blocks, lines and words in pixels of a ``width`` x ``height`` page image. ``confidences``: one per
    word of ``page_words(text)`` (ignored when the count differs: the words then carry None)."""
    segments = page_segments(text)
    n_words = sum(len(line) for s in segments for line in s.lines)
    conf = list(confidences) if confidences is not None and len(confidences) == n_words else [None] * n_words
    blocks, k = [], 0
    for s in segments:
        label = s.label or "text"
        n = sum(len(line) for line in s.lines)
        kind = "picture" if label.lower() in PICTURE_LABELS else \
            "table" if (label.lower() in TABLE_LABELS or s.table) else "text"
        box = _pixels(s.grid_box or WHOLE_PAGE, width, height)
        blocks.append(Block(label, kind, box, _lay_lines(s.lines, box, conf[k:k + n])))
        k += n
    return PageLayout(index, width, height, rotation, blocks)


def stored_layout(page: dict[str, Any], size: tuple[int, int] | None = None) -> PageLayout:
    """The layout of a stored page (a ``document.json`` page: ``index``, ``text``, ``stats``) in the pixel space of
    the page image the model read: ``stats.image_size``, else ``size`` (the caller renders the page to know it)."""
    stats = page.get("stats") or {}
    w, h = stats.get("image_size") or size or (0, 0)
    if not (w and h):
        raise ValueError(f"page {page.get('index')}: the size of the page image is not known")
    return layout_page(page.get("text") or "", page["index"], int(w), int(h), page_turn(stats),
                       stats.get("word_confidence"))


def page_image_size(source, kind: str, index: int, turned: int = 0) -> tuple[int, int]:
    """Size of page ``index`` as the model read it, rendered again from ``source`` (for pages stored without
    ``stats.image_size``)."""
    from ingest.pages.render import render_pages

    w, h = render_pages(source, kind, index, index)[0].image.size
    return (h, w) if turned % 180 else (w, h)


def document_layouts(pages: list[dict[str, Any]], source=None, kind: str = "pdf") -> list[PageLayout]:
    """The layout of every page (``document.json`` pages). A page stored without its image size is rendered again
    from ``source`` to learn it; without a source such a page is left out (the caller says so)."""
    out = []
    for p in pages:
        size = None
        if not (p.get("stats") or {}).get("image_size"):
            if source is None:
                continue
            size = page_image_size(source, kind, p["index"], page_turn(p.get("stats")))
        out.append(stored_layout(p, size))
    return out
