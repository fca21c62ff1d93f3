"""How much text a page holds, measured on the rendered page image (no OCR, no text layer): the yardstick against
which a page's output is judged far too short or too long (ingest.quality.grades).

``ink_text(image)`` finds the page's lines of print and estimates the characters they hold:
1. ink: pixels darker than the paper by more than the paper's own noise (the paper level is the median of the
   brighter half of the page, its noise their spread), isolated dark pixels (specks, scan noise) dropped;
2. the page's skew: the angle in [-4, 4] degrees whose horizontal projection of the ink is sharpest;
3. lines: runs of rows (at that angle) that hold ink; a band taller than the page's typical line is counted as the
   lines it spans (lines set close together merge into one band);
4. per line, the width its ink covers (gaps narrower than the line height closed, so the spaces between words
   count); characters = ``CHARS_PER_HEIGHT`` x covered width / line height, summed over the lines. Bands that are
   nearly all ink (solid areas: more than ``SOLID`` of their area) and ruled lines are not print. A photograph or a
   drawing is counted as print: its page is likely to be found "far less text than its print".
The estimate is in characters of plain text, spaces included (the model's output is compared with its markup
removed). It is an estimate: on the calibration ladder (docs/grades.md) it is within a factor of
about 1.5 of the truth for most pages; the grading thresholds allow for that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

CHARS_PER_HEIGHT = 1.7  # characters per line-height of covered width (Latin print: advance ~0.5 em, band ~0.95 em)
ANGLES = np.deg2rad(np.arange(-4.0, 4.01, 0.25))
MAX_SIDE = 1024  # the measure runs on at most this many pixels a side
SOLID = 0.8  # a band whose ink covers more than this share of its area is a solid area, not print


@dataclass(frozen=True)
class InkText:
    chars: int  # estimated characters of text on the page
    lines: int  # lines of print found
    line_height: float  # typical height of a line's ink band, pixels of the measured image
    skew: float  # degrees
    ink_share: float  # share of the page's pixels that are ink

    def dict(self) -> dict:
        return {"ink_chars": self.chars, "ink_lines": self.lines, "ink_line_height": round(self.line_height, 1),
                "ink_skew": round(self.skew, 2), "ink_share": round(self.ink_share, 4)}


def ink_mask(gray: np.ndarray) -> np.ndarray:
    """Ink pixels of a grayscale page: darker than the paper by more than its noise; isolated specks dropped."""
    bright = gray[gray >= np.median(gray)]
    paper = float(np.median(bright))
    noise = 1.4826 * float(np.median(np.abs(bright - paper))) if bright.size else 0.0
    dark = gray < paper - max(30.0, 4.0 * noise)
    # a pixel of a stroke has a dark neighbour; a speck of noise does not
    p = np.pad(dark, 1)
    neighbours = (p[:-2, 1:-1].astype(np.uint8) + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:]
                  + p[:-2, :-2] + p[:-2, 2:] + p[2:, :-2] + p[2:, 2:])
    return dark & (neighbours >= 2)


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of the runs of True."""
    if not flags.any():
        return []
    d = np.diff(np.concatenate(([0], flags.astype(np.int8), [0])))
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist()))


def _close(flags: np.ndarray, gap: int) -> np.ndarray:
    """``flags`` with runs of False shorter than ``gap`` between two True runs filled."""
    out = flags.copy()
    runs = _runs(flags)
    for (_, e0), (s1, _) in zip(runs, runs[1:]):
        if s1 - e0 < gap:
            out[e0:s1] = True
    return out


def ink_text(image: Image.Image) -> InkText:
    img = image.convert("L")
    if max(img.size) > MAX_SIDE:
        scale = MAX_SIDE / max(img.size)
        img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.BILINEAR)
    gray = np.asarray(img, dtype=np.float32)
    mask = ink_mask(gray)
    h, w = mask.shape
    ys, xs = np.nonzero(mask)
    if ys.size < 20:
        return InkText(0, 0, 0.0, 0.0, ys.size / mask.size)
    xc = xs - w / 2.0
    step = max(1, ys.size // 20_000)  # the skew is found on at most ~20,000 ink pixels
    best, best_score = 0.0, -1.0
    for a in ANGLES:
        rows = np.round(ys[::step] - xc[::step] * np.tan(a)).astype(np.int64) + h  # shifted to stay >= 0
        score = float((np.bincount(rows, minlength=3 * h).astype(np.float64) ** 2).sum())
        if score > best_score:
            best, best_score = float(a), score
    best_rows = np.round(ys - xc * np.tan(best)).astype(np.int64) + h
    prof = np.bincount(best_rows, minlength=3 * h)
    floor = max(2.0, 0.05 * float(np.percentile(prof[prof > 0], 90)))
    bands = [(s, e) for s, e in _runs(_close(prof >= floor, 2)) if e - s >= 3]
    if not bands:
        return InkText(0, 0, 0.0, float(np.rad2deg(best)), ys.size / mask.size)
    heights = np.array([e - s for s, e in bands], dtype=np.float64)
    line_h = float(np.median(heights))
    cols = np.round(xs * np.cos(best) + ys * np.sin(best)).astype(np.int64)
    cols -= cols.min()
    order = np.argsort(best_rows)
    sorted_rows = best_rows[order]
    chars, lines = 0.0, 0
    for (s, e), bh in zip(bands, heights):
        lo, hi = np.searchsorted(sorted_rows, [s, e])
        in_band = cols[order[lo:hi]]
        if in_band.size == 0:
            continue
        covered = np.zeros(int(in_band.max()) + 1, dtype=bool)
        covered[in_band] = True
        covered = _close(covered, max(3, int(round(line_h))))
        width = sum(e1 - s1 for s1, e1 in _runs(covered) if e1 - s1 >= 2)
        n = max(1, int(round((bh + 0.3 * line_h) / (1.3 * line_h))))
        if bh < 0.4 * line_h and width > 0.5 * w and in_band.size > 0.6 * width * bh:
            continue  # a ruled line (a table's grid, an underline), not print
        if width and in_band.size > SOLID * width * bh:
            continue  # a solid area (a photograph, a drawing, a stamp), not lines of print
        lines += n
        chars += CHARS_PER_HEIGHT * n * width / max(line_h, 1.0)
    return InkText(int(round(chars)), lines, line_h, float(np.rad2deg(best)), ys.size / mask.size)
