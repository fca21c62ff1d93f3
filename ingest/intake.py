"""Take one complete file into the ledger: a document (with its chunks), a duplicate, or a rejected file put in
``failed/`` beside ``<name>.error.txt``. Idempotent by content SHA-256. Files from the inbox are moved; a file
named from elsewhere (``uflash run PATH``) is copied and stays where it is (`ingest.files.file_away`).

Content already in the ledger is not always a duplicate: dropped again after its document failed, it is that
document's retry; found under a new name while its document waits and the old name is gone, it is the same
file renamed; and a document's own file is never moved aside as a duplicate of itself."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from loguru import logger
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from db.models import Chunk, DocStatus, Document, Duplicate, Rejected
from db.queue import requeue_failed
from db.session import Database
from engine.chunking import ChunkPlan, plan_chunks
from ingest.config import Settings
from ingest.errors import InputIncomplete, InputRejected
from ingest.files import file_away, is_inside, move_file, sha256_file, unique_destination, write_atomic
from ingest.probe import Probed, probe_file

CHARS_PER_TOKEN = 2.0  # rough: markup and boxes add tokens beyond the plain characters
TOKENS_PER_ELEMENT_OVERHEAD = 64


@dataclass(frozen=True)
class IntakeResult:
    outcome: str  # document | duplicate | rejected | known | moved | requeued | incomplete
    document_id: int | None = None
    reason: str | None = None
    moved_to: Path | None = None


def chunk_plan(settings: Settings) -> ChunkPlan:
    e = settings.engine
    return ChunkPlan(context_limit=e.context_limit, margin=e.context_margin, max_pages=e.max_pages_per_chunk)


def expected_tokens(probed: Probed, default_per_page: int) -> list[int]:
    """Output estimate per page: from the text layer when it has text, else the configured default."""
    if not probed.text_chars:
        return [default_per_page] * probed.page_count
    return [
        int(c / CHARS_PER_TOKEN) + TOKENS_PER_ELEMENT_OVERHEAD if c > 20 else default_per_page
        for c in probed.text_chars
    ]


def known_document(db: Database, path: Path, size: int, mtime_ns: int) -> int | None:
    """The id of the document this very file (path, size, mtime) already is, while it waits in place."""
    with db.session() as s:
        return s.scalar(
            select(Document.id).where(
                Document.original_path == str(path),
                Document.size_bytes == size,
                Document.mtime_ns == mtime_ns,
                Document.archived_path.is_(None),
            )
        )


def reject(db: Database, settings: Settings, path: Path, reason: str, sha: str | None = None) -> IntakeResult:
    size = path.stat().st_size if path.exists() else 0
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    row = Rejected(path=str(path), name=path.name, sha256=sha, size_bytes=size, reason=reason)
    note = f"file: {path}\nrejected: {stamp}\nreason: {reason}\nsha256: {sha or '-'}\n"
    dest = _record_and_place(db, row, path, lambda: file_away(path, settings.failed, settings.inbox), note)
    logger.warning("rejected {}: {} -> {}", path.name, reason, dest)
    return IntakeResult("rejected", reason=reason, moved_to=dest)


def _record_and_place(db: Database, row: Rejected | Duplicate, path: Path, place: Callable[[], Path | None],
                      note: str | None = None) -> Path | None:
    """Record ``row`` in the ledger, put the file where it goes (``place()``: moved from the inbox, or copied; with
    ``note`` written beside it as ``<name>.error.txt``), and commit with ``row.moved_to``, in one transaction. The
    ledger goes first: when it cannot take the record (unreachable, locked, full) the file stays where it is,
    untouched; when placing the file or the commit fails, the record is not kept and the file is put back."""
    with db.session() as s:
        s.begin()
        s.add(row)
        s.flush()
        dest, copied = None, False
        try:
            dest = place()
            copied = path.exists()  # a file named outside the inbox is copied, not moved
            if dest is not None and note is not None:
                write_atomic(dest.with_name(dest.name + ".error.txt"), note)
            row.moved_to = str(dest) if dest else None
            s.commit()
        except BaseException:
            with contextlib.suppress(Exception):
                s.rollback()
            _put_back(path, dest, copied)
            raise
        return dest


def _put_back(path: Path, dest: Path | None, copied: bool) -> None:
    """Undo ``_record_and_place``'s move (or copy) of ``path`` to ``dest`` and its error note, as far as possible."""
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


def _by_sha(db: Database, sha: str) -> Document | None:
    with db.session() as s:
        return s.scalar(select(Document).where(Document.sha256 == sha))


def _original(path: Path, st) -> dict:  # noqa: ANN001
    return dict(original_path=str(path), original_name=path.name, size_bytes=st.st_size, mtime_ns=st.st_mtime_ns)


def _existing(db: Database, settings: Settings, path: Path, st, doc: Document) -> IntakeResult:  # noqa: ANN001
    """Content that document ``doc`` already has: its retry (it failed), its new name (it waits and its file
    was renamed), its own file, or a duplicate."""
    if doc.status == DocStatus.FAILED:
        return _retry(db, settings, path, st, doc)
    waiting = doc.status in (DocStatus.QUEUED, DocStatus.RUNNING) and doc.archived_path is None
    if waiting and doc.original_path != str(path) and not Path(doc.original_path).exists():
        return _moved(db, settings, path, st, doc)
    return _duplicate(db, settings, path, st, doc)


