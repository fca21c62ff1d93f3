"""Render document pages to RGB images for the model, and read each page's PDF text layer.

Pages are rendered so that the longer side is ``target_px`` (the processor then resizes/pads to the
model's base size, 1024 px: 273 vision tokens a page). Memory stays bounded whatever the page size: a PDF
page is rasterised at a scale computed from its size, an image is decoded with ``draft`` (JPEG) and
reduced frame by frame. PDF /Rotate is honoured (pymupdf renders the page as displayed), and so is an image's
EXIF orientation (a camera or phone scan held sideways stores upright pixels only with that tag applied).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pymupdf
from PIL import Image, ImageSequence

DEFAULT_TARGET_PX = 1024
EXIF_ORIENTATION = 0x0112
# EXIF orientation -> the transpose that shows the image as the camera meant it (as PIL.ImageOps.exif_transpose)
UPRIGHT = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
           5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
           8: Image.Transpose.ROTATE_90}


@dataclass
class RenderedPage:
    index: int  # 1-based page number in the document
    image: Image.Image  # RGB, longer side == target_px (or smaller for small images)
    text_layer: str | None  # the PDF's own text for this page, None for images / pages without text


def render_pages(path: Path, kind: str, first: int, last: int, target_px: int = DEFAULT_TARGET_PX,
                 max_page_pixels: int = 150_000_000) -> list[RenderedPage]:
    """Pages ``first``..``last`` (1-based, inclusive) of the document."""
    if kind == "pdf":
        return list(_pdf_pages(Path(path), first, last, target_px))
    return list(_image_pages(Path(path), first, last, target_px, max_page_pixels))


def _pdf_pages(path: Path, first: int, last: int, target_px: int) -> Iterator[RenderedPage]:
    with pymupdf.open(path) as doc:
        for i in range(first - 1, last):
            page = doc.load_page(i)
            rect = page.rect  # already rotated by /Rotate
            long_side = max(rect.width, rect.height) or 1.0
            zoom = target_px / long_side
            pix = page.get_pixmap(matrix=pymupdf.Matrix(zoom, zoom), colorspace=pymupdf.csRGB, alpha=False)
            img = Image.frombytes("RGB", (pix.width, pix.height), pix.samples)
            text = page.get_text("text").strip()
            yield RenderedPage(i + 1, img, text or None)


def _fit(img: Image.Image, target_px: int) -> Image.Image:
    img = img.convert("RGB")
    if max(img.size) > target_px:
        scale = target_px / max(img.size)
        img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.LANCZOS)
    return img


def _image_pages(path: Path, first: int, last: int, target_px: int, max_page_pixels: int) -> Iterator[RenderedPage]:
    with Image.open(path) as im:
        for n, frame in enumerate(ImageSequence.Iterator(im), start=1):
            if n < first:
                continue
            if n > last:
                break
            if frame.width * frame.height > max_page_pixels:
                raise ValueError(f"page {n} is {frame.width}x{frame.height} pixels, over {max_page_pixels}")
            upright = UPRIGHT.get(frame.getexif().get(EXIF_ORIENTATION, 1))
            if frame.format == "JPEG":
                frame.draft("RGB", (target_px, target_px))
            if frame.mode in ("1", "L", "P", "LA", "PA", "RGBA", "I;16", "I", "F", "CMYK", "YCbCr"):
                frame = flatten_to_rgb(frame)
            img = _fit(frame, target_px)
            yield RenderedPage(n, img.transpose(upright) if upright is not None else img, None)


def flatten_to_rgb(frame: Image.Image) -> Image.Image:
    """Alpha onto white; 16-bit/float greyscale scaled to 8 bits; everything else to RGB."""
    if frame.mode in ("RGBA", "LA", "PA") or (frame.mode == "P" and "transparency" in frame.info):
        rgba = frame.convert("RGBA")
        bg = Image.new("RGB", rgba.size, "white")
        bg.paste(rgba, mask=rgba.getchannel("A"))
        return bg
    if frame.mode in ("I;16", "I", "F"):
        lo, hi = frame.getextrema()
        scale = 255.0 / (hi - lo) if hi > lo else 1.0
        return frame.point(lambda v: (v - lo) * scale).convert("L").convert("RGB")
    return frame.convert("RGB")
