"""A difficulty ladder of labelled documents: what the grades are calibrated on (python -m scripts.eval.grades).

    pdf_bytes, labels, rung = ladder_document(seed)

Each seed draws one document (one chunk of 1-4 pages) from the ladder's axes, so that the demo model reads some
well and some badly: body size 9-20 pt (it was trained on 15-24 pt), Helvetica / Times / Courier, sparse, normal or
dense pages, tables or none, words of the generator's list or pseudo-words it cannot recall (``open_words``), and
born-digital pages (a text layer) or scans (image-only pages with noise, blur and skew of three strengths).
Same seed -> same document; seeds below ``ingest.synth.documents.HELD_OUT_LIMIT`` were never used in training.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import numpy as np
import pymupdf
from PIL import Image, ImageFilter

from ingest.synth import text as T
from ingest.synth.doc import PAGE_SIZES, PageBuilder, Style, draw_page, page_label
from ingest.synth.documents import _page_rng, scanned_copy
from ingest.synth.raster import _noise_field

SIZES = (9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 16.0, 18.0, 20.0)
FAMILIES = ("helv", "tiro", "cour")
DENSITY = {"sparse": None, "normal": (200, 620), "dense": (500, 1000)}
SCANS = {  # strength: (skew degrees, blur radius, noise sigma) drawn up to these
    "none": None,
    "light": (0.8, 0.6, 5.0),
    "heavy": (2.5, 1.4, 16.0),
}


@dataclass(frozen=True)
class Rung:
    """One document's place on the ladder."""

    seed: int
    pages: int  # 1-4: the document is one chunk
    size: float  # body font size, points
    family: str
    density: str  # sparse | normal | dense
    tables: bool
    open_words: float  # share of pseudo-words (0: the generator's word list)
    scan: str  # none (born digital, with a text layer) | light | heavy

    def dict(self) -> dict:
        return asdict(self)


def ladder_rung(seed: int) -> Rung:
    rng = random.Random(("ladder", seed).__repr__())
    return Rung(seed=seed, pages=rng.choice((1, 2, 3, 4)), size=rng.choice(SIZES), family=rng.choice(FAMILIES),
                density=rng.choices(list(DENSITY), weights=(2, 5, 3))[0], tables=rng.random() < 0.4,
                open_words=rng.choice((0.0, 0.0, 0.3, 0.7)), scan=rng.choices(list(SCANS), weights=(4, 3, 3))[0])


def _style(rung: Rung, rng: random.Random) -> Style:
    lo_hi = DENSITY[rung.density] or (60, 200)
    return Style(family=rung.family, body=rung.size, line_gap=rng.uniform(1.15, 1.45), page=rng.choice(PAGE_SIZES),
                 margin=rng.uniform(40, 80), two_columns=0.25,
                 header=T.phrase(rng, 1, 4) if rng.random() < 0.45 else None,
                 footer_kind=rng.randrange(5), bullet=rng.choice(["•", "-", "*"]), numbered=rng.choice(["1.", "1)"]),
                 chinese=0.0, density=lo_hi, open_words=rung.open_words)


def ladder_pages(rung: Rung) -> tuple[pymupdf.Document, list[str]]:
    """The document with its text layer, and each page's label."""
    style = _style(rung, random.Random(rung.seed))
    doc = pymupdf.open()
    labels = []
    for i in range(rung.pages):
        builder = PageBuilder(_page_rng(rung.seed, i), style, i, rung.pages, 1.0 if rung.tables else 0.4)
        elements = builder.build_sparse() if rung.density == "sparse" else builder.build()
        page = doc.new_page(width=style.page[0], height=style.page[1])
        draw_page(page, elements)
        labels.append(page_label(elements, style.page))
    return doc, labels


def degrade(arr: np.ndarray, rng: random.Random, limits: tuple[float, float, float]) -> np.ndarray:
    """A scan of a grayscale page: skew, blur, paper and ink levels, noise and specks, each drawn up to ``limits``
    (skew degrees, blur radius, noise sigma)."""
    skew, blur, sigma = limits
    img = Image.fromarray(arr)
    angle = rng.uniform(-skew, skew)
    if abs(angle) > 0.1:
        img = img.rotate(angle, resample=Image.BILINEAR, fillcolor=255)
    radius = rng.uniform(blur / 3, blur)
    if radius > 0.25:
        img = img.filter(ImageFilter.GaussianBlur(radius))
    a = np.asarray(img, dtype=np.float32)
    paper, ink = rng.uniform(200, 250), rng.uniform(10, 80)
    a = ink + (paper - ink) * (a / 255.0)
    h, w = a.shape
    noise = np.random.default_rng(rng.randrange(2**32)).standard_normal((h + 1, w), dtype=np.float32) \
        if h >= _noise_field().shape[0] or w >= _noise_field().shape[1] else _noise_field()
    y0, x0 = rng.randrange(noise.shape[0] - h), rng.randrange(noise.shape[1] - w + 1)
    a += noise[y0 : y0 + h, x0 : x0 + w] * rng.uniform(sigma / 3, sigma)
    if rng.random() < 0.5:
        a[noise[y0 + 1 : y0 + h + 1, x0 : x0 + w] > 3.2] = ink
    return np.clip(a, 0, 255).astype(np.uint8)


def ladder_document(seed: int) -> tuple[bytes, list[str], Rung]:
    """(PDF bytes, one label per page, the rung). Scans are image-only pages (JPEG at 150 dpi, no text layer)."""
    rung = ladder_rung(seed)
    doc, labels = ladder_pages(rung)
    if rung.scan != "none":
        doc = scanned_copy(doc, seed, lambda arr, rng: degrade(arr, rng, SCANS[rung.scan]), quality=80)
    data = doc.tobytes(garbage=3, deflate=True, no_new_id=True)
    doc.close()
    return data, labels, rung
