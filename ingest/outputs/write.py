"""Per-document outputs in the outbox, as ``[outputs] formats`` asks: ``document.md`` (pages in order, with page
markers), ``document.json`` (always), and the archival formats (ingest.outputs.archival): ``alto/<page>.xml``,
``document.hocr`` and, given the original, ``document.pdf`` (PDF/A-2b: ingest.outputs.pdfa). All are written atomically
(temp file + rename): a reader never sees half a file. The PDF is an extra: if it cannot be made, the log says why
and the document is still done (its text is in the others)."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ingest.files import write_atomic
from ingest.reading.text import page_markdown


def holds_another_document(folder: Path, sha256: str) -> bool:
    """``folder`` has a document.json of another document than ``sha256`` (or one that cannot be read)."""
    meta = folder / "document.json"
    if not meta.exists():
        return False
    try:
        return json.loads(meta.read_text(encoding="utf-8"))["document"]["sha256"] != sha256
    except (ValueError, KeyError, OSError):
        return True


def write_document_outputs(folder: Path, document: dict[str, Any], run: dict[str, Any],
                           pages: list[dict[str, Any]], source: Path | None = None,
                           formats: Collection[str] = ("md", "json", "pdf", "alto")) -> tuple[Path, Path]:
    """document.json, and of ``formats`` document.md, and (ingest.outputs.archival) ALTO, hOCR and, when ``source`` (the
    original file) is given, document.pdf. Returns (document.md, or document.json when md is not asked for;
    document.json)."""
    md_lines = [f"# {document['name']}", ""]
    for p in pages:
        stats = p.get("stats") or {}
        fast = " (fast mode)" if stats.get("mode") == "fast" else ""  # not token-exact: say so
        person = " (corrected by a person)" if stats.get("correction") else ""
        md_lines += [f"<!-- page {p['index']}{fast}{person} -->", "", page_markdown(p["text"]), ""]
        if p.get("note"):
            md_lines += [f"> note: {p['note']}", ""]
    md = folder / "document.md"
    js = folder / "document.json"
    if "md" in formats:
        write_atomic(md, "\n".join(md_lines).rstrip() + "\n")
    write_atomic(js, json.dumps({"document": document, "run": run, "pages": pages}, ensure_ascii=False, indent=1))
    from ingest.outputs.archival import write_archival_outputs

    write_archival_outputs(folder, document, run, pages, source, formats, js)
    return (md if "md" in formats else js), js
