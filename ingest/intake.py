"""Take one complete file into the ledger: a document (with its chunks), a duplicate, or a rejected file put in
``failed/`` beside ``<name>.error.txt``. Idempotent by content SHA-256. Files from the inbox are moved; a file
named from elsewhere (``uflash run PATH``) is copied and stays where it is (`ingest.files.file_away`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from loguru import logger
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from db.models import Chunk, Document, Duplicate, Rejected
from db.session import Database
from engine.chunking import ChunkPlan, plan_chunks
from ingest.config import Settings
from ingest.errors import InputRejected
from ingest.files import file_away, is_inside, move_file, sha256_file, write_atomic
from ingest.probe import Probed, probe_file

CHARS_PER_TOKEN = 2.0  # rough: markup and boxes add tokens beyond the plain characters
TOKENS_PER_ELEMENT_OVERHEAD = 64


@dataclass(frozen=True)
class IntakeResult:
    outcome: str  # document | duplicate | rejected | known
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
    dest = file_away(path, settings.failed, settings.inbox)
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    write_atomic(dest.with_name(dest.name + ".error.txt"),
                 f"file: {path}\nrejected: {stamp}\nreason: {reason}\nsha256: {sha or '-'}\n")
    with db.session() as s, s.begin():
        s.add(Rejected(path=str(path), name=path.name, sha256=sha, size_bytes=size, reason=reason, moved_to=str(dest)))
    logger.warning("rejected {}: {} -> {}", path.name, reason, dest)
    return IntakeResult("rejected", reason=reason, moved_to=dest)


def _duplicate(db: Database, settings: Settings, path: Path, st, doc_id: int) -> IntakeResult:  # noqa: ANN001
    # a duplicate from the inbox is moved aside; one named elsewhere stays there and is only recorded
    dest = move_file(path, settings.archive / "duplicates") if is_inside(path, settings.inbox) else None
    with db.session() as s, s.begin():
        s.add(Duplicate(document_id=doc_id, path=str(path), name=path.name, size_bytes=st.st_size,
                        mtime_ns=st.st_mtime_ns, moved_to=str(dest) if dest else None))
    logger.info("duplicate {} of document {} -> {}", path.name, doc_id, dest or "left in place")
    return IntakeResult("duplicate", document_id=doc_id, moved_to=dest)


def intake_file(db: Database, settings: Settings, path: Path) -> IntakeResult:
    """Record a complete file. Bad input is rejected with its reason; the caller never sees InputRejected."""
    path = Path(path).absolute()
    st = path.stat()
    if (doc_id := known_document(db, path, st.st_size, st.st_mtime_ns)) is not None:
        return IntakeResult("known", document_id=doc_id)
    sha = sha256_file(path)
    with db.session() as s:
        existing = s.scalar(select(Document).where(Document.sha256 == sha))
    if existing is not None:
        if existing.original_path == str(path) and existing.archived_path is None:
            return IntakeResult("known", document_id=existing.id)  # same file, touched: nothing new
        return _duplicate(db, settings, path, st, existing.id)
    try:
        probed = probe_file(path, settings.watch.max_page_pixels)
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
    except IntegrityError:  # another intake process recorded the same content a moment ago
        with db.session() as s:
            doc_id = s.scalar(select(Document.id).where(Document.sha256 == sha))
        return _duplicate(db, settings, path, st, doc_id)
    logger.info("queued {} ({} {}, {} pages, {} chunks) as document {}", path.name, probed.kind,
                _size(st.st_size), probed.page_count, len(ranges), doc_id)
    return IntakeResult("document", document_id=doc_id)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
