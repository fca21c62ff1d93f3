"""Take one complete file into the ledger: a document (with its chunks), a duplicate, or a rejected file put in
``failed/`` beside ``<name>.error.txt`` (whose last line is the command that retries it). Idempotent by content
SHA-256. Files from the inbox are moved; a file named from elsewhere (``uflash run PATH``) is copied and stays where
it is (`ingest.files.file_away`). A duplicate or a rejected file is recorded with the run that took it in (``run``:
the command's or the watcher's, ingest.worker.lifecycle.RunHandle), whose report names it.

Content already in the ledger is not always a duplicate: dropped again after its document failed, it is that
document's retry; found under a new name while its document waits and the old name is gone, it is the same
file renamed; and a document's own file is never moved aside as a duplicate of itself."""

from __future__ import annotations

import shutil
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from loguru import logger

from db.documents import (
    adopt_path,
    create_document,
    document_by_sha,
    document_of_file,
    get_document,
    original_of,
    retry_failed,
)
from db.files import record_duplicate, record_rejected
from db.models import DocStatus, Document
from db.session import Database
from ingest.config import Settings
from ingest.errors import InputIncomplete, InputRejected
from ingest.files import (
    file_away,
    is_inside,
    move_file,
    sha256_file,
    uflash_command,
    unique_destination,
    write_atomic,
)
from ingest.intake.chunk_plan import (
    UNLIMITED_OCR_TOKENS_PER_PAGE,
    ChunkBudget,
    expected_tokens,
    model_tokens_per_page,
    plan_document_chunks,
)
from ingest.intake.failed import unfile
from ingest.intake.probe import probe_file
from ingest.logs import counted


class Intake(StrEnum):
    DOCUMENT = "document"  # a new document, queued
    DUPLICATE = "duplicate"  # the content of a document already recorded
    REJECTED = "rejected"  # cannot be processed: moved to failed/ with its reason
    KNOWN = "known"  # this very file is a document already
    MOVED = "moved"  # a waiting document's file, renamed or moved
    REQUEUED = "requeued"  # a failed document's content again: it is retried
    INCOMPLETE = "incomplete"  # looks cut short: left in the inbox, looked at again later


class IntakeRun(Protocol):
    """The run a file taken in belongs to (ingest.worker.lifecycle.RunHandle)."""

    def taking_in(self) -> AbstractContextManager[int]:
        """The run's id, the run opened if need be and held open while the file is recorded."""


def _taking_in(run: IntakeRun | None) -> AbstractContextManager[int | None]:
    return run.taking_in() if run is not None else nullcontext(None)


@dataclass(frozen=True)
class IntakeResult:
    outcome: Intake
    document_id: int | None = None
    reason: str | None = None
    moved_to: Path | None = None


def chunk_budget(settings: Settings) -> ChunkBudget:
    """How many pages a chunk can take: the context and the configured model's vision tokens a page."""
    e = settings.engine
    per_page = model_tokens_per_page(settings.model_path) or UNLIMITED_OCR_TOKENS_PER_PAGE
    return ChunkBudget(tokens_per_page=per_page, context_limit=e.context_limit, margin=e.context_margin,
                       max_pages=e.max_pages_per_chunk)


def reject(db: Database, settings: Settings, path: Path, reason: str, sha: str | None = None,
           run: IntakeRun | None = None) -> IntakeResult:
    """Record the file as rejected with ``reason`` (in ``run``) and put it in failed/ beside ``<name>.error.txt``, which
    ends with the command that puts it back into the inbox (ingest.intake.refused)."""
    size = path.stat().st_size if path.exists() else 0
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    note = f"file: {path}\nrejected: {stamp}\nreason: {reason}\nsha256: {sha or '-'}\n"
    copied = []

    def place() -> Path | None:
        dest = file_away(path, settings.failed, settings.inbox)
        copied.append(path.exists())  # a file named outside the inbox is copied, not moved
        if dest is not None:
            retry = uflash_command(settings.config_file, "retry", "--file", dest)
            write_atomic(dest.with_name(dest.name + ".error.txt"), f"{note}retry: {retry}\n")
        return dest

    with _taking_in(run) as run_id:
        dest = record_rejected(db, place, lambda dest: _put_back(path, dest, bool(copied and copied[0])),
                               path=str(path), name=path.name, sha256=sha, size_bytes=size, reason=reason,
                               run_id=run_id)
    logger.warning("rejected {}: {} -> {}", path.name, reason, dest)
    return IntakeResult(Intake.REJECTED, reason=reason, moved_to=dest)


def _put_back(path: Path, dest: Path | None, copied: bool) -> None:
    """Undo the move (or copy) of ``path`` to ``dest`` and its error note, as far as possible."""
    if dest is None:
        return
    try:
        dest.with_name(dest.name + ".error.txt").unlink(missing_ok=True)
        if copied:
            dest.unlink(missing_ok=True)
        else:  # under its own name, or another if a new file took that name meanwhile
            shutil.move(str(dest), str(unique_destination(path.parent, path.name)))
    except OSError as e:
        logger.error("could not put {} back from {}: {}", path, dest, e)


def _original(path: Path, st) -> dict:  # noqa: ANN001
    return original_of(path, st.st_size, st.st_mtime_ns)


