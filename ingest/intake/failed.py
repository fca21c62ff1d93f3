"""A failed document's original in failed/, beside ``<name>.error.txt`` with the reason (its last line the command that
retries it); and out of it again when the document is retried.

``file_failed`` is called wherever a worker may have made a document failed (a chunk failed, a chunk that killed its
worker alone on its last attempt, outputs that could not be written) and files away every failed document not filed
yet; ``retry_document`` (``uflash retry``) puts the original back where the worker reads it and queues the document
again; ``unfile`` clears failed/ when the document is queued again another way (its content dropped into the inbox
again: ingest.intake.enqueue).

Where the original goes: moved into failed/ when it lies in uflash's own folders (the inbox, or the archive: a document
that failed after it was finished, in a re-run), copied there when it is the user's file named outside them (``uflash
run PATH``: never moved). An original that is gone, that is no longer the document's content (another file took its
name), or that cannot be moved (access denied) stays where it is, and the log says so. The document records where its
original lies (``documents.failed_path``; empty when it is nowhere to be found): only one worker files it, and a
failed original found at its old path in the inbox again was dropped there again (a retry), not left there.
"""

from __future__ import annotations

import shutil
from datetime import datetime, timezone
from pathlib import Path

from loguru import logger

from db.documents import failed_unfiled, get_document, original_of, retry_failed, set_failed_path
from db.models import DocStatus, Document
from db.session import Database
from ingest.config import Settings
from ingest.errors import infrastructure_problem
from ingest.files import is_inside, sha256_file, uflash_command, unique_destination, write_atomic


def note_of(path: Path) -> Path:
    """The ``.error.txt`` beside a file in failed/."""
    return path.with_name(path.name + ".error.txt")


def _where_now(doc: Document) -> Path:
    """Where the document's original lies: archived (a finished document), else where it was taken in."""
    if doc.archived_path and Path(doc.archived_path).exists():
        return Path(doc.archived_path)
    return Path(doc.original_path)


def _is_its_content(doc: Document, path: Path) -> bool:
    st = path.stat()
    return (st.st_size, st.st_mtime_ns) == (doc.size_bytes, doc.mtime_ns) or sha256_file(path) == doc.sha256


def file_failed(settings: Settings, db: Database, doc_ids=None) -> list[Path]:  # noqa: ANN001
    """Put the original of every failed document (of ``doc_ids``, when given) not filed yet into failed/ beside its
    ``.error.txt``; returns where they went."""
    placed = []
    for doc in failed_unfiled(db, doc_ids):
        try:
            if (dest := _file(settings, db, doc)) is not None:
                placed.append(dest)
        except Exception as e:
            if infrastructure_problem(e):
                raise
            logger.error("{}: its original could not be put in {}: {}", doc.original_name, settings.failed, e)
    return placed


def _file(settings: Settings, db: Database, doc: Document) -> Path | None:
    src = _where_now(doc)
    why_not = None
    if not src.exists():
        why_not = f"its original is no longer at {src}"
    elif src == Path(doc.original_path) and not _is_its_content(doc, src):
        why_not = f"the file at {src} is no longer its content"
    if why_not is not None:  # recorded as nowhere: the file, found or dropped again, is its retry
        if set_failed_path(db, doc.id, "", only_if_unset=True):
            logger.error("{} failed: {}; nothing put in {} ({})", doc.original_name, doc.error, settings.failed,
                         why_not)
        return None
    dest = unique_destination(settings.failed, doc.original_name)
    if not set_failed_path(db, doc.id, dest, only_if_unset=True):
        return None  # another worker files it (or it was queued again meanwhile)
    moved = is_inside(src, settings.inbox) or is_inside(src, settings.archive)
    try:
        (shutil.move if moved else shutil.copy2)(str(src), str(dest))
    except OSError as e:
        set_failed_path(db, doc.id, src)
        if infrastructure_problem(e):
            raise
        logger.error("{} failed: {}; its original stays at {}: it could not be {} to {}: {}", doc.original_name,
                     doc.error, src, "moved" if moved else "copied", settings.failed, e)
        return None
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    retry = uflash_command(settings.config_file, "retry", "--doc", str(doc.id))
    write_atomic(note_of(dest), f"file: {src}\nfailed: {stamp}\nreason: {doc.error}\nsha256: {doc.sha256}\n"
                                f"document: {doc.id}\nretry: {retry}\n")
    logger.warning("{} failed: {} -> {}", doc.original_name, doc.error, dest)
    return dest


def unfile(settings: Settings, doc: Document, original: Path | None = None) -> None:
    """``doc`` (as it was while failed) is queued again with ``original`` as its original: its ``.error.txt`` goes,
    and so does what failed/ still holds of it when that is not its original now (a copy of the same content)."""
    if not doc.failed_path or not is_inside(Path(doc.failed_path), settings.failed):
        return
    kept = Path(doc.failed_path)
    try:
        note_of(kept).unlink(missing_ok=True)
        if original is not None and kept != original and kept.exists() and sha256_file(kept) == doc.sha256:
            kept.unlink()
    except OSError as e:  # the document is queued: what is left in failed/ is only untidy
        if infrastructure_problem(e):
            raise
        logger.warning("{}: could not clear {} of it: {}", doc.original_name, settings.failed, e)


def retry_document(settings: Settings, db: Database, doc_id: int, check_only: bool = False
                   ) -> tuple[Document, int | None, Path]:
    """``uflash retry``: put failed document ``doc_id``'s original back where the worker reads it (out of failed/)
    and queue the document again (its failed chunks with their attempts reset). Returns the document as it was, how
    many chunks were queued again (None: it was queued again meanwhile, e.g. by a drop into the inbox) and where its
    original is. Raises ``LookupError`` for an unknown id, ``ValueError`` for a document that is not failed
    (``check_only``: only that, changing nothing)."""
    doc = get_document(db, doc_id)
    if doc is None:
        raise LookupError(f"no document {doc_id} in the ledger")
    if doc.status != DocStatus.FAILED:
        raise ValueError(f"document {doc_id} ({doc.original_name}) is {doc.status.value}, not failed")
    if check_only:
        return doc, None, Path(doc.failed_path or doc.original_path)
    kept = Path(doc.failed_path) if doc.failed_path else None
    home = Path(doc.archived_path) if doc.archived_path else Path(doc.original_path)
    back, columns = home, None
    moved = kept is not None and kept != home and is_inside(kept, settings.failed) and kept.exists() \
        and not (home.exists() and _is_its_content(doc, home))  # moved into failed/ (not copied): back it goes
    if moved:  # where it came from (under its name, or another free one), or into the inbox (uflash's own folders)
        ours = home.parent.is_dir() and (is_inside(home, settings.inbox) or is_inside(home, settings.archive))
        folder = home.parent if ours else settings.archive if doc.archived_path else settings.inbox
        back = unique_destination(folder, home.name)
        shutil.move(str(kept), str(back))
        if not doc.archived_path:
            st = back.stat()
            columns = original_of(back, st.st_size, st.st_mtime_ns)
        elif back != home:
            columns = {"archived_path": str(back)}
    try:
        n = retry_failed(db, doc_id, columns)
    except BaseException:
        if moved:  # the ledger did not take it: the original goes back into failed/
            shutil.move(str(back), str(kept))
        raise
    unfile(settings, doc, back)
    return doc, n, back