def _retry(db: Database, settings: Settings, path: Path, st, doc: Document) -> IntakeResult:  # noqa: ANN001
    """A failed document's content dropped again: this file becomes its original (archived at the end like
    any other) and its failed chunks go back to the queue; its done pages are kept. The update holds only
    while the document is still failed, so two intakes of the same drop re-queue it once."""
    with db.engine.begin() as conn:
        res = conn.execute(update(Document.__table__)
                           .where(Document.id == doc.id, Document.status == DocStatus.FAILED)
                           .values(**_original(path, st), archived_path=None))
        n = requeue_failed(conn, doc.id) if res.rowcount == 1 else None
    if n is None:  # another intake re-queued it a moment ago
        return _duplicate(db, settings, path, st, _by_sha(db, doc.sha256))
    logger.info("re-queued failed document {} from {} ({} chunks; it had failed with: {})", doc.id, path.name, n,
                (doc.error or "-")[:300])
    return IntakeResult("requeued", document_id=doc.id)


def _moved(db: Database, settings: Settings, path: Path, st, doc: Document) -> IntakeResult:  # noqa: ANN001
    """A waiting document's file renamed (or moved) and its old path gone: the file at the new path is that
    document, left where it is. The update holds only if no other intake adopted another path first."""
    with db.engine.begin() as conn:
        res = conn.execute(update(Document.__table__)
                           .where(Document.id == doc.id, Document.original_path == doc.original_path,
                                  Document.archived_path.is_(None))
                           .values(**_original(path, st)))
    if res.rowcount != 1:
        return _duplicate(db, settings, path, st, _by_sha(db, doc.sha256))
    logger.info("document {} moved: {} -> {}", doc.id, doc.original_path, path)
    return IntakeResult("moved", document_id=doc.id)


def _duplicate(db: Database, settings: Settings, path: Path, st, doc: Document) -> IntakeResult:  # noqa: ANN001
    if doc.original_path == str(path) and doc.archived_path is None:
        # the document's own file (touched, or taken by two intakes at once): the only copy, never moved aside
        return IntakeResult("known", document_id=doc.id)
    # a duplicate from the inbox is moved aside; one named elsewhere stays there and is only recorded
    row = Duplicate(document_id=doc.id, path=str(path), name=path.name, size_bytes=st.st_size, mtime_ns=st.st_mtime_ns)
    dest = _record_and_place(db, row, path, lambda: move_file(path, settings.archive / "duplicates")
                             if is_inside(path, settings.inbox) else None)
    logger.info("duplicate {} of document {} -> {}", path.name, doc.id, dest or "left in place")
    return IntakeResult("duplicate", document_id=doc.id, moved_to=dest)


def intake_file(db: Database, settings: Settings, path: Path, incomplete_grace_s: float = 0.0,
                retry_failed: bool = False) -> IntakeResult:
    """Record a complete file. Bad input is rejected with its reason; the caller never sees InputRejected.
    A file that looks cut short (`InputIncomplete`) and changed less than ``incomplete_grace_s`` ago is left where
    it is (outcome ``incomplete``): the watcher looks again later, since a stalled copy may still finish it.
    retry_failed: the very file of a failed document (unchanged, still in place) is re-queued too, as when its
    content is dropped again (``uflash run PATH`` names it on purpose; a rescan of the inbox does not retry it)."""
    path = Path(path).absolute()
    st = path.stat()
    if (doc_id := known_document(db, path, st.st_size, st.st_mtime_ns)) is not None:
        if retry_failed:
            with db.session() as s:
                doc = s.get(Document, doc_id)
            if doc is not None and doc.status == DocStatus.FAILED:
                return _retry(db, settings, path, st, doc)
        return IntakeResult("known", document_id=doc_id)
    sha = sha256_file(path)
    if (existing := _by_sha(db, sha)) is not None:
        return _existing(db, settings, path, st, existing)
    try:
        probed = probe_file(path, settings.watch.max_page_pixels)
    except InputIncomplete as e:
        if time.time() - st.st_mtime < incomplete_grace_s:
            return IntakeResult("incomplete", reason=e.reason)
        grace = f" (unchanged for {incomplete_grace_s:.0f} s)" if incomplete_grace_s else ""
        return reject(db, settings, path, e.reason + grace, sha)
    except InputRejected as e:
        return reject(db, settings, path, e.reason, sha)
    ranges = plan_chunks(expected_tokens(probed, settings.engine.default_tokens_per_page), chunk_plan(settings))
    try:
        with db.session() as s, s.begin():
            doc = Document(sha256=sha, original_path=str(path), original_name=path.name, size_bytes=st.st_size,
                           mtime_ns=st.st_mtime_ns, kind=probed.kind, page_count=probed.page_count)
            s.add(doc)
            s.flush()
            s.add_all(Chunk(document_id=doc.id, first_page=a, last_page=b) for a, b in ranges)
            doc_id = doc.id
    except IntegrityError:  # another intake process recorded the same content a moment ago (often this very file)
        return _existing(db, settings, path, st, _by_sha(db, sha))
    logger.info("queued {} ({} {}, {} pages, {} chunks) as document {}", path.name, probed.kind,
                _size(st.st_size), probed.page_count, len(ranges), doc_id)
    return IntakeResult("document", document_id=doc_id)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
