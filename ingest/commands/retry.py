"""``uflash retry``: failed documents queued again (ingest.intake.failed) and refused files put back into the inbox
(ingest.intake.refused), one line each. ``--file PATH`` names what lies in failed/: a refused file, or a failed
document's original; ``--all`` takes every failed document and every refused file still in failed/. Everything named is
checked before anything is touched: one that cannot be retried is a usage error, and nothing is retried."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from db.documents import failed_document_at, failed_documents
from db.models import Rejected
from db.session import Database
from ingest.config import Settings
from ingest.errors import UsageError
from ingest.intake.failed import retry_document
from ingest.intake.refused import refused_at, refused_in_failed, retry_refused

UNKNOWN = "nothing retried (`uflash status` lists the failed documents and the refused files)"


@dataclass
class Retries:
    documents: list[int] = field(default_factory=list)
    refused: list[Rejected] = field(default_factory=list)


def what_to_retry(settings: Settings, db: Database, doc_ids: list[int] | None, files: list[str] | None,
                  everything: bool) -> Retries:
    """The documents and refused files named (``everything``: all of them), each checked; raises ``UsageError``."""
    if everything:
        return Retries(failed_documents(db), refused_in_failed(settings, db))
    todo = Retries(list(doc_ids or []))
    for name in files or []:
        path = Path(name).expanduser()
        if (rejected := refused_at(db, path)) is not None:
            if not path.is_file():
                raise UsageError(f"{path}: refused ({rejected.reason}), but no longer there: {UNKNOWN}")
            todo.refused.append(rejected)
        elif (doc_id := failed_document_at(db, [str(path), str(path.absolute()), str(path.resolve())])) is not None:
            todo.documents.append(doc_id)
        else:
            raise UsageError(f"{path} is neither a refused file nor a failed document's original: {UNKNOWN}")
    for doc_id in todo.documents:
        try:
            retry_document(settings, db, doc_id, check_only=True)
        except (LookupError, ValueError) as e:
            raise UsageError(f"{e.args[0]}: {UNKNOWN}") from None
    return todo


def retry(settings: Settings, db: Database, todo: Retries) -> list[str]:
    """Retry them; one line each."""
    lines = []
    for doc_id in todo.documents:
        doc, n, original = retry_document(settings, db, doc_id)
        if n is None:
            lines.append(f"queued  #{doc_id} {doc.original_name}: queued again meanwhile (dropped into the inbox "
                         "again?)")
        else:
            lines.append(f"queued  #{doc_id} {doc.original_name}: {n} chunk(s) again, its original at {original} (it "
                         f"had failed with: {(doc.error or '-')[:300]})")
    for rejected in todo.refused:
        back = retry_refused(settings, db, rejected)
        lines.append(f"back    {rejected.name}: in the inbox as {back}, to be taken in again (it was refused: "
                     f"{rejected.reason})" if back is not None else
                     f"back    {rejected.name}: put back into the inbox meanwhile (by another `uflash retry`)")
    return lines
