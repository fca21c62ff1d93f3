"""Sideways scans: pages whose text lines run up and down (a landscape sheet scanned in portrait, a page put on
the glass the wrong way) are turned before the model reads them, so it reads them upright.

Two steps, so that an upright page costs next to nothing:
1. ``stripe_ratio`` (no model): how much more the page's ink alternates from row to row than from column to
   column. Lines of text make the rows alternate (ink, gap, ink ...) while every column crosses all the lines;
   a sideways page gives the reverse. A page is *looked at* only when the ratio is below ``sideways_below``
   (default 0.67: the columns alternate at least 1.5x as much as the rows). Measured (session 16,
   scripts/eval_orientation.py): 24 upright synthetic scans 1.94-6.51, turned a quarter 0.15-0.52; the 20 upright
   pages with ink among the real samples 0.78-4.1 (none looked at), the two real sideways sheets of
   ``cardinal.pdf`` 0.455.
2. ``choose_turn`` (the model): the two quarter turns and the page as it is are each decoded for
   ``probe_tokens`` tokens; a turn is kept only when the model reads it well (mean log-probability of its tokens
   at least ``min_logprob``) and clearly better than the page as it is (by ``min_gain``). The stripes say *that*
   lines run up and down, not which way is up; the model says which way reads. A model that cannot read the page
   scores all three low and alike, and the page is left as it is: the demo model on the real sideways sheets of
   ``cardinal.pdf`` scores -0.89 / -0.77 / -0.91 (as it is / 90 / 270, where 270 is right), so without the floor
   it turned that page upside down.

Not detected: pages upside down (their lines run across, like an upright page's); a page turned by a few degrees
(skew) is read as it is. ``turn`` is clockwise, as a PDF page's /Rotate: the page image is turned ``turn``
degrees clockwise for the model, so its boxes are those of the upright page, and ``document.pdf`` shows the page
turned the same way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

PROFILE_PX = 600  # the page is measured at this size (longer side)


@dataclass(frozen=True)
class OrientationConfig:
    sideways_below: float = 0.67  # stripe_ratio below this: the page is probed
    probe_tokens: int = 256  # tokens decoded per probe
    min_gain: float = 0.1  # a turn must beat the page as it is by this much mean log-probability
    min_logprob: float = -0.5  # ... and be read with at least this mean log-probability (quality's "fair" line)


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
    ink = _ink(image)
    if ink.size == 0 or ink.mean() < 0.002:
        return None
    rows, cols = _variation(ink.mean(axis=1)), _variation(ink.mean(axis=0))
    return rows / cols if cols > 0 else math.inf


@dataclass
class TurnChoice:
    turn: int  # degrees clockwise (0: left as it is)
    ratio: float | None  # stripe_ratio of the page as it came
    scores: dict[int, float] | None = None  # mean log-probability of each probe (None: not probed)
    probe_s: float = 0.0  # time spent probing

    def record(self) -> dict:
        """What the page's stats keep (probed pages only)."""
        return {"stripe_ratio": None if self.ratio is None else round(self.ratio, 3), "turned": self.turn,
                "probe_mean_logprob": {str(k): round(v, 4) if v > -math.inf else None
                                       for k, v in (self.scores or {}).items()},
                "probe_s": round(self.probe_s, 3)}


def choose_turn(image: Image.Image, probe: Callable[[Image.Image], float], config: OrientationConfig) -> TurnChoice:
    """The turn under which the model reads ``image`` best. ``probe(image)`` returns the mean log-probability of
    the first ``config.probe_tokens`` tokens the model reads there (-inf when it reads none); it is called only
    for pages that look sideways (three times then)."""
    ratio = stripe_ratio(image)
    if ratio is None or ratio >= config.sideways_below:
        return TurnChoice(0, ratio)
    t0 = time.perf_counter()
    scores = {t: probe(turn(image, t)) for t in (0, 90, 270)}
    best = max((90, 270), key=lambda t: scores[t])
    keep = scores[best] >= config.min_logprob and scores[best] - scores[0] >= config.min_gain
    return TurnChoice(best if keep else 0, ratio, scores, time.perf_counter() - t0)


def decoder_probe(decoder, context_limit: int, tokens: int) -> Callable[[Image.Image], float]:
    """A ``probe`` for `choose_turn`: ``decoder`` (an engine.chunk_decode.ChunkDecoder) reads the page alone for
    ``tokens`` tokens; the mean log-probability of what it read (-inf for nothing)."""

    def probe(image: Image.Image) -> float:
        out = decoder.decode([image], context_limit=context_limit, max_new_tokens=tokens)
        logprobs = out.pages[0].logprobs if out.pages else []
        return sum(logprobs) / len(logprobs) if logprobs else -math.inf

    return probe


def page_turn(stats: dict | None) -> int:
    """Degrees clockwise a stored page was turned to be read (0: as it came), from its stats."""
    return ((stats or {}).get("orientation") or {}).get("turned", 0)
