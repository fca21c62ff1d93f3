"""``uflash report``: per document and page, grade, reasons, repair, tau and tokens/s of one run, as a table, as
JSON, and as the run's review page in ``<outbox>/reports/run-<ID>.html`` (ingest.review.page: each page beside its
text, boxes and reasons, rendered from the archived original; one self-contained file).

A run is one ``uflash run``, one batch of a ``uflash watch`` process or one ``uflash rerun`` (ingest.worker.lifecycle),
and its report shows the pages that run decoded, nothing earlier: its size and the time to render its thumbnails grow
with that run's work, not with the ledger. It first says what became of every file the run touched, one line each
(ingest.review.outcomes): its documents, and the duplicates and refused files it took in."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from db.models import Page
from db.reviews import PageState, page_states
from db.runs import get_run, latest_run_with_work, run_pages
from db.session import Database
from ingest.errors import UsageError
from ingest.logs import counted
from ingest.pages.orientation import page_turn
from ingest.quality.calibration import NOT_CALIBRATED, uncalibrated_pages
from ingest.quality.measures import character_error_rate
from ingest.review.assets import REVIEW_PX, THUMB_PX
from ingest.review.outcomes import outcome_line, run_outcomes
from ingest.review.page import page_images, render_html, repair_note, run_span


def collect_report(db: Database, run_id: int | None = None, grade: str | None = None) -> dict[str, Any]:
    """What became of the files of run ``run_id`` (default: the latest run that stored pages or took files in) and the
    pages it stored, optionally only those of ``grade``."""
    run_id = run_id if run_id is not None else latest_run_with_work(db)
    if run_id is None:
        return {"run": None, "files": [], "documents": [], "pages": 0, "grades": {}}
    run = get_run(db, run_id)
    if run is None:
        raise UsageError(f"no run {run_id}")
    rows = run_pages(db, run_id)
    states = page_states(db, {doc.id for _, doc in rows})
    docs: dict[int, dict[str, Any]] = {}
    grades: dict[str, int] = {}
    for page, doc in rows:
        st = page.stats or {}
        q = st.get("quality") or {}
        g = q.get("grade")
        if grade is not None and g != grade:
            continue
        grades[g or "ungraded"] = grades.get(g or "ungraded", 0) + 1
        d = docs.setdefault(doc.id, {"id": doc.id, "name": doc.original_name, "page_count": doc.page_count,
                                     "kind": doc.kind, "output_dir": doc.output_dir,
                                     "original": doc.archived_path or doc.original_path, "pages": []})
        tokens, seconds = st.get("tokens", 0), st.get("seconds", 0.0)
        d["pages"].append({
            "page_id": page.id, "index": page.page_index, "grade": g, "reasons": q.get("reasons", []),
            "mode": st.get("mode", run.mode), "finish_reason": q.get("finish_reason", st.get("finish_reason")),
            "tau": st.get("tau"), "tokens": tokens, "seconds": seconds,
            "turned": page_turn(st),  # scanned sideways or upside down: read turned (degrees clockwise)
            "tokens_per_second": round(tokens / seconds, 2) if seconds else None,
            "quality": q, "repair": st.get("repair"), "word_confidence": st.get("word_confidence"),
            "text": page.text, **review_fields(page, states.get((doc.id, page.page_index)))})
    n_pages = sum(len(d["pages"]) for d in docs.values())
    uncalibrated = uncalibrated_pages([p["quality"] for d in docs.values() for p in d["pages"]])
    return {"run": {"id": run.id, "mode": run.mode, "model": run.model, "started_at": run.started_at.isoformat(),
                    "finished_at": run.finished_at.isoformat() if run.finished_at else None,
                    "end_reason": run.end_reason, "owner": run.owner, "settings": run.settings,
                    "pages_per_hour": pages_per_hour(len(rows), run.started_at,
                                                   max((p.created_at for p, _ in rows), default=None))},
            "files": run_outcomes(db, run.id, {doc.id for _, doc in rows}), "documents": list(docs.values()),
            "pages": n_pages, "grades": grades,
            "not_calibrated": NOT_CALIBRATED.format(n=uncalibrated) if uncalibrated else None}


def review_fields(page: Page, state: PageState | None) -> dict[str, Any]:
    """What a person did to the page (``uflash review``): corrected or not (with their reading, and this reading's CER
    against it), checked or not."""
    c = state.correction if state else None
    return {"corrected": c is not None, "checked": bool(state and state.checked),
            "cer_vs_correction": round(character_error_rate(page.text, c.text or ""), 4) if c else None,
            "person_text": c.text if c else None}


def pages_per_hour(pages: int, started: datetime | None, last_page: datetime | None) -> float | None:
    """The run's throughput: pages it stored per hour from its start (model load included) to its last page."""
    if not pages or started is None or last_page is None:
        return None
    seconds = (_utc(last_page) - _utc(started)).total_seconds()
    return round(pages * 3600 / seconds, 1) if seconds > 0 else None


