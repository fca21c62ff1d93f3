"""``uflash report``: per document and page, grade, reasons, tau and tokens/s of one run, as a table,
as JSON, and as a static HTML page in ``<outbox>/reports/run-<ID>.html`` (a thumbnail of each page beside
its text and stats, rendered from the archived original; filter by grade with the buttons or a URL hash
such as ``#grade=poor``; no network access, everything is inline).

A run is one ``uflash run``, one batch of a ``uflash watch`` process or one ``uflash rerun`` (ingest.lifecycle), and its
report shows the pages that run decoded, nothing earlier: its size and the time to render its thumbnails grow
with that run's work, not with the ledger."""

from __future__ import annotations

import base64
import html
import io
import json
import socket
from pathlib import Path
from typing import Any

from loguru import logger

from db.models import RunEnd
from db.runs import get_run, latest_run_with_pages, run_pages
from db.session import Database
from ingest.errors import UsageError
from ingest.orientation import page_turn, turn
from ingest.outputs import page_markdown
from ingest.owners import is_gone

THUMB_PX = 220


def collect_report(db: Database, run_id: int | None = None, grade: str | None = None) -> dict[str, Any]:
    """The pages of run ``run_id`` (default: the latest run with pages), optionally only those of ``grade``."""
    run_id = run_id if run_id is not None else latest_run_with_pages(db)
    if run_id is None:
        return {"run": None, "documents": [], "pages": 0, "grades": {}}
    run = get_run(db, run_id)
    if run is None:
        raise UsageError(f"no run {run_id}")
    rows = run_pages(db, run_id)
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
            "quality": q, "text": page.text})
    return {"run": {"id": run.id, "mode": run.mode, "model": run.model, "started_at": run.started_at.isoformat(),
                    "finished_at": run.finished_at.isoformat() if run.finished_at else None,
                    "end_reason": run.end_reason, "owner": run.owner, "settings": run.settings},
            "documents": list(docs.values()), "pages": sum(len(d["pages"]) for d in docs.values()), "grades": grades}


def _when(iso: str) -> str:
    return iso[:19].replace("T", " ")


def _run_span(r: dict[str, Any]) -> str:
    """When the run started and how it ended (or that it has not)."""
    if r.get("end_reason") == RunEnd.CRASHED:
        end = f"stopped by a crash after {_when(r['finished_at'])}"
    elif r.get("finished_at"):
        end = f"finished {_when(r['finished_at'])}"
    else:
        host = (r.get("owner") or "").partition(":")[0]
        end = "not finished: its process is gone (crashed or killed)" if is_gone(r.get("owner")) else \
            "not finished: still running" if host == socket.gethostname() else \
            f"not finished: still running on {host or 'another host'}, or stopped by a crash there"
    return (f"started {_when(r['started_at'])}, " if r.get("started_at") else "") + end


def format_report(rep: dict[str, Any]) -> str:
    if rep["run"] is None:
        return "no pages stored yet"
    r = rep["run"]
    lines = [f"run {r['id']} ({r['mode']}, {r['model']}; {_run_span(r)}): {rep['pages']} pages  "
             + "  ".join(f"{g} {n}" for g, n in sorted(rep["grades"].items()))]
    for d in rep["documents"]:
        lines += ["", f"#{d['id']} {d['name']} ({d['page_count']} pages)",
                  f"  {'page':>4}  {'grade':<5}  {'finish':<14} {'tau':>6} {'tok/s':>8}  reasons"]
        for p in d["pages"]:
            tau = f"{p['tau']:.2f}" if p["tau"] is not None else "-"
            tps = f"{p['tokens_per_second']:.1f}" if p["tokens_per_second"] is not None else "-"
            lines.append(f"  {p['index']:>4}  {p['grade'] or '-':<5}  {p['finish_reason'] or '-':<14} {tau:>6} "
                         f"{tps:>8}  {', '.join(_remarks(p)) or '-'}")
    return "\n".join(lines)


def _remarks(page: dict[str, Any]) -> list[str]:
    """The grade's reasons, and the turn of a page that was scanned sideways or upside down."""
    return page["reasons"] + ([f"turned {page['turned']}"] if page.get("turned") else [])


def report_json(rep: dict[str, Any]) -> str:
    slim = {**rep, "documents": [{**d, "pages": [{k: v for k, v in p.items() if k != "text"} for p in d["pages"]]}
                                 for d in rep["documents"]]}
    return json.dumps(slim, ensure_ascii=False)


def _thumbnails(original: str | None, kind: str, indexes: list[int],
                turns: dict[int, int] | None = None) -> dict[int, str]:
    """data: URIs of small JPEG renders of the pages (missing file or render error: none), turned as the model read
    them (``turns``: page index -> degrees clockwise)."""
    from ingest.render import render_pages

    if not original or not Path(original).exists() or not indexes:
        return {}
    out = {}
    try:
        for i in indexes:
            page = render_pages(Path(original), kind, i, i, target_px=THUMB_PX)[0]
            buf = io.BytesIO()
            turn(page.image, (turns or {}).get(i, 0)).save(buf, format="JPEG", quality=70)
            out[i] = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    except Exception as e:  # a thumbnail is a convenience: the report is written without it
        logger.warning("no thumbnails for {}: {}", original, e)
    return out


