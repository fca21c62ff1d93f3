"""What the ledger holds: counts by state, the documents waiting with their pages decoded so far, the pages left and
when they should be done at the open runs' pace, the open runs and who holds the running chunks (and until when;
whether that process is gone), the failures with their reasons, and (added by the CLI from ingest.ledger.health) the
trouble the watchers of this machine have with the ledger or the machine. Every file it lists says where its original
is now: in the inbox (waiting), the archive (the latest done), failed/ under the name it is stored as (failed, refused)
or archive/duplicates (the latest duplicates), in the words of ingest.review.outcomes. It only reads: closing what a
gone process left is the next worker's job (ingest.worker.worker)."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from db.models import DocStatus
from db.overview import ledger_counts
from db.session import Database
from ingest.ledger.health import format_trouble
from ingest.ledger.owners import is_gone
from ingest.review.outcomes import document_outcome, duplicate_outcome, outcome_line, refused_outcome


def collect_status(db: Database, limit: int = 20) -> dict[str, Any]:
    c = ledger_counts(db, limit)
    open_runs = _open_runs(c["open_runs"], datetime.now(timezone.utc))
    rate = sum(r["pages_per_hour"] or 0 for r in open_runs)
    pages_left = c["pages_left"]
    return {
        "documents": {"total": sum(c["documents"].values()), **c["documents"]},
        "chunks": {"total": sum(c["chunks"].values()), **c["chunks"]},
        "pages": c["pages"],
        "duplicates": c["duplicates"],
        "rejected": c["rejected"],
        "rejected_waiting": c["rejected_waiting"],
        "failed_documents": [{"id": i, "name": n, "error": e, "original": f} for i, n, e, f in c["failed_documents"]],
        "rejected_files": [{**refused_outcome(r), "id": r.id, "moved_to": r.moved_to} for r in c["rejected_files"]],
        "duplicate_files": [duplicate_outcome(dup, doc) for dup, doc in c["duplicate_files"]],
        "done_documents": [document_outcome(d) for d in c["done_documents"]],
        "leases": [{"owner": o, "chunks": n, "until": u, "owner_gone": is_gone(o)} for o, n, u in c["leases"]],
        "open_runs": open_runs,
        "waiting_documents": [{"id": i, "name": n, "status": st, "pages_decoded": done, "page_count": total,
                               "original": where} for i, n, st, total, done, where in c["waiting_documents"]],
        "pages_left": pages_left,
        "eta_seconds": round(pages_left / rate * 3600) if rate and pages_left else None,
        "retrying_chunks": [
            {"id": i, "document_id": d, "pages": f"{a}-{b}", "attempts": t, "last_error": e}
            for i, d, a, b, t, e in c["retrying_chunks"]
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
        f"duplicates: {st['duplicates']}   refused files: {st['rejected']} ({st['rejected_waiting']} in failed/, "
        f"{st['rejected'] - st['rejected_waiting']} put back into the inbox)",
        *format_trouble(st.get("infrastructure") or []),  # the watchers' trouble with the ledger or the machine
    ]
    if st.get("grades"):  # added by the CLI: whether the configured model's grades are calibrated for it
        lines.append(f"grades:    {st['grades']['summary']}")
    for d in st["waiting_documents"]:
        lines.append(f"waiting:   #{d['id']} {d['name']}: {d['pages_decoded']}/{d['page_count']} pages decoded "
                     f"({d['status']}); its original: {d['original']}")
    waiting = st["documents"].get(DocStatus.QUEUED, 0) + st["documents"].get(DocStatus.RUNNING, 0)
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
    if st["done_documents"]:
        lines.append("done, the latest first (outputs in the outbox, originals in the archive):")
        lines += [f"  {outcome_line(d)}" for d in st["done_documents"]]
    if st["failed_documents"]:
        lines.append("failed documents (`uflash retry --doc ID` queues one again):")
        for d in st["failed_documents"]:
            lines.append(f"  #{d['id']} {d['name']}: {d['error']}")
            if d.get("original") is not None:
                lines.append(f"      its original: {d['original'] or 'not found where it was taken in'}")
    if st["retrying_chunks"]:
        lines.append("chunks waiting, with their last error:")
        lines += [f"  chunk {c['id']} (doc {c['document_id']}, pages {c['pages']}, attempt {c['attempts']}): "
                  f"{c['last_error']}" for c in st["retrying_chunks"]]
    if st["rejected_files"]:
        lines.append("refused files in failed/, the latest first (`uflash retry --file PATH` puts one back into the "
                     "inbox, `--all` every one):")
        lines += [f"  {outcome_line(r)}" for r in st["rejected_files"]]
    if st["duplicate_files"]:
        lines.append("duplicates, the latest first (nothing decoded):")
        lines += [f"  {outcome_line(d)}" for d in st["duplicate_files"]]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return "under a minute" if minutes < 1 else f"{minutes} min" if minutes < 90 else f"{minutes / 60:.1f} h"
