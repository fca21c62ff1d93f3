"""A refused file out of failed/ and back into the inbox (``uflash retry --file PATH`` or ``--all``), to be taken in
again like any file dropped there: refused again, with its reason, only if it still cannot be processed. What lies in
failed/ under its stored name goes back, so a file mended there (decrypted, copied again whole) is taken as it is now.

It goes back under the name it was dropped with (or the next free one, ingest.files.free_name), its ``.error.txt``
goes, and the refusal is marked retried (db.files.return_rejected): it is no longer listed as lying in failed/, and
its run's report says where it went."""

from __future__ import annotations

import shutil
from pathlib import Path

from loguru import logger

from db.files import rejected_waiting, return_rejected
from db.models import Rejected
from db.session import Database
from ingest.config import Settings
from ingest.files import is_inside, move_file
from ingest.intake.failed import note_of


def refused_at(db: Database, path: Path) -> Rejected | None:
    """The refusal not retried yet whose file was put at ``path`` (as given, absolute, or resolved)."""
    found = rejected_waiting(db, sorted({str(path), str(path.absolute()), str(path.resolve())}))
    return found[-1] if found else None


def refused_in_failed(settings: Settings, db: Database) -> list[Rejected]:
    """The refusals not retried yet whose file is still in failed/, by id."""
    return [r for r in rejected_waiting(db)
            if r.moved_to and is_inside(Path(r.moved_to), settings.failed) and Path(r.moved_to).exists()]


def retry_refused(settings: Settings, db: Database, rejected: Rejected) -> Path | None:
    """Put the refused file back into the inbox; returns where it is now (None: another ``uflash retry`` put it back a
    moment ago). Raises ``FileNotFoundError`` when it is no longer where it was put."""
    kept = Path(rejected.moved_to or "")
    if not rejected.moved_to or not kept.is_file():
        raise FileNotFoundError(f"{rejected.name}: no file at {kept} any more")
    back = return_rejected(db, rejected.id, lambda: move_file(kept, settings.inbox, rejected.name),
                           lambda dest: shutil.move(str(dest), str(kept)))
    if back is not None:
        note_of(kept).unlink(missing_ok=True)
        logger.info("{} put back into the inbox as {} (refused before: {})", rejected.name, back, rejected.reason)
    return back