_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
.bar button{margin-right:.4em} .bar button.on{font-weight:bold}
.page{display:grid;grid-template-columns:240px 1fr 260px;gap:1em;border-top:1px solid #ccc;padding:.8em 0}
.page img{max-width:230px;border:1px solid #aaa}
.page pre{white-space:pre-wrap;margin:0;max-height:24em;overflow:auto;font:12px/1.35 monospace}
.grade{font-weight:bold;padding:0 .4em;border-radius:3px}
.g-good{background:#cfc}.g-fair{background:#ffc}.g-poor{background:#fcc}
table.stats td{padding:0 .4em 0 0;font-size:12px}
"""

_SCRIPT = """
function applyFilter(){
  var m=/grade=(\\w+)/.exec(location.hash||''); var want=m?m[1]:'all'; var shown=0;
  document.querySelectorAll('section.page').forEach(function(s){
    var on=(want==='all'||s.dataset.grade===want); s.hidden=!on; if(on){shown++;}
  });
  document.body.dataset.filter=want; document.getElementById('shown').textContent=shown;
  document.querySelectorAll('.bar button').forEach(function(b){b.classList.toggle('on',b.dataset.grade===want);});
}
document.querySelectorAll('.bar button').forEach(function(b){
  b.addEventListener('click',function(){location.hash=b.dataset.grade==='all'?'':'grade='+b.dataset.grade;applyFilter();});
});
window.addEventListener('hashchange',applyFilter); applyFilter();
"""

_STAT_KEYS = ("finish_reason", "tokens", "chars", "distinct_20", "distinct_35", "mean_logprob", "min_logprob",
              "low_confidence_share", "text_layer_ned", "neighbour_chars_ratio")


def render_html(rep: dict[str, Any], thumbs: dict[int, str] | None = None) -> str:
    """The report as one self-contained HTML page (``thumbs``: page_id -> image data URI)."""
    e = html.escape
    thumbs = thumbs or {}
    r = rep["run"] or {}
    counts = rep["grades"]
    buttons = "".join(f'<button data-grade="{g}">{g} ({counts.get(g, 0) if g != "all" else rep["pages"]})</button>'
                      for g in ("all", "good", "fair", "poor"))
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>uflash run {r.get('id')}</title>"
             f"<style>{_STYLE}</style></head><body data-filter='all'>",
             f"<h1>uflash run {r.get('id')} &middot; {e(str(r.get('mode')))} &middot; {e(str(r.get('model')))}</h1>",
             f"<p class='span'>{e(_run_span(r)) if r else ''}</p>",
             f"<div class='bar'>{buttons} <span>showing <span id='shown'>{rep['pages']}</span> pages</span></div>"]
    for d in rep["documents"]:
        parts.append(f"<h2 data-doc='{d['id']}'>{e(d['name'])} <small>({d['page_count']} pages)</small></h2>")
        for p in d["pages"]:
            g = p["grade"] or "ungraded"
            q = p["quality"]
            stats = "".join(f"<tr><td>{k}</td><td>{e(str(q.get(k)))}</td></tr>" for k in _STAT_KEYS if k in q)
            shown = ("mode", "tau", "tokens_per_second", "seconds") + (("turned",) if p.get("turned") else ())
            stats += "".join(f"<tr><td>{k}</td><td>{e(str(p[k]))}</td></tr>" for k in shown)
            img = thumbs.get(p["page_id"])
            image = f"<img alt='page {p['index']}' src='{img}'>" if img else "<div>(no image)</div>"
            parts.append(
                f"<section class='page' id='p{p['page_id']}' data-doc='{d['id']}' data-page='{p['index']}' "
                f"data-grade='{e(g)}'><div>{image}</div>"
                f"<div><h3>page {p['index']} <span class='grade g-{e(g)}'>{e(g)}</span> "
                f"<small>{e(', '.join(_remarks(p)))}</small></h3><pre>{e(page_markdown(p['text']))}</pre></div>"
                f"<div><table class='stats'>{stats}</table></div></section>")
    parts.append(f"<script>{_SCRIPT}</script></body></html>")
    return "\n".join(parts)


def write_html_report(db: Database, outbox: Path, run_id: int | None = None) -> Path | None:
    """``<outbox>/reports/run-<ID>.html`` for the run (default: the latest); None when nothing is stored."""
    from ingest.files import write_atomic

    rep = collect_report(db, run_id)
    if rep["run"] is None:
        return None
    thumbs: dict[int, str] = {}
    for d in rep["documents"]:
        by_index = _thumbnails(d["original"], d["kind"], [p["index"] for p in d["pages"]],
                               {p["index"]: p.get("turned", 0) for p in d["pages"]})
        thumbs.update({p["page_id"]: by_index[p["index"]] for p in d["pages"] if p["index"] in by_index})
    path = outbox / "reports" / f"run-{rep['run']['id']}.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, render_html(rep, thumbs))
    return path
