"""Write held-out synthetic pages as PNG files (rendered as uflash renders PDFs) with their text layers beside them:
the page folders the GPU scripts read (``--pages-dir``), where pymupdf may be missing.

    python -m scripts.synth --out pages --pages 24 --seed0 880000
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pymupdf

from ingest.synth.documents import HELD_OUT_LIMIT, make_document, render_pages


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pages", type=int, default=24)
    ap.add_argument("--seed0", type=int, default=880_000)
    ap.add_argument("--scan", action="store_true", help="scan-like image-only pages (no text layer: their .txt is empty)")
    args = ap.parse_args(argv)
    if args.seed0 + args.pages > HELD_OUT_LIMIT:
        raise SystemExit(f"held-out seeds must stay below {HELD_OUT_LIMIT:,}")
    args.out.mkdir(parents=True, exist_ok=True)
    for seed in range(args.seed0, args.seed0 + args.pages):
        pdf, labels = make_document(seed, 1, scan=args.scan)
        with pymupdf.open(stream=pdf, filetype="pdf") as doc:
            text = doc[0].get_text()
        render_pages(pdf)[0].save(args.out / f"{seed}.png", optimize=True)
        (args.out / f"{seed}.txt").write_text(text, encoding="utf-8")
    print(f"{args.pages} pages in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
