"""``uflash run PATH...``: take the named files (or the whole inbox) now, process them, report, exit."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from loguru import logger
from sqlalchemy import select
from tqdm import tqdm

from db.models import DocStatus, Document
from db.session import Database
from ingest.config import Settings
from ingest.errors import UsageError
from ingest.files import is_ignored_name
from ingest.intake import intake_file


def _expand(paths: list[Path], inbox: Path) -> list[Path]:
    if not paths:
        return sorted(p for p in inbox.iterdir() if p.is_file() and not is_ignored_name(p.name))
    out = []
    for p in paths:
        if p.is_dir():
            out += sorted(q for q in p.iterdir() if q.is_file() and not is_ignored_name(q.name))
        elif p.is_file():
            out.append(p)
        else:
            raise UsageError(f"no such file or folder: {p}")
    return out


def run_batch(settings: Settings, db: Database, paths: list[Path], make_worker: Callable,
              stop: threading.Event) -> int:
    files = _expand(paths, settings.inbox)
    if not files:
        print(f"nothing to do: no files given and the inbox {settings.inbox} is empty")
        return 0
    doc_ids: list[int] = []
    rejected: list[tuple[Path, str]] = []
    for f in files:
        res = intake_file(db, settings, f)
        if res.outcome == "rejected":
            rejected.append((f, res.reason or ""))
        elif res.document_id is not None and res.document_id not in doc_ids:
            doc_ids.append(res.document_id)

    def docs() -> list[Document]:
        with db.session() as s:
            return list(s.scalars(select(Document).where(Document.id.in_(doc_ids)).order_by(Document.id)))

    def finished() -> bool:
        return all(d.status in (DocStatus.DONE, DocStatus.FAILED) for d in docs())

    pending_pages = sum(d.page_count for d in docs() if d.status not in (DocStatus.DONE, DocStatus.FAILED))
    with tqdm(total=pending_pages, unit="page", desc="uflash run", dynamic_ncols=True) as bar:
        worker = make_worker(settings, db, on_pages=bar.update)
        worker.serve(stop, until=finished)
    code = 0
    for d in docs():
        if d.status == DocStatus.DONE:
            print(f"done    {d.original_name}: {d.page_count} pages -> {d.output_dir}")
        elif d.status == DocStatus.FAILED:
            print(f"failed  {d.original_name}: {d.error}")
            code = 4
        else:
            print(f"pending {d.original_name}: {d.status} (stopped before it finished)")
            code = code or 130
    for f, why in rejected:
        print(f"refused {f.name}: {why} (see {settings.failed})")
        code = 4
    if stop.is_set() and code == 0:
        code = 130
    logger.debug("run finished with exit code {}", code)
    return code
