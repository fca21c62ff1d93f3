"""Pages scanned sideways (a landscape sheet scanned in portrait, a page put on the glass the wrong way) or upside
down (a sheet fed into the scanner reversed) are turned before the model reads them, so it reads them upright.

Two steps, so that an upright page costs next to nothing (a few milliseconds):
1. No model: two measures of the page's ink, at PROFILE_PX.
   - ``stripe_ratio``: how much more the ink alternates from row to row than from column to column. Lines of
     text make the rows alternate (ink, gap, ink ...) while every column crosses all the lines; a sideways page
     gives the reverse. It is measured over the rows and columns that hold the middle 96% of the ink each way
     (INK_TRIM), so that the blank part of a page of short lines (a register, an index) does not count: over the
     whole page, 34 upright lines of two words measured 0.44 and the same page sideways 2.29, the wrong way round.
     Below ``sideways_below`` (default 0.75) the page is probed for a quarter turn. Measured
     (scripts/eval/orientation.py): 24 upright synthetic scans 1.55-4.45, turned a quarter 0.22-0.64; 15 list
     pages (2-14 words a line, 8-34 lines) 1.71-2.21 and 0.45-0.59; the 20 upright pages with ink among the real
     samples 0.89-4.12 (none looked at), the two real sideways sheets of ``cardinal.pdf`` 0.257.
   - ``ragged_edges``: the stripes cannot tell an upside-down page (its lines run across too), but its edges can.
     Lines of text start aligned at the left margin and end ragged on the right (the short last line of a
     paragraph, a line that ends early); turned upside down, the ends are aligned and the starts ragged. The
     measure is (spread of the line ends - spread of the line starts) / their sum over the page's text lines:
     near +1 upright, near -1 upside down, None with fewer than MIN_LINES lines. Below ``upside_down_below``
     (default -0.5) the page is probed for a half turn. Measured: 23 upright synthetic scans with
     enough lines -0.45..1.0 (22 above 0.58), the same upside down the mirror image; the real samples' upright pages
     with enough lines 0.05-0.99, and the upside-down sheet of ``cardinal.pdf`` (page 3) -0.99. Right-aligned
     scripts (Arabic, Hebrew) and pages of centred lines look upside down or say nothing; the model decides.
2. ``choose_turn`` (the model): the page as it is and the candidate turns (90 and 270, or 180) are each decoded for
   ``probe_tokens`` tokens; a turn is kept only when the model reads it well (mean log-probability of its tokens
   at least ``min_logprob``) and clearly better than the page as it is (by ``min_gain``). The measures say *that*
   a page may be turned, not which way is up; the model says which way reads. A model that cannot read the page
   scores all of them low and alike, and the page is left as it is: the demo model on the real sideways sheets of
   ``cardinal.pdf`` scores -0.89 / -0.77 / -0.91 (as it is / 90 / 270, where 270 is right), so without the floor
   it turned that page upside down.

Not detected: a page turned by a few degrees (skew) is read as it is. ``turn`` is clockwise, as a PDF page's
/Rotate: the page image is turned ``turn`` degrees clockwise for the model, so its boxes are those of the upright
page, and ``document.pdf`` shows the page turned the same way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from ingest.config import OrientationSettings

PROFILE_PX = 600  # the page is measured at this size (longer side)
MIN_LINES = 5  # ragged_edges needs at least this many lines of text (bands of rows with ink, 3 px or taller)
INK_TRIM = 0.02  # stripe_ratio measures the rows and columns that hold the middle 96% of the ink, each way


def turn(image: Image.Image, degrees: int) -> Image.Image:
    """``image`` turned ``degrees`` (0, 90, 180, 270) clockwise."""
    return image.rotate(-degrees, expand=True) if degrees % 360 else image


def _ink(image: Image.Image) -> np.ndarray:
    """1 where the page has ink, 0 elsewhere (Otsu threshold), at PROFILE_PX, the outer tenth on each side cut
    off (scanner borders, punch holes)."""
    g = ImageOps.grayscale(image)
    s = PROFILE_PX / max(g.size)
    if s < 1:
        g = g.resize((max(1, round(g.width * s)), max(1, round(g.height * s))), Image.Resampling.BILINEAR)
    a = np.asarray(g, dtype=np.uint8)
    h, w = a.shape
    a = a[h // 10 : h - h // 10, w // 10 : w - w // 10]
    p = np.bincount(a.ravel(), minlength=256) / max(1, a.size)
    below = np.cumsum(p)  # share of pixels at or below each grey level
    mean_below = np.cumsum(p * np.arange(256))
    between = (mean_below[-1] * below - mean_below) ** 2 / np.maximum(below * (1 - below), 1e-12)
    ink = a <= int(np.argmax(between))
    return ~ink if ink.mean() > 0.5 else ink  # light text on a dark page


def _variation(profile: np.ndarray) -> float:
    mean = float(profile.mean())
    return float(profile.std()) / mean if mean > 0 else 0.0


def stripe_ratio(image: Image.Image) -> float | None:
    """Variation of the ink from row to row over its variation from column to column (coefficients of
    variation of the two ink profiles): above 1 for lines that run across, below 1 for lines that run up and
    down. None for a page with (next to) no ink."""
    return _stripe_ratio(_ink(image))


def _core(profile: np.ndarray) -> slice:
    """The span of a profile that holds all of its ink but INK_TRIM at each end."""
    share = np.cumsum(profile) / profile.sum()
    return slice(int(np.searchsorted(share, INK_TRIM)), int(np.searchsorted(share, 1 - INK_TRIM)) + 1)


def _stripe_ratio(ink: np.ndarray) -> float | None:
    if ink.size == 0 or ink.mean() < 0.002:
        return None
    core = ink[_core(ink.sum(axis=1)), _core(ink.sum(axis=0))]  # blank margins and a stray speck left out
    rows, cols = _variation(core.mean(axis=1)), _variation(core.mean(axis=0))
    return rows / cols if cols > 0 else math.inf


def ragged_edges(image: Image.Image) -> float | None:
    """(Spread of the text lines' right ends - spread of their left starts) / their sum, in [-1, 1]: near +1 for
    lines read upright (left-aligned starts, ragged ends), near -1 for the same page upside down. A spread is the
    mean distance of the lines' starts (ends) from the outermost one. None with fewer than MIN_LINES lines."""
    return _ragged_edges(_ink(image))


def _ragged_edges(ink: np.ndarray) -> float | None:
    rows = ink.any(axis=1)
    edges = np.flatnonzero(np.diff(np.concatenate(([False], rows, [False])).astype(np.int8)))
    starts, ends = [], []
    for top, bottom in zip(edges[::2], edges[1::2]):  # bands of rows with ink: the lines (or blocks of them)
        if bottom - top < 3:
            continue
        cols = np.flatnonzero(ink[top:bottom].any(axis=0))
        starts.append(cols[0])
        ends.append(cols[-1])
    if len(starts) < MIN_LINES:
        return None
    start_spread = float(np.mean(np.asarray(starts) - min(starts)))
    end_spread = float(np.mean(max(ends) - np.asarray(ends)))
    total = start_spread + end_spread
    return (end_spread - start_spread) / total if total > 0 else 0.0


@dataclass
class TurnChoice:
    turn: int  # degrees clockwise (0: left as it is)
    ratio: float | None  # stripe_ratio of the page as it came
    scores: dict[int, float] | None = None  # mean log-probability of each probe (None: not probed)
    probe_s: float = 0.0  # time spent probing
    edges: float | None = None  # ragged_edges of the page as it came (None: not measured, or too few lines)

    @property
    def looks(self) -> str:
        """How the page looked before the probes (probed pages only): sideways or upside down, and why."""
        if 180 in (self.scores or {}):
            return f"upside down (ragged edges {self.edges:.2f})"
        return f"sideways (stripe ratio {self.ratio:.2f})"

    def note(self) -> str:
        """The page's note when it was turned."""
        way = "upside down" if self.turn == 180 else "sideways"
        return f"scanned {way}: turned {self.turn} degrees clockwise to be read"

    def record(self) -> dict:
        """What the page's stats keep (probed pages only)."""
        return {"stripe_ratio": None if self.ratio is None else round(self.ratio, 3),
                "ragged_edges": None if self.edges is None else round(self.edges, 3), "turned": self.turn,
                "probe_mean_logprob": {str(k): round(v, 4) if v > -math.inf else None
                                       for k, v in (self.scores or {}).items()},
                "probe_s": round(self.probe_s, 3)}


@dataclass(frozen=True)
class InkMeasures:
    """The model-free first step: the page's measures and the turns worth probing (none for an upright page)."""

    ratio: float | None
    edges: float | None
    candidates: tuple[int, ...]


def measure_ink(image: Image.Image, config: OrientationSettings) -> InkMeasures:
    """Measure the page's ink (a few milliseconds, no model): which turns, if any, the model should be asked about."""
    ink = _ink(image)
    ratio, edges = _stripe_ratio(ink), None
    if ratio is None:
        return InkMeasures(ratio, None, ())
    if ratio < config.sideways_below:
        return InkMeasures(ratio, None, (90, 270))
    edges = _ragged_edges(ink)
    return InkMeasures(ratio, edges, (180,) if edges is not None and edges < config.upside_down_below else ())


def choose_turn(image: Image.Image, probe: Callable[[Image.Image], float], config: OrientationSettings,
                measures: InkMeasures | None = None) -> TurnChoice:
    """The turn under which the model reads ``image`` best. ``probe(image)`` returns the mean log-probability of
    the first ``config.probe_tokens`` tokens the model reads there (-inf when it reads none); it is called only
    for pages that look sideways (three times then: as it is, 90, 270) or upside down (twice: as it is, 180).
    ``measures``: the page's ``measure_ink``, when taken already."""
    m = measures or measure_ink(image, config)
    if not m.candidates:
        return TurnChoice(0, m.ratio, edges=m.edges)
    t0 = time.perf_counter()
    scores = {t: probe(turn(image, t)) for t in (0, *m.candidates)}
    return decide(m, scores, config, time.perf_counter() - t0)


def decide(measures: InkMeasures, scores: dict[int, float], config: OrientationSettings,
           probe_s: float = 0.0) -> TurnChoice:
    """The turn chosen from the probes' ``scores`` (turn -> mean log-probability, the page as it is and each of
    ``measures.candidates``): the best candidate, when the model reads it well and clearly better than the page as it
    is (``choose_turn``; the worker probes without waiting, ingest.worker.probes, and decides here)."""
    best = max(measures.candidates, key=lambda t: scores[t])
    keep = scores[best] >= config.min_logprob and scores[best] - scores[0] >= config.min_gain
    return TurnChoice(best if keep else 0, measures.ratio, scores, probe_s, measures.edges)


def probe_score(out) -> float:  # noqa: ANN001 - an engine.chunk_output.ChunkOutput
    """A probe's score: the mean log-probability of what the model read (-inf for nothing)."""
    logprobs = out.pages[0].logprobs if out.pages else []
    return sum(logprobs) / len(logprobs) if logprobs else -math.inf


def decoder_probe(decoder, context_limit: int, tokens: int) -> Callable[[Image.Image], float]:
    """A ``probe`` for `choose_turn`: ``decoder`` (an engine.chunk_decode.ChunkDecoder) reads the page alone for
    ``tokens`` tokens; the mean log-probability of what it read (-inf for nothing)."""

    def probe(image: Image.Image) -> float:
        return probe_score(decoder.decode([image], context_limit=context_limit, max_new_tokens=tokens))

    return probe


def page_turn(stats: dict | None) -> int:
    """Degrees clockwise a stored page was turned to be read (0: as it came), from its stats."""
    return ((stats or {}).get("orientation") or {}).get("turned", 0)
