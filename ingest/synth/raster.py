"""Rasterising synthetic pages: the model's base-mode view and scan-like degradation.

`base_view` reproduces what the project feeds the model for a PDF page: the page rendered so that its longer
side is `size` pixels (ingest/pages/render.py), then the processor's base mode for size > 640 (no resize, centred on a
square of gray 127). Pixels are kept as one uint8 channel (pages are grayscale; the processor would see R=G=B).
"""

from __future__ import annotations

import io
import random

import numpy as np
import pymupdf
from PIL import Image, ImageFilter

PAD_GRAY = 127


def pixmap_gray(page: pymupdf.Page, zoom_x: float, zoom_y: float | None = None) -> np.ndarray:
    pix = page.get_pixmap(matrix=pymupdf.Matrix(zoom_x, zoom_y or zoom_x), colorspace=pymupdf.csGRAY, alpha=False)
    arr = np.frombuffer(pix.samples, dtype=np.uint8).reshape(pix.height, pix.stride)
    return arr[:, : pix.width]


def render_long_side(page: pymupdf.Page, size: int) -> np.ndarray:
    """Like ingest/pages/render.py: the longer side becomes `size` pixels."""
    rect = page.rect
    return pixmap_gray(page, size / max(rect.width, rect.height))


def to_square(arr: np.ndarray, size: int) -> np.ndarray:
    """The processor's base mode: resize the longer side to `size` (aspect kept) and centre on gray 127.
    For size <= 640 the processor stretches to a square instead; both are handled."""
    h, w = arr.shape
    if size <= 640:
        if (h, w) != (size, size):
            arr = np.asarray(Image.fromarray(arr).resize((size, size), Image.BICUBIC))
        return np.array(arr)
    scale = size / max(h, w)
    nh, nw = round(h * scale), round(w * scale)
    if (nh, nw) != (h, w):
        arr = np.asarray(Image.fromarray(arr).resize((nw, nh), Image.BICUBIC))
    out = np.full((size, size), PAD_GRAY, dtype=np.uint8)
    y0, x0 = (size - nh) // 2, (size - nw) // 2
    out[y0 : y0 + nh, x0 : x0 + nw] = arr
    return out


def scanify(arr: np.ndarray, rng: random.Random, strength: float = 1.0) -> np.ndarray:
    """Scan-like degradation of a grayscale page: paper/ink levels, slight rotation, blur, noise."""
    img = Image.fromarray(arr)
    angle = rng.uniform(-1.5, 1.5) * strength
    if abs(angle) > 0.1:
        img = img.rotate(angle, resample=Image.BILINEAR, fillcolor=255)
    radius = rng.uniform(0.0, 0.9) * strength
    if radius > 0.25:
        img = img.filter(ImageFilter.GaussianBlur(radius))
    a = np.asarray(img, dtype=np.float32)
    paper, ink = rng.uniform(215, 250), rng.uniform(10, 70)
    a = ink + (paper - ink) * (a / 255.0)
    noise = _noise_field()
    h, w = a.shape
    if h > noise.shape[0] // 2 or w > noise.shape[1] // 2:  # large pages: fresh noise (slower)
        noise = np.random.default_rng(rng.randrange(2**32)).standard_normal((2 * h, 2 * w), dtype=np.float32)
    y0, x0 = rng.randrange(noise.shape[0] - h), rng.randrange(noise.shape[1] - w)
    sigma = rng.uniform(2, 10) * strength
    a += noise[y0 : y0 + h, x0 : x0 + w] * sigma
    if rng.random() < 0.5:  # sparse specks
        a[noise[y0 + 1 : y0 + h + 1, x0 : x0 + w] > 3.2] = ink
    return np.clip(a, 0, 255).astype(np.uint8)


_NOISE: list[np.ndarray] = []


def _noise_field() -> np.ndarray:
    """A fixed standard-normal field (seed 0) that pages crop at random offsets: fast and deterministic."""
    if not _NOISE:
        _NOISE.append(np.random.default_rng(0).standard_normal((2304, 2304), dtype=np.float32))
    return _NOISE[0]


def png_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG", optimize=False, compress_level=3)
    return buf.getvalue()