def _existing(db: Database, settings: Settings, path: Path, st, doc: Document,  # noqa: ANN001
              run: IntakeRun | None) -> IntakeResult:
    """Content that document ``doc`` already has: its retry (it failed), its new name (it waits and its file
    was renamed), its own file, or a duplicate."""
    if doc.status == DocStatus.FAILED:
        return _retry(db, settings, path, st, doc, run)
    waiting = doc.status in (DocStatus.QUEUED, DocStatus.RUNNING) and doc.archived_path is None
    if waiting and doc.original_path != str(path) and not Path(doc.original_path).exists():
        return _moved(db, settings, path, st, doc, run)
    return _duplicate(db, settings, path, st, doc, run)


def _retry(db: Database, settings: Settings, path: Path, st, doc: Document,  # noqa: ANN001
           run: IntakeRun | None) -> IntakeResult:
    """A failed document's content dropped again: this file becomes its original (archived at the end like
    any other) and its failed chunks go back to the queue; its done pages are kept, and failed/ no longer holds it
    (ingest.intake.failed). The update holds only while the document is still failed, so two intakes of the same
    drop re-queue it once."""
    n = retry_failed(db, doc.id, _original(path, st))
    if n is None:  # another intake re-queued it a moment ago
        return _duplicate(db, settings, path, st, document_by_sha(db, doc.sha256), run)
    unfile(settings, doc, path)
    logger.info("re-queued failed document {} from {} ({} chunks; it had failed with: {})", doc.id, path.name, n,
                (doc.error or "-")[:300])
    return IntakeResult(Intake.REQUEUED, document_id=doc.id)


def _moved(db: Database, settings: Settings, path: Path, st, doc: Document,  # noqa: ANN001
           run: IntakeRun | None) -> IntakeResult:
    """A waiting document's file renamed (or moved) and its old path gone: the file at the new path is that
    document, left where it is. The update holds only if no other intake adopted another path first."""
    if not adopt_path(db, doc, _original(path, st)):
        return _duplicate(db, settings, path, st, document_by_sha(db, doc.sha256), run)
    logger.info("document {} moved: {} -> {}", doc.id, doc.original_path, path)
    return IntakeResult(Intake.MOVED, document_id=doc.id)


def _duplicate(db: Database, settings: Settings, path: Path, st, doc: Document,  # noqa: ANN001
               run: IntakeRun | None) -> IntakeResult:
    if doc.original_path == str(path) and doc.archived_path is None:
        # the document's own file (touched, or taken by two intakes at once): the only copy, never moved aside
        return IntakeResult(Intake.KNOWN, document_id=doc.id)
    # a duplicate from the inbox is moved aside; one named elsewhere stays there and is only recorded
    with _taking_in(run) as run_id:
        dest = record_duplicate(db, lambda: move_file(path, settings.archive / "duplicates")
                                if is_inside(path, settings.inbox) else None, lambda dest: _put_back(path, dest, False),
                                document_id=doc.id, path=str(path), name=path.name, size_bytes=st.st_size,
                                mtime_ns=st.st_mtime_ns, run_id=run_id)
    logger.info("duplicate {} of document {} -> {}", path.name, doc.id, dest or "left in place")
    return IntakeResult(Intake.DUPLICATE, document_id=doc.id, moved_to=dest)


def intake_file(db: Database, settings: Settings, path: Path, incomplete_grace_s: float = 0.0,
                retry_failed: bool = False, run: IntakeRun | None = None) -> IntakeResult:
    """Record a complete file. Bad input is rejected with its reason; the caller never sees InputRejected.
    A file that looks cut short (`InputIncomplete`) and changed less than ``incomplete_grace_s`` ago is left where
    it is (outcome ``incomplete``): the watcher looks again later, since a stalled copy may still finish it.
    retry_failed: the very file of a failed document (unchanged, still in place) is re-queued too, as when its
    content is dropped again (``uflash run PATH`` names it on purpose; a rescan of the inbox does not retry it).
    run: the run a duplicate or a rejected file is recorded in (None: none)."""
    path = Path(path).absolute()
    st = path.stat()
    if (doc_id := document_of_file(db, path, st.st_size, st.st_mtime_ns)) is not None:
        if retry_failed:
            doc = get_document(db, doc_id)
            if doc is not None and doc.status == DocStatus.FAILED:
                return _retry(db, settings, path, st, doc, run)
        return IntakeResult(Intake.KNOWN, document_id=doc_id)
    sha = sha256_file(path)
    if (existing := document_by_sha(db, sha)) is not None:
        return _existing(db, settings, path, st, existing, run)
    try:
        probed = probe_file(path, settings.watch.max_page_pixels)
    except InputIncomplete as e:
        if time.time() - st.st_mtime < incomplete_grace_s:
            return IntakeResult(Intake.INCOMPLETE, reason=e.reason)
        grace = f" (unchanged for {incomplete_grace_s:.0f} s)" if incomplete_grace_s else ""
        return reject(db, settings, path, e.reason + grace, sha, run)
    except InputRejected as e:
        return reject(db, settings, path, e.reason, sha, run)
    expected = expected_tokens(probed.text_chars, probed.page_count, settings.engine.default_tokens_per_page)
    ranges = plan_document_chunks(expected, chunk_budget(settings))
    doc_id = create_document(db, _original(path, st), sha, probed.kind, probed.page_count, ranges)
    if doc_id is None:  # another intake process recorded the same content a moment ago (often this very file)
        return _existing(db, settings, path, st, document_by_sha(db, sha), run)
    logger.info("queued {} ({} {}, {}, {}) as document {}", path.name, probed.kind, _size(st.st_size),
                counted(probed.page_count, "page"), counted(len(ranges), "chunk"), doc_id)
    return IntakeResult(Intake.DOCUMENT, document_id=doc_id)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
