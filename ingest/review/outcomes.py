"""What became of each file, in words: done (its pages, its outputs, where its original was archived), failed (why,
where its original is), waiting, a duplicate of document N (nothing decoded; where it went) or refused (why, where it
is). One sentence per file, the same on ``uflash run``'s output, in ``uflash report`` (text and JSON), on the review
page and in ``uflash status``.

A run's files (``run_outcomes``) are its documents, then the files it took in that became no document of their own:
the duplicates and the refused files recorded with it (db.files)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from db.documents import documents
from db.files import files_of_run
from db.models import DocStatus, Document, Duplicate, Rejected
from db.session import Database
from ingest.logs import counted

DONE, FAILED, WAITING, DUPLICATE, REFUSED = "done", "failed", "waiting", "duplicate", "refused"


def document_outcome(doc: Document) -> dict[str, Any]:
    """A document as it is now: done, failed or waiting."""
    name = doc.original_name
    if doc.status == DocStatus.DONE:
        archived = f"original archived as {doc.archived_path}" if doc.archived_path else doc.error or "not archived"
        return {"outcome": DONE, "name": name, "document_id": doc.id, "pages": doc.page_count,
                "output_dir": doc.output_dir, "original": doc.archived_path,
                "words": f"{name}: {counted(doc.page_count, 'page')} -> {doc.output_dir}; {archived}"}
    if doc.status == DocStatus.FAILED:
        where = doc.failed_path if doc.failed_path is not None else doc.archived_path or doc.original_path
        return {"outcome": FAILED, "name": name, "document_id": doc.id, "reason": doc.error, "original": where or None,
                "words": f"{name}: {doc.error}; its original: {where or 'not found where it was taken in'}"}
    where = doc.archived_path or doc.original_path
    return {"outcome": WAITING, "name": name, "document_id": doc.id, "pages": doc.page_count, "original": where,
            "words": f"{name}: {doc.status.value}, not finished ({counted(doc.page_count, 'page')}); "
                     f"its original: {where}"}


def duplicate_outcome(dup: Duplicate, doc: Document) -> dict[str, Any]:
    """A file with the content of document ``doc``: recorded, nothing decoded."""
    where = f"moved to {dup.moved_to}" if dup.moved_to else f"left at {dup.path}"
    return {"outcome": DUPLICATE, "name": dup.name, "document_id": doc.id, "original": dup.moved_to or dup.path,
            "words": f"{dup.name}: the same content as document {doc.id} ({doc.original_name}), nothing decoded; "
                     f"{where}"}


def refused_outcome(rej: Rejected) -> dict[str, Any]:
    """A file that cannot be processed: its reason, and where it is (failed/, or the inbox again once retried)."""
    if rej.retried_at is not None:
        where = f"was in {rej.moved_to}, put back into the inbox by `uflash retry` {rej.retried_at:%Y-%m-%d %H:%M}"
    else:
        where = f"in {rej.moved_to}" if rej.moved_to else "left where it was"
    return {"outcome": REFUSED, "name": rej.name, "document_id": None, "reason": rej.reason,
            "original": None if rej.retried_at is not None else rej.moved_to,
            "retried": rej.retried_at is not None, "words": f"{rej.name}: {rej.reason}; {where}"}


def run_outcomes(db: Database, run_id: int | None, doc_ids: Collection[int] = ()) -> list[dict[str, Any]]:
    """Every file run ``run_id`` touched, each once: documents ``doc_ids`` (the run's: those it took or stored pages
    of), by id, then the duplicates and the refused files it took in."""
    out = [document_outcome(d) for d in documents(db, doc_ids)] if doc_ids else []
    if run_id is not None:
        rejected, duplicates = files_of_run(db, run_id)
        out += [duplicate_outcome(dup, doc) for dup, doc in duplicates]
        out += [refused_outcome(r) for r in rejected]
    return out


def outcome_line(outcome: dict[str, Any]) -> str:
    """``done    NAME: ...``: the outcome, then its words."""
    return f"{outcome['outcome']:<7} {outcome['words']}"