def _utc(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def format_report(rep: dict[str, Any]) -> str:
    if rep["run"] is None:
        return "no run yet: nothing decoded or taken in"
    r = rep["run"]
    rate = f" ({r['pages_per_hour']:,.0f} pages/hour)" if r.get("pages_per_hour") else ""
    grades = "  ".join(f"{g} {n}" for g, n in sorted(rep["grades"].items()))
    lines = [f"run {r['id']} ({r['mode']}, {r['model']}; {run_span(r)}): {counted(rep['pages'], 'page')}{rate}  "
             f"{grades}".rstrip()]
    if rep.get("not_calibrated"):
        lines.append(rep["not_calibrated"])
    lines += map(outcome_line, rep["files"])
    for d in rep["documents"]:
        lines += ["", f"#{d['id']} {d['name']} ({counted(d['page_count'], 'page')})",
                  f"  {'page':>4}  {'grade':<5}  {'finish':<14} {'tau':>6} {'tok/s':>8}  reasons"]
        for p in d["pages"]:
            tau = f"{p['tau']:.2f}" if p["tau"] is not None else "-"
            tps = f"{p['tokens_per_second']:.1f}" if p["tokens_per_second"] is not None else "-"
            lines.append(f"  {p['index']:>4}  {p['grade'] or '-':<5}  {p['finish_reason'] or '-':<14} {tau:>6} "
                         f"{tps:>8}  {', '.join(_remarks(p)) or '-'}")
    return "\n".join(lines)


def _remarks(page: dict[str, Any]) -> list[str]:
    """The grade's reasons, the turn of a page that was scanned sideways or upside down, its repair, and what a person
    did to it (corrected, with this reading's CER against the correction; checked)."""
    return page["reasons"] + ([f"turned {page['turned']}"] if page.get("turned") else []) + \
        ([repair_note(page["repair"])] if page.get("repair") else []) + \
        ([f"corrected (CER {page['cer_vs_correction']:.4f})"] if page.get("corrected") else []) + \
        (["checked"] if page.get("checked") else [])


def report_json(rep: dict[str, Any]) -> str:
    slim = {**rep, "documents": [{**d, "pages": [{k: v for k, v in p.items()
                                                  if k not in ("text", "word_confidence", "person_text")}
                                                 for p in d["pages"]]}
                                 for d in rep["documents"]]}
    return json.dumps(slim, ensure_ascii=False)


def report_images(rep: dict[str, Any]) -> dict[int, str]:
    """page_id -> the page's image (a data: URI) for every page of the report: large for fair and poor pages, a
    thumbnail for good ones (ingest.review.page.page_images)."""
    images: dict[int, str] = {}
    for d in rep["documents"]:
        sizes = {p["index"]: THUMB_PX if p["grade"] == "good" else REVIEW_PX for p in d["pages"]}
        by_index = page_images(d["original"], d["kind"], sizes, {p["index"]: p.get("turned", 0) for p in d["pages"]})
        images.update({p["page_id"]: by_index[p["index"]] for p in d["pages"] if p["index"] in by_index})
    return images


def write_html_report(db: Database, outbox: Path, run_id: int | None = None, config_file: Path | str | None = None,
                      unsure: float = 0.5) -> Path | None:
    """``<outbox>/reports/run-<ID>.html`` for the run (default: the latest; ingest.review.page); None when nothing is
    stored. ``config_file``: the config the page's ``uflash rerun`` commands name."""
    from ingest.files import write_atomic

    rep = collect_report(db, run_id)
    if rep["run"] is None:
        return None
    images = report_images(rep)
    path = outbox / "reports" / f"run-{rep['run']['id']}.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, render_html(rep, images, str(Path(config_file).resolve()) if config_file else None, unsure))
    return path
