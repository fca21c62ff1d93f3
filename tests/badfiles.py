"""Every class of bad input the intake must refuse, made for real with pymupdf, PIL and raw bytes."""

from __future__ import annotations

import io
from pathlib import Path

import pymupdf
from PIL import Image

from tests.conftest import make_pdf


def zero_page_pdf() -> bytes:
    objs = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [] /Count 0 >>"]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objs, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref)
    return bytes(out)


def png_bytes(w: int = 64, h: int = 48) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), "white").save(buf, "PNG")
    return buf.getvalue()


def make_bad_files(folder: Path, tmp: Path) -> dict[str, tuple[Path, str]]:
    """name -> (path, a substring the recorded reason must contain). ``max_page_pixels`` must be 1,000,000."""
    folder.mkdir(parents=True, exist_ok=True)
    good = make_pdf(tmp / "good.pdf", 3).read_bytes()
    files: dict[str, tuple[Path, str]] = {}

    def put(name: str, data: bytes, why: str) -> None:
        p = folder / name
        p.write_bytes(data)
        files[name] = (p, why)

    put("png_named.pdf", png_bytes(), "the name says PDF but the content is PNG")
    put("empty.pdf", b"", "empty file")
    put("truncated.pdf", good[: len(good) // 2], "truncated PDF")
    put("zero_pages.pdf", zero_page_pdf(), "no pages")
    put("garbage.jpg", b"this is not a jpeg at all\n" * 20, "not a JPEG")
    put("notes.docx", b"PK\x03\x04 not really a docx", "unsupported file type")
    put("truncated.png", png_bytes(400, 300)[:200], "broken image")

    enc = pymupdf.open(stream=good, filetype="pdf")
    put("encrypted.pdf", enc.tobytes(encryption=pymupdf.PDF_ENCRYPT_AES_256, owner_pw="owner", user_pw="secret"),
        "needs a password")
    enc.close()

    big = pymupdf.open()
    page = big.new_page()
    page.insert_image(page.rect, stream=png_bytes(1500, 1000))  # 1.5 M pixels > 1 M limit
    put("huge_image.pdf", big.tobytes(), "over the limit")
    big.close()
    put("huge.png", png_bytes(1200, 1000), "over the limit")

    tif = io.BytesIO()
    frames = [Image.new("L", (300, 200), 255) for _ in range(3)]
    frames[0].save(tif, "TIFF", save_all=True, append_images=frames[1:], compression="tiff_lzw")
    put("truncated.tiff", tif.getvalue()[: len(tif.getvalue()) // 3], "broken image")
    return files
