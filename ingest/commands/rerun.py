"""``uflash rerun`` and ``uflash diff``.

A re-run picks pages (the latest version of each page: by grade, document, page range), queues new chunks
for them, reserved for a **new run** (queued with its run_id: other workers, e.g. a running ``uflash watch``,
do not take them), and decodes those chunks, and only those, into that run (the earlier pages stay in the ledger:
history is kept). Each new chunk keeps the page range of the chunk that produced the pages when all of
them are picked, so the re-run decodes exactly the prompt of the first pass (same text as a first run in
that mode) and gets the earlier output ids as its replay draft; a subset of a chunk's pages becomes its own
chunk (a different prompt, hence possibly different text), drafted from the earlier page texts. When the
chunks are done, the document outputs (document.md/json) are rewritten from the latest pages.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loguru import logger

from db.chunks import chunk_ranges, queue_reserved, reserved_chunks, reserved_pending
from db.models import ChunkStatus, Page
from db.pages import latest_pages
from db.runs import get_run, run_pages
from db.session import Database
from ingest.config import Settings
from ingest.errors import UsageError
from ingest.logs import counted
from ingest.quality.measures import character_error_rate, normalized_edit_distance
from ingest.worker.lifecycle import serve_run


def parse_pages(spec: str) -> tuple[int, int]:
    """``3-7`` or ``5`` -> (first, last), 1-based inclusive."""
    try:
        a, _, b = spec.partition("-")
        first, last = int(a), int(b or a)
    except ValueError:
        raise UsageError(f"--pages must look like 3-7 or 5, not {spec!r}") from None
    if first < 1 or last < first:
        raise UsageError(f"--pages {spec!r}: need 1 <= first <= last")
    return first, last


def select_pages(db: Database, grade: str | None = None, doc_id: int | None = None,
                 pages: tuple[int, int] | None = None) -> list[Page]:
    if grade is None and doc_id is None and pages is None:
        raise UsageError("say which pages to re-run: --grade, --doc and/or --pages")
    out = []
    for p in latest_pages(db, doc_id):
        if grade is not None and (p.stats.get("quality") or {}).get("grade") != grade:
            continue
        if pages is not None and not pages[0] <= p.page_index <= pages[1]:
            continue
        out.append(p)
    return out


def rerun_chunks(db: Database, picked: list[Page]) -> list[tuple[int, int, int, int | None]]:
    """(document_id, first, last, source chunk id): the picked pages grouped by the chunk that produced them,
    one contiguous run of picked pages per new chunk. A chunk that was split (its output reached the context
    limit or ran out of memory, and its remaining pages went to child chunks) counts as its first, unsplit range:
    when every page of that range is picked, the re-run decodes the whole range again, which splits the same way
    (same prompt, same mode) and so reproduces the first pass; its own pages alone would be another prompt."""
    chunks = chunk_ranges(db, {p.chunk_id for p in picked if p.chunk_id is not None})
    chosen = {(p.document_id, p.page_index) for p in picked}

    def source(doc_id: int, chunk_id: int | None) -> int | None:
        """The topmost ancestor whose whole range is picked, else the chunk itself."""
        best, current = chunk_id, chunk_id
        while current is not None and current in chunks:
            first, last, parent = chunks[current]
            if all((doc_id, i) in chosen for i in range(first, last + 1)):
                best = current
            current = parent
        return best

    groups: dict[tuple[int, int | None], list[int]] = {}
    for p in picked:
        groups.setdefault((p.document_id, source(p.document_id, p.chunk_id)), []).append(p.page_index)
    plan = []
    for (doc_id, chunk_id), indexes in sorted(groups.items(), key=lambda kv: (kv[0][0], min(kv[1]))):
        indexes.sort()
        start = prev = indexes[0]
        for i in indexes[1:] + [None]:
            if i is not None and i == prev + 1:
                prev = i
                continue
            plan.append((doc_id, start, prev, chunk_id))
            if i is not None:
                start = prev = i
    return plan


@dataclass
class RerunResult:
    run_id: int | None
    earlier_runs: list[int]
    chunks: list[int] = field(default_factory=list)
    pages: int = 0
    failed: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)  # not decoded: the re-run was stopped (db.runs cancels them)


def rerun(settings: Settings, db: Database, make_worker: Callable[..., Any], stop: threading.Event,
          report: Callable[[int], None], grade: str | None = None, doc_id: int | None = None,
          pages: tuple[int, int] | None = None, announce: Callable[[RerunResult], None] | None = None) -> RerunResult:
    """Re-run the chosen pages (see the module docstring) into a new run; ``announce(result)`` once its chunks ended,
    before its report."""
    picked = select_pages(db, grade, doc_id, pages)
    if not picked:
        return RerunResult(None, [])
    earlier = sorted({p.run_id for p in picked})
    plan = rerun_chunks(db, picked)
    worker = make_worker(settings, db, fresh_run={"rerun_of": earlier, "rerun_pages": len(picked)})
    run_id = worker.run_id()  # loads the model first: without one, nothing is queued
    # reserved for this run: a running `uflash watch` leaves them alone
    queue_reserved(db, run_id, [(d, a, b) for d, a, b, _ in plan],
                   f"re-run of pages {{first}}-{{last}} (earlier run(s) {earlier})")
    result = RerunResult(run_id, earlier, pages=len(picked))

    def summary(_: int | None) -> None:
        for c in reserved_chunks(db, run_id):
            result.chunks.append(c.id)
            where = f"pages {c.first_page}-{c.last_page} of document {c.document_id}"
            if c.status == ChunkStatus.FAILED:
                result.failed.append(f"{where}: {c.last_error}")
            elif c.status == ChunkStatus.CANCELLED:
                result.cancelled.append(where)
        result.chunks.sort()
        logger.info("re-run {}: {} pages in {} chunks", run_id, len(picked), len(result.chunks))
        if announce is not None:
            announce(result)

    # chunks split off ours (context limit, out of memory) are reserved for the run too
    with worker:
        serve_run(worker, stop, lambda: reserved_pending(db, run_id) == 0, report,
                  progress=("uflash rerun", len(picked)), summary=summary)
    return result


def diff_runs(db: Database, run_a: int, run_b: int) -> dict[str, Any]:
    """Per page present in both runs: normalized edit distance of the texts (0 = identical)."""
    for r in (run_a, run_b):
        if get_run(db, r) is None:
            raise UsageError(f"no run {r}")
    a = {(p.document_id, p.page_index): (p, d) for p, d in run_pages(db, run_a)}
    b = {(p.document_id, p.page_index): (p, d) for p, d in run_pages(db, run_b)}
    rows = []
    for key in sorted(a.keys() & b.keys()):
        (pa, doc), (pb, _) = a[key], b[key]
        ned = normalized_edit_distance(pa.text, pb.text)
        rows.append({"document_id": key[0], "document": doc.original_name, "page": key[1],
                     "edit_distance": round(ned, 6), "identical": pa.text == pb.text})
    dists = [r["edit_distance"] for r in rows]
    return {"run_a": run_a, "run_b": run_b, "pages": rows, "common_pages": len(rows),
            "only_in_a": len(a.keys() - b.keys()), "only_in_b": len(b.keys() - a.keys()),
            "mean_edit_distance": round(sum(dists) / len(dists), 6) if dists else None,
            "max_edit_distance": max(dists) if dists else None,
            "identical_pages": sum(r["identical"] for r in rows)}


def format_diff(d: dict[str, Any]) -> str:
    head = (f"run {d['run_a']} vs run {d['run_b']}: {counted(d['common_pages'], 'page')} in both "
            f"({d['only_in_a']} only in {d['run_a']}, {d['only_in_b']} only in {d['run_b']})")
    if not d["common_pages"]:
        return (f"{head}: nothing to compare (a re-run of run {d['run_a']}'s pages is compared with it; "
                f"`uflash report --run ID` lists a run's pages)")
    lines = [head, f"{'document':<32} {'page':>5} {'edit distance':>14}"]
    for r in d["pages"]:
        lines.append(f"{(r['document'] or str(r['document_id']))[:32]:<32} {r['page']:>5} {r['edit_distance']:>14.4f}")
    lines.append(f"mean {d['mean_edit_distance']:.4f}  max {d['max_edit_distance']:.4f}  "
                 f"identical {d['identical_pages']}/{d['common_pages']}")
    return "\n".join(lines)


def diff_corrections(db: Database) -> dict[str, Any]:
    """Per page a person corrected (``uflash review``): the model's reading it corrected against the correction: the
    CER (ingest.quality.measures.character_error_rate) and the words changed."""
    from db.documents import documents
    from db.reviews import standing_corrections

    standing = standing_corrections(db)
    names = {d.id: d.original_name for d in documents(db, {p.document_id for _, p in standing})}
    rows = [{"document_id": p.document_id, "document": names.get(p.document_id), "page": p.page_index,
             "model_run": p.run_id, "corrected_at": r.created_at.isoformat(), "by": r.by,
             "cer": round(character_error_rate(p.text, r.text or ""), 6), "changes": r.diff or []}
            for r, p in standing]
    cers = [r["cer"] for r in rows]
    return {"pages": rows, "corrected_pages": len(rows),
            "mean_cer": round(sum(cers) / len(cers), 6) if cers else None, "max_cer": max(cers) if cers else None}


def format_diff_corrections(d: dict[str, Any]) -> str:
    if not d["corrected_pages"]:
        return "no page is corrected: correct pages on the review page (`uflash review`)"
    lines = [f"{counted(d['corrected_pages'], 'corrected page')}: the model's reading against the correction",
             f"{'document':<32} {'page':>5} {'CER':>8}  changes"]
    for r in d["pages"]:
        changes = "; ".join(f"{a or '-'} -> {b or '-'}" for _, a, b in r["changes"])
        lines.append(f"{(r['document'] or str(r['document_id']))[:32]:<32} {r['page']:>5} {r['cer']:>8.4f}  "
                     f"{changes[:200] or '-'}")
    lines.append(f"mean CER {d['mean_cer']:.4f}  max {d['max_cer']:.4f}")
    return "\n".join(lines)
