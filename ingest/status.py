"""What the ledger holds: counts by state, the open runs and who holds the running chunks (and until when; whether
that process is gone), and the failures with their reasons. It only reads: closing what a gone process left
is the next worker's job (ingest.worker)."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from sqlalchemy import func, select

from db.models import Chunk, Document, Duplicate, Rejected, Run
from db.session import Database
from ingest.owners import is_gone


def collect_status(db: Database, limit: int = 20) -> dict[str, Any]:
    with db.session() as s:
        docs = dict(s.execute(select(Document.status, func.count()).group_by(Document.status)).all())
        chunks = dict(s.execute(select(Chunk.status, func.count()).group_by(Chunk.status)).all())
        pages = s.scalar(select(func.coalesce(func.sum(Document.page_count), 0)))
        n_dup = s.scalar(select(func.count()).select_from(Duplicate))
        n_rej = s.scalar(select(func.count()).select_from(Rejected))
        failed_docs = s.execute(
            select(Document.id, Document.original_name, Document.error)
            .where(Document.status == "failed").order_by(Document.id.desc()).limit(limit)
        ).all()
        rejected = s.execute(
            select(Rejected.name, Rejected.reason, Rejected.moved_to).order_by(Rejected.id.desc()).limit(limit)
        ).all()
        leases = s.execute(
            select(Chunk.lease_owner, func.count(), func.max(Chunk.lease_expires_at))
            .where(Chunk.status == "running").group_by(Chunk.lease_owner).order_by(Chunk.lease_owner)
        ).all()
        runs = s.execute(select(Run.id, Run.mode, Run.owner, Run.started_at, Run.settings)
                         .where(Run.finished_at.is_(None)).order_by(Run.id)).all()
        retrying = s.execute(
            select(Chunk.id, Chunk.document_id, Chunk.first_page, Chunk.last_page, Chunk.attempts, Chunk.last_error)
            .where(Chunk.status == "queued", Chunk.last_error.is_not(None)).order_by(Chunk.id).limit(limit)
        ).all()
    return {
        "documents": {"total": sum(docs.values()), **docs},
        "chunks": {"total": sum(chunks.values()), **chunks},
        "pages": int(pages or 0),
        "duplicates": n_dup,
        "rejected": n_rej,
        "failed_documents": [{"id": i, "name": n, "error": e} for i, n, e in failed_docs],
        "rejected_files": [{"name": n, "reason": r, "moved_to": m} for n, r, m in rejected],
        "leases": [{"owner": o, "chunks": n, "until": u, "owner_gone": is_gone(o)} for o, n, u in leases],
        "open_runs": [{"id": i, "mode": m, "owner": o, "started_at": t.isoformat() if t else None,
                       "rerun": "rerun_of" in (st or {}), "owner_gone": is_gone(o)} for i, m, o, t, st in runs],
        "retrying_chunks": [
            {"id": i, "document_id": d, "pages": f"{a}-{b}", "attempts": t, "last_error": e}
            for i, d, a, b, t, e in retrying
        ],
    }


def format_status(st: dict[str, Any]) -> str:
    def counts(d: dict[str, int]) -> str:
        return ", ".join(f"{k} {v}" for k, v in d.items() if k != "total") or "none"

    lines = [
        f"documents: {st['documents']['total']} ({counts(st['documents'])}), {st['pages']} pages",
        f"chunks:    {st['chunks']['total']} ({counts(st['chunks'])})",
        f"duplicates: {st['duplicates']}   rejected files: {st['rejected']}",
    ]
    now = time.time()
    for r in st["open_runs"]:
        what = "re-run" if r["rerun"] else "run"
        gone = " (its process is gone: the next worker closes it as crashed)" if r["owner_gone"] else ""
        lines.append(f"open:      {what} {r['id']} ({r['mode']}) of {r['owner']} since {r['started_at']}{gone}")
    for lease in st["leases"]:
        until = datetime.fromtimestamp(lease["until"]).strftime("%Y-%m-%d %H:%M:%S") if lease["until"] else "?"
        dead = " (its worker is gone: the next worker takes it over at once)" if lease["owner_gone"] else \
            " (expired: its worker stopped; the next worker takes it over)" if (lease["until"] or 0) < now else ""
        lines.append(f"running:   {lease['chunks']} chunk(s) leased by {lease['owner']} until {until}{dead}")
    if st["failed_documents"]:
        lines.append("failed documents:")
        lines += [f"  #{d['id']} {d['name']}: {d['error']}" for d in st["failed_documents"]]
    if st["retrying_chunks"]:
        lines.append("chunks waiting, with their last error:")
        lines += [f"  chunk {c['id']} (doc {c['document_id']}, pages {c['pages']}, attempt {c['attempts']}): "
                  f"{c['last_error']}" for c in st["retrying_chunks"]]
    if st["rejected_files"]:
        lines.append("rejected files (moved to the failed folder):")
        lines += [f"  {r['name']}: {r['reason']}" for r in st["rejected_files"]]
    return "\n".join(lines)
