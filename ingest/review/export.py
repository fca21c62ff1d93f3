"""Training pairs from the pages people corrected (``uflash export-corrections --out DIR``): for each page whose reading
stands corrected (db.reviews), the page image as the model read it (rendered from the archived original, turned as it
was read) and the person's reading (the model's output format: its elements, labels and boxes kept), for the drafter
recipe (``python -m scripts.train.drafter --pairs DIR``, docs/drafter_training.md), which takes them as labels.

The folder holds ``<document>-<page>.png`` and ``pairs.jsonl``, one line per pair: ``image`` (the file's name in the
folder), ``text``, ``document`` (the original's name), ``document_id``, ``page``, ``sha256`` (the original's).
"""

from __future__ import annotations

import json
from pathlib import Path

from loguru import logger

from db.documents import documents
from db.reviews import standing_corrections
from db.session import Database
from ingest.files import write_atomic
from ingest.pages.orientation import page_turn, turn

MANIFEST = "pairs.jsonl"


def export_corrections(db: Database, out: Path) -> list[dict]:
    """Write the pairs into ``out`` (see the module); the lines of ``pairs.jsonl``. A page whose original is gone is
    left out, and the log says so."""
    from ingest.pages.render import render_pages

    out.mkdir(parents=True, exist_ok=True)
    corrections = standing_corrections(db)
    docs = {d.id: d for d in documents(db, {p.document_id for _, p in corrections})}
    lines = []
    for review, page in corrections:
        doc = docs[page.document_id]
        original = next((Path(q) for q in (doc.archived_path, doc.original_path) if q and Path(q).exists()), None)
        if original is None:
            logger.warning("{} page {}: its original is gone: no image, left out", doc.original_name, page.page_index)
            continue
        image = render_pages(original, doc.kind, page.page_index, page.page_index)[0].image
        name = f"{doc.id:05d}-{page.page_index:04d}.png"
        turn(image, page_turn(page.stats)).save(out / name)
        lines.append({"image": name, "text": review.text or "", "document": doc.original_name,
                      "document_id": doc.id, "page": page.page_index, "sha256": doc.sha256})
    write_atomic(out / MANIFEST, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    return lines


def read_pairs(folder: Path, limit: int | None = None) -> tuple[list, list[str]]:
    """(page images, their texts) of an exported folder, at most ``limit`` of them."""
    from PIL import Image

    lines = [json.loads(x) for x in (folder / MANIFEST).read_text(encoding="utf-8").splitlines() if x.strip()]
    lines = lines[:limit] if limit else lines
    return [Image.open(folder / line["image"]).convert("RGB") for line in lines], [line["text"] for line in lines]
