"""Page layout for synthetic documents and its labels in Unlimited-OCR's output format.

A page is a list of elements (header, title, sub_title, text, list, table, footer), each made of lines placed
in PDF points. `layout_page` decides everything from a `random.Random`; `draw_page` writes the elements
onto a pymupdf page (text layer included); `page_label` gives the target text
`<|det|>label [x1, y1, x2, y2]<|/det|>text` per element (boxes on the 0-999 grid), joined by newlines.
Lines inside an element are joined by newlines; tables are HTML (`<table><tr><td>..</td></tr></table>`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import pymupdf

from ingest.synth import text as T

FAMILIES = {"helv": ("helv", "hebo"), "tiro": ("tiro", "tibo"), "cour": ("cour", "cobo"),
            "cjk": ("china-s", "china-s")}
CJK = "china-s"
PAGE_SIZES = [(595.0, 842.0), (595.0, 842.0), (612.0, 792.0)]


@lru_cache(maxsize=None)
def font(name: str) -> pymupdf.Font:
    return pymupdf.Font(name)


_ADVANCE: dict[str, dict[str, float]] = {}


def width(font_name: str, s: str, size: float) -> float:
    """Text width in points (sum of glyph advances; Font.text_length is slow per call)."""
    adv = _ADVANCE.setdefault(font_name, {})
    total = 0.0
    for ch in s:
        a = adv.get(ch)
        if a is None:
            a = adv[ch] = font(font_name).text_length(ch, fontsize=1.0)
        total += a
    return total * size


@dataclass
class Line:
    x: float
    y: float  # baseline
    text: str
    font: str
    size: float

    def right(self) -> float:
        return self.x + width(self.font, self.text, self.size)


@dataclass
class Element:
    label: str
    text: str
    lines: list[Line] = field(default_factory=list)
    rules: list[tuple[float, float, float, float]] = field(default_factory=list)  # table grid lines
    box: tuple[float, float, float, float] = (0, 0, 0, 0)
    gray: float = 0.0

    def fit_box(self) -> None:
        xs0, ys0, xs1, ys1 = [], [], [], []
        for ln in self.lines:
            f = font(ln.font)
            xs0.append(ln.x)
            xs1.append(ln.right())
            ys0.append(ln.y - f.ascender * ln.size * 0.9)
            ys1.append(ln.y - f.descender * ln.size)
        for x0, y0, x1, y1 in self.rules:
            xs0 += [x0, x1]
            xs1 += [x0, x1]
            ys0 += [y0, y1]
            ys1 += [y0, y1]
        self.box = (min(xs0), min(ys0), max(xs1), max(ys1))


@dataclass
class Style:
    family: str
    body: float
    line_gap: float  # line height / font size
    page: tuple[float, float]
    margin: float
    two_columns: float  # probability per page
    header: str | None
    footer_kind: int
    bullet: str
    numbered: str
    chinese: float  # probability that a text block is Chinese
    density: tuple[int, int]  # characters per page range
    open_words: float = 0.0  # share of words replaced by pseudo-words (`text.pseudo_word`)


def make_style(rng: random.Random, difficulty: float = 1.0, open_words: float = 0.0) -> Style:
    """Document-wide style. difficulty < 1 (curriculum): bigger type, fewer characters, simpler layout.
    open_words: share of body, list, heading and title words replaced by pseudo-words (draws no random numbers
    when 0)."""
    d = max(0.0, min(1.0, difficulty))
    family = rng.choices(list(FAMILIES), weights=[4, 3, 2, 1])[0]
    lo = 15 + 6 * (1 - d)
    body = round(rng.uniform(lo, lo + 9 - 2 * (1 - d)) * 2) / 2
    hi_chars = int(200 + 420 * d)
    return Style(
        family=family, body=body, line_gap=rng.uniform(1.15, 1.5), page=rng.choice(PAGE_SIZES),
        margin=rng.uniform(40, 80), two_columns=0.3 * d, header=T.phrase(rng, 1, 4) if rng.random() < 0.45 else None,
        footer_kind=rng.randrange(5), bullet=rng.choice(["•", "•", "-", "*"]), numbered=rng.choice(["1.", "1)", "(1)"]),
        chinese=rng.choice([0.0, 0.0, 0.05, 0.1, 0.3]), density=(max(60, hi_chars // 3), hi_chars),
        open_words=open_words)


def _wrap_words(text: str, font_name: str, size: float, max_w: float) -> list[str]:
    lines, cur, cur_w = [], [], 0.0
    space = width(font_name, " ", size)
    for word in text.split(" "):
        w = width(font_name, word, size)
        if cur and cur_w + space + w > max_w:
            lines.append(" ".join(cur))
            cur, cur_w = [], 0.0
        cur_w = cur_w + (space if cur else 0.0) + w
        cur.append(word)
    if cur:
        lines.append(" ".join(cur))
    return lines


def _wrap_chars(text: str, font_name: str, size: float, max_w: float) -> list[str]:
    lines, cur, cur_w = [], "", 0.0
    for ch in text:
        w = width(font_name, ch, size)
        if cur and cur_w + w > max_w:
            lines.append(cur)
            cur, cur_w = "", 0.0
        cur += ch
        cur_w += w
    if cur:
        lines.append(cur)
    return lines


def _place(label: str, rows: list[str], font_name: str, size: float, x: float, y: float, lead: float,
           indent: list[float] | None = None, align: str = "left", col_w: float = 0.0) -> Element:
    """Lines with baselines from y + size; returns the element (box fitted)."""
    el = Element(label, "\n".join(rows))
    for i, row in enumerate(rows):
        dx = indent[i] if indent else 0.0
        if align != "left":
            free = col_w - width(font_name, row, size)
            dx = free / 2 if align == "center" else free
        el.lines.append(Line(x + dx, y + size + i * lead, row, font_name, size))
    el.fit_box()
    return el


class PageBuilder:
    def __init__(self, rng: random.Random, style: Style, page_no: int, n_pages: int, difficulty: float):
        self.rng, self.s, self.page_no, self.n_pages, self.d = rng, style, page_no, n_pages, difficulty
        self.regular, self.bold = FAMILIES[style.family]
        self.elements: list[Element] = []
        self.chars = 0

    # -- blocks; each returns an element laid out at (x, y) within width w, or None
    def paragraph(self, x, y, w, n_chars) -> Element:
        s, rng = self.s, self.rng
        if rng.random() < s.chinese:
            size = s.body
            rows = _wrap_chars(T.chinese(rng, max(12, n_chars // 3)), CJK, size, w)
            return _place("text", rows, CJK, size, x, y, size * s.line_gap)
        rows = _wrap_words(T.paragraph(rng, n_chars, s.open_words), self.regular, s.body, w)
        return _place("text", rows, self.regular, s.body, x, y, s.body * s.line_gap)

    def sub_title(self, x, y, w, _n) -> Element:
        size = round(self.s.body * self.rng.uniform(1.1, 1.4) * 2) / 2
        if self.rng.random() < self.s.chinese:
            return _place("sub_title", _wrap_chars(T.chinese(self.rng, 6).rstrip("。"), CJK, size, w), CJK, size, x, y,
                          size * 1.2)
        txt = T.phrase(self.rng, 1, 6, self.s.open_words)
        if self.rng.random() < 0.4:
            txt = f"{self.rng.randint(1, 12)}.{self.rng.randint(1, 9)} {txt}"
        return _place("sub_title", _wrap_words(txt, self.bold, size, w), self.bold, size, x, y, size * 1.2)

    def listing(self, x, y, w, n_chars) -> Element:
        s, rng = self.s, self.rng
        numbered = rng.random() < 0.4
        n_items = rng.randint(2, 5)
        rows, indent = [], []
        for i in range(n_items):
            mark = s.numbered.replace("1", str(i + 1)) if numbered else s.bullet
            body = T.sentence(rng, rng.randint(2, max(3, n_chars // (7 * n_items))), s.open_words)
            hang = width(self.regular, mark + " ", s.body)
            wrapped = _wrap_words(body, self.regular, s.body, w - hang)
            rows.append(f"{mark} {wrapped[0]}")
            indent.append(0.0)
            for cont in wrapped[1:]:
                rows.append(cont)
                indent.append(hang)
        return _place("list", rows, self.regular, s.body, x, y, s.body * s.line_gap, indent=indent)

    def table(self, x, y, w, _n) -> Element | None:
        rng = self.rng
        size = max(9.0, round(self.s.body * 0.9 * 2) / 2)
        n_rows, n_cols = rng.randint(2, 5), rng.randint(2, 4)
        cells = [[T.phrase(rng, 1, 2) for _ in range(n_cols)]] + [
            [T.cell(rng) for _ in range(n_cols)] for _ in range(n_rows - 1)]
        pad = size * 0.5
        col_w = [max(width(self.regular, r[c], size) for r in cells) + 2 * pad for c in range(n_cols)]
        if sum(col_w) > w:
            return None
        row_h = size * 1.6
        el = Element("table", "<table>" + "".join(
            "<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in cells) + "</table>")
        xs = [x]
        for cw in col_w:
            xs.append(xs[-1] + cw)
        for i, r in enumerate(cells):
            for j, c in enumerate(r):
                el.lines.append(Line(xs[j] + pad, y + i * row_h + row_h * 0.5 + size * 0.35, c, self.regular, size))
        for i in range(n_rows + 1):
            el.rules.append((x, y + i * row_h, xs[-1], y + i * row_h))
        for xv in xs:
            el.rules.append((xv, y, xv, y + n_rows * row_h))
        el.fit_box()
        return el

    def build(self) -> list[Element]:
        s, rng = self.s, self.rng
        W, H = s.page
        left, right = s.margin, W - s.margin
        top, bottom = rng.uniform(36, 70), H - rng.uniform(40, 70)
        y = top
        if s.header and rng.random() < 0.9:
            size = rng.choice([9.0, 10.0, 11.0])
            txt = s.header if rng.random() < 0.6 else f"{s.header} {rng.randint(1, 40)}"
            align = rng.choice(["left", "right", "center"])
            el = _place("header", [txt], self.regular, size, left, y, size, align=align, col_w=right - left)
            el.gray = 0.35
            self._add(el)
            y = el.box[3] + rng.uniform(10, 24)
        if s.footer_kind and self.n_pages >= 1:
            bottom -= 24
        if self.page_no == 0 or rng.random() < 0.3:
            size = round(min(32.0, s.body * rng.uniform(1.5, 2.2)) * 2) / 2
            align = rng.choice(["left", "left", "center"])
            if rng.random() < s.chinese:
                rows = _wrap_chars(T.chinese(rng, rng.randint(4, 12)).rstrip("。"), CJK, size, right - left)
                el = _place("title", rows, CJK, size, left, y, size * 1.2, align=align, col_w=right - left)
            else:
                rows = _wrap_words(T.phrase(rng, 2, 8, s.open_words), self.bold, size, right - left)
                el = _place("title", rows, self.bold, size, left, y, size * 1.2, align=align, col_w=right - left)
            self._add(el)
            y = el.box[3] + rng.uniform(0.8, 1.6) * s.body
        target = rng.randint(*s.density)
        gutter = rng.uniform(16, 30)
        columns = [(left, right)]
        if rng.random() < s.two_columns:
            mid = (left + right) / 2
            columns = [(left, mid - gutter / 2), (mid + gutter / 2, right)]
        for ci, (x0, x1) in enumerate(columns):
            col_target = self.chars + (target - self.chars) // (len(columns) - ci)
            cy, misses, shrink = y, 0, 1.0
            while self.chars < col_target and misses < 6:
                kind = rng.choices(["text", "sub_title", "list", "table"],
                                   weights=[6, 2, 2, 1.5 if self.d > 0.5 else 0])[0]
                n = int(max(40, min(400, col_target - self.chars + rng.randint(0, 80))) * shrink)
                el = getattr(self, {"text": "paragraph", "sub_title": "sub_title", "list": "listing",
                                    "table": "table"}[kind])(x0, cy, x1 - x0, n)
                if el is None or el.box[3] > bottom:
                    misses += 1
                    shrink *= 0.7
                    continue
                self._add(el)
                cy = el.box[3] + s.body * rng.uniform(0.6, 1.3)
                if kind == "sub_title":
                    cy -= s.body * 0.3
        if s.footer_kind:
            n = self.page_no + 1
            txt = [None, str(n), f"- {n} -", f"Page {n}", f"Page {n} of {self.n_pages}"][s.footer_kind]
            el = _place("footer", [txt], self.regular, 10.0, left, H - rng.uniform(30, 50) - 10, 10,
                        align=rng.choice(["center", "right"]), col_w=right - left)
            self._add(el)
        return self.elements

    def build_sparse(self) -> list[Element]:
        """A nearly empty page (a cover, a note, the last lines of a letter): one to three elements anywhere on
        it, a header or a page number only sometimes. Without such pages a model learns that text starts under a
        header at the top and misses a lone line further down."""
        s, rng = self.s, self.rng
        W, H = s.page
        left, right = s.margin, W - s.margin
        y = rng.uniform(40, H * 0.75)
        for _ in range(rng.randint(1, 3)):
            kind = rng.choices(["text", "sub_title", "list"], weights=[6, 2, 1])[0]
            el = getattr(self, {"text": "paragraph", "sub_title": "sub_title", "list": "listing"}[kind])(
                left, y, right - left, rng.randint(30, 260))
            if el.box[3] > H - 60:
                break
            self._add(el)
            y = el.box[3] + rng.uniform(1.0, 12.0) * s.body
            if y > H - 120:
                break
        if s.footer_kind and rng.random() < 0.3:
            el = _place("footer", [str(self.page_no + 1)], self.regular, 10.0, left, H - rng.uniform(30, 50) - 10, 10,
                        align=rng.choice(["center", "right"]), col_w=right - left)
            self._add(el)
        return self.elements

    def _add(self, el: Element) -> None:
        self.elements.append(el)
        self.chars += sum(len(ln.text) for ln in el.lines)


def layout_page(rng: random.Random, style: Style, page_no: int, n_pages: int, difficulty: float = 1.0,
                kind: str = "document"):
    if kind == "words":
        return words_page(rng, style)
    if kind == "sparse":
        return PageBuilder(rng, style, page_no, n_pages, difficulty).build_sparse()
    return PageBuilder(rng, style, page_no, n_pages, difficulty).build()


def words_page(rng: random.Random, style: Style) -> list[Element]:
    """One title element of 1-3 short words in very large type (over-fit tests, first curriculum steps)."""
    W, H = style.page
    pool = [w for w in T.words(rng, 40) if 3 <= len(w) <= 8]
    text = " ".join(pool[: rng.randint(1, 3)]) or "word"
    size = rng.uniform(70, 110)
    name = FAMILIES[style.family][1]
    rows = _wrap_words(text, name, size, W - 80)
    x = rng.uniform(30, max(31, W - 30 - max(width(name, r, size) for r in rows)))
    y = rng.uniform(30, max(31, H - 60 - len(rows) * size * 1.2))
    return [_place("title", rows, name, size, x, y, size * 1.2)]


def grid(v: float, extent: float) -> int:
    return max(0, min(999, int(round(v / extent * 999))))


def page_label(elements: list[Element], page_size: tuple[float, float]) -> str:
    W, H = page_size
    out = []
    for el in elements:
        x0, y0, x1, y1 = el.box
        out.append(f"<|det|>{el.label} [{grid(x0, W)}, {grid(y0, H)}, {grid(x1, W)}, {grid(y1, H)}]<|/det|>{el.text}")
    return "\n".join(out)


def char_grid(elements: list[Element], page_size: tuple[float, float], size: int) -> np.ndarray:
    """Where each character's centre lands in the model's base-mode square of `size` pixels, on a grid of
    16-pixel rows and 8-pixel columns ([size // 16, size // 8], uint16 class ids, 0 = nothing): the target of
    the auxiliary vision loss (each vision token, 64 x 64 pixels, covers 4 x 8 cells)."""
    sx, sy, ox, oy = _square_transform(page_size, size)
    grid = np.zeros((size // 16, size // 8), dtype=np.uint16)
    other = T.N_CHAR_CLASSES - 1
    for el in elements:
        for ln in el.lines:
            adv = _ADVANCE.setdefault(ln.font, {})
            x = ln.x
            cy = int(((ln.y - 0.35 * ln.size) * sy + oy) // 16)
            for ch in ln.text:
                a = adv.get(ch)
                if a is None:
                    a = adv[ch] = font(ln.font).text_length(ch, fontsize=1.0)
                w = a * ln.size
                if not ch.isspace() and 0 <= cy < grid.shape[0]:
                    cx = int(((x + w / 2) * sx + ox) // 8)
                    if 0 <= cx < grid.shape[1]:
                        grid[cy, cx] = T.CHAR_INDEX.get(ch, other)
                x += w
    return grid


def _square_transform(page_size: tuple[float, float], size: int) -> tuple[float, float, float, float]:
    """(sx, sy, ox, oy): page points -> pixels of the model's base-mode square (as the processor pads/stretches)."""
    W, H = page_size
    if size <= 640:  # the processor stretches small bases to a square
        return size / W, size / H, 0.0, 0.0
    z = size / max(W, H)
    return z, z, (size - round(W * z)) // 2, (size - round(H * z)) // 2


def char_slots(elements: list[Element], page_size: tuple[float, float], size: int, label: str) -> np.ndarray:
    """For each character of `label` (`page_label(elements, ...)`), the vision token that shows it, as its index
    among the page's image slots (row * (q + 1) + column, q = size // 64 tokens a side, the newline slot ending
    each row); -1 for markup, boxes and spaces. The target of the training-time alignment loss."""
    sx, sy, ox, oy = _square_transform(page_size, size)
    q = size // 64
    out = np.full(len(label), -1, dtype=np.int16)
    pos = 0
    for el in elements:
        start = label.find("<|/det|>", label.find("<|det|>" + el.label, pos)) + len("<|/det|>")
        pos = start
        for ln in el.lines:
            k = label.find(ln.text, pos)
            if k < 0:
                continue
            cy = int(((ln.y - 0.35 * ln.size) * sy + oy) // 64)
            adv = _ADVANCE.setdefault(ln.font, {})
            x = ln.x
            for j, ch in enumerate(ln.text):
                a = adv.get(ch)
                if a is None:
                    a = adv[ch] = font(ln.font).text_length(ch, fontsize=1.0)
                w = a * ln.size
                cx = int(((x + w / 2) * sx + ox) // 64)
                if not ch.isspace() and 0 <= cy < q and 0 <= cx < q:
                    out[k + j] = cy * (q + 1) + cx
                x += w
            pos = k + len(ln.text)
    return out


def draw_page(page: pymupdf.Page, elements: list[Element]) -> None:
    writers: dict[float, pymupdf.TextWriter] = {}
    for el in elements:
        tw = writers.setdefault(el.gray, pymupdf.TextWriter(page.rect))
        for ln in el.lines:
            tw.append((ln.x, ln.y), ln.text, font=font(ln.font), fontsize=ln.size)
        for x0, y0, x1, y1 in el.rules:
            page.draw_line((x0, y0), (x1, y1), color=(0, 0, 0), width=0.6)
    for gray, tw in writers.items():
        tw.write_text(page, color=(gray, gray, gray))
