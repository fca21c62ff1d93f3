"""What is this file? Sniff the content, open it, count pages, and refuse what cannot be processed.

``probe_file`` either returns the kind and page count, or raises ``InputRejected`` with a reason a person
can act on. It never trusts the extension alone: the name must agree with the content.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pymupdf
from PIL import Image, ImageSequence

from ingest.errors import InputIncomplete, InputRejected

SUFFIX_KIND = {".pdf": "pdf", ".tif": "tiff", ".tiff": "tiff", ".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg"}
KIND_LABEL = {"pdf": "PDF", "tiff": "TIFF", "png": "PNG", "jpeg": "JPEG"}


@dataclass(frozen=True)
class Probed:
    kind: str  # pdf | tiff | png | jpeg
    page_count: int
    text_chars: tuple[int, ...] = ()  # characters in each page's PDF text layer (empty for images)


def sniff(head: bytes) -> str | None:
    """The kind of file these first bytes start, or None."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head.startswith((b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")):
        return "tiff"
    if b"%PDF-" in head[:1024]:
        return "pdf"
    return None


def probe_file(path: Path, max_page_pixels: int) -> Probed:
    path = Path(path)
    expected = SUFFIX_KIND.get(path.suffix.lower())
    if expected is None:
        raise InputRejected(f"unsupported file type '{path.suffix or '(no extension)'}': uflash reads PDF, TIFF, PNG "
                            "and JPEG")
    size = path.stat().st_size
    if size == 0:
        raise InputRejected("empty file (0 bytes)")
    with open(path, "rb") as f:
        head = f.read(2048)
    actual = sniff(head)
    if actual is None:
        raise InputRejected(f"not a {KIND_LABEL[expected]} file: its content is not a known document or image format")
    if actual != expected:
        raise InputRejected(f"the name says {KIND_LABEL[expected]} but the content is {KIND_LABEL[actual]}")
    if actual == "pdf":
        return Probed("pdf", *_probe_pdf(path, size, max_page_pixels))
    return Probed(actual, _probe_image(path, max_page_pixels))


def _probe_pdf(path: Path, size: int, max_page_pixels: int) -> tuple[int, tuple[int, ...]]:
    with open(path, "rb") as f:
        f.seek(max(0, size - 2048))
        tail = f.read()
    if b"%%EOF" not in tail:
        raise InputIncomplete("truncated PDF: no %%EOF marker at the end (the file was cut short or is still being "
                              "written)")
    try:
        doc = pymupdf.open(path, filetype="pdf")
    except Exception as e:  # pymupdf raises its own FileDataError and friends
        raise InputRejected(f"broken PDF: {e}") from None
    with doc:
        if doc.needs_pass and not doc.authenticate(""):
            raise InputRejected("encrypted PDF: it needs a password to open")
        n = doc.page_count
        if n == 0:
            raise InputRejected("PDF has no pages")
        chars = []
        for i in range(n):
            try:
                page = doc.load_page(i)
                images = page.get_images(full=True)
                chars.append(len(page.get_text("text").strip()))
            except Exception as e:
                raise InputRejected(f"broken PDF: page {i + 1} cannot be read: {e}") from None
            for img in images:
                w, h = int(img[2]), int(img[3])
                if w * h > max_page_pixels:
                    raise InputRejected(
                        f"page {i + 1} holds an image of {w}x{h} pixels, over the limit of {max_page_pixels} "
                        "(watch.max_page_pixels)"
                    )
    return n, tuple(chars)


def _probe_image(path: Path, max_page_pixels: int) -> int:
    try:
        with Image.open(path) as im:
            n = 0
            for frame in ImageSequence.Iterator(im):
                n += 1
                w, h = frame.size
                if w * h > max_page_pixels:
                    raise InputRejected(
                        f"page {n} is {w}x{h} pixels, over the limit of {max_page_pixels} (watch.max_page_pixels)"
                    )
                frame.load()  # decodes the pixels: catches truncated and corrupt data
    except InputRejected:
        raise
    except Image.DecompressionBombError as e:
        raise InputRejected(f"page too large to render safely: {e}") from None
    except Exception as e:  # PIL raises OSError/SyntaxError/ValueError for broken images
        if "truncated" in str(e).lower():
            raise InputIncomplete(f"broken image: {e} (cut short, or still being written)") from None
        raise InputRejected(f"broken image: {e}") from None
    if n == 0:
        raise InputRejected("image has no pages")
    return n
