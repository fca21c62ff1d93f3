"""What the ledger holds: counts by state, the documents waiting with their pages decoded so far, the pages left and
when they should be done at the open runs' pace, the open runs and who holds the running chunks (and until when;
whether that process is gone), the failures with their reasons, and (added by the CLI from ingest.health) the
trouble the watchers of this machine have with the ledger or the machine. It only reads: closing what a gone process
left is the next worker's job (ingest.worker)."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import func, select

from db.models import Chunk, ChunkStatus, DocStatus, Document, Duplicate, Page, Rejected, Run
from db.session import Database
from ingest.health import format_trouble
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
        runs = s.execute(select(Run.id, Run.mode, Run.owner, Run.started_at, Run.settings,
                                select(func.count(Page.id)).where(Page.run_id == Run.id).scalar_subquery())
                         .where(Run.finished_at.is_(None)).order_by(Run.id)).all()
        pending = (ChunkStatus.QUEUED, ChunkStatus.RUNNING)
        pages_left = s.scalar(select(func.coalesce(func.sum(Chunk.last_page - Chunk.first_page + 1), 0))
                              .where(Chunk.status.in_(pending)))
        waiting = s.execute(
            select(Document.id, Document.original_name, Document.status, Document.page_count,
                   select(func.count(func.distinct(Page.page_index))).where(Page.document_id == Document.id)
                   .scalar_subquery())
            .where(Document.status.in_([DocStatus.QUEUED, DocStatus.RUNNING])).order_by(Document.id).limit(limit)
        ).all()
        retrying = s.execute(
            select(Chunk.id, Chunk.document_id, Chunk.first_page, Chunk.last_page, Chunk.attempts, Chunk.last_error)
            .where(Chunk.status == "queued", Chunk.last_error.is_not(None)).order_by(Chunk.id).limit(limit)
        ).all()
    open_runs = _open_runs(runs, datetime.now(timezone.utc))
    rate = sum(r["pages_per_hour"] or 0 for r in open_runs)
    return {
        "documents": {"total": sum(docs.values()), **docs},
        "chunks": {"total": sum(chunks.values()), **chunks},
        "pages": int(pages or 0),
        "duplicates": n_dup,
        "rejected": n_rej,
        "failed_documents": [{"id": i, "name": n, "error": e} for i, n, e in failed_docs],
        "rejected_files": [{"name": n, "reason": r, "moved_to": m} for n, r, m in rejected],
        "leases": [{"owner": o, "chunks": n, "until": u, "owner_gone": is_gone(o)} for o, n, u in leases],
        "open_runs": open_runs,
        "waiting_documents": [{"id": i, "name": n, "status": st, "pages_decoded": done, "page_count": total}
                              for i, n, st, total, done in waiting],
        "pages_left": int(pages_left or 0),
        "eta_seconds": round(int(pages_left or 0) / rate * 3600) if rate and pages_left else None,
        "retrying_chunks": [
            {"id": i, "document_id": d, "pages": f"{a}-{b}", "attempts": t, "last_error": e}
            for i, d, a, b, t, e in retrying
        ],
    }


def _open_runs(rows: list, now: datetime) -> list[dict[str, Any]]:
    """The open runs, each with its pages so far and its pace (pages an hour since it opened; None before it stored
    a page, or when its process is gone)."""
    out = []
    for i, mode, owner, started, settings, pages in rows:
        gone = is_gone(owner)
        if started is not None and started.tzinfo is None:  # SQLite keeps UTC without the zone
            started = started.replace(tzinfo=timezone.utc)
        hours = (now - started).total_seconds() / 3600 if started else 0.0
        out.append({"id": i, "mode": mode, "owner": owner, "started_at": started.isoformat() if started else None,
                    "rerun": "rerun_of" in (settings or {}), "owner_gone": gone, "pages": pages,
                    "pages_per_hour": round(pages / hours, 1) if pages and hours > 0 and not gone else None})
    return out


def format_status(st: dict[str, Any]) -> str:
    def counts(d: dict[str, int]) -> str:
        return ", ".join(f"{k} {v}" for k, v in d.items() if k != "total") or "none"

    lines = [
        f"documents: {st['documents']['total']} ({counts(st['documents'])}), {st['pages']} pages",
        f"chunks:    {st['chunks']['total']} ({counts(st['chunks'])})",
        f"duplicates: {st['duplicates']}   rejected files: {st['rejected']}",
        *format_trouble(st.get("infrastructure") or []),  # the watchers' trouble with the ledger or the machine
    ]
    for d in st["waiting_documents"]:
        lines.append(f"waiting:   #{d['id']} {d['name']}: {d['pages_decoded']}/{d['page_count']} pages decoded "
                     f"({d['status']})")
    waiting = st["documents"].get("queued", 0) + st["documents"].get("running", 0)
    if (more := waiting - len(st["waiting_documents"])) > 0:
        lines.append(f"waiting:   ... and {more} more (--limit)")
    if st["pages_left"]:
        eta = st["eta_seconds"]
        lines.append(f"left:      {st['pages_left']} pages to decode" + (
            f", about {_duration(eta)} at the open runs' pace" if eta is not None else
            " (no pace yet: no running uflash has stored a page)"))
    now = time.time()
    for r in st["open_runs"]:
        what = "re-run" if r["rerun"] else "run"
        gone = " (its process is gone: the next worker closes it as crashed)" if r["owner_gone"] else ""
        pace = f", {r['pages']} pages" + (f" ({r['pages_per_hour']:g} an hour)" if r["pages_per_hour"] else "")
        lines.append(f"open:      {what} {r['id']} ({r['mode']}) of {r['owner']} since {r['started_at'][:19]}{pace}"
                     f"{gone}")
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


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return "under a minute" if minutes < 1 else f"{minutes} min" if minutes < 90 else f"{minutes / 60:.1f} h"
