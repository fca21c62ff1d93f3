"""The review page of a run (``<outbox>/reports/run-<ID>.html``): one self-contained HTML file (images inline, no
network) that first says what became of every file the run touched (ingest.review.outcomes: done, failed, waiting, a
duplicate, refused; one line each), and in which a reviewer sees why each page got its grade and picks the pages to
decode again.

Per page: the page as the model read it (turned as it was read), large enough to read for pages that are not
``good`` (``REVIEW_PX``; good pages as a thumbnail, ``THUMB_PX``, so that a night of 10,000 pages stays a file a
browser opens), the model's element boxes drawn on it (hover or focus a box, or its text, and both light up), its
text by element with the words the model was unsure of marked (confidence below ``quality.unsure_word_prob``, the
confidence in the tooltip), the reasons of its grade in plain words, its repair (``ingest.quality.repair``), its
figures, and the exact ``uflash rerun`` command for it with a button that copies it. Pages can be picked (a check box
each), and one button copies the commands for all the pages picked, one line per document and run of pages.

Buttons filter by grade (or the repaired pages); the filter is also in the address (``#grade=poor``), so a link can
open a filtered page. Keyboard: ``j`` / ``k`` next / previous page shown, ``x`` picks it, ``c`` copies the commands
of the pages picked, ``a`` ``g`` ``f`` ``p`` ``r`` show all / good / fair / poor / repaired pages; every control is a
button or a check box reachable with Tab.
"""

from __future__ import annotations

import base64
import html
import io
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loguru import logger

from db.models import RunEnd
from ingest.files import uflash_command
from ingest.ledger.owners import is_gone
from ingest.logs import counted
from ingest.pages.orientation import turn
from ingest.quality.grades import explain
from ingest.reading.corrected import corrected_confidences
from ingest.reading.words import page_segments
from ingest.review.assets import LIVE_SCRIPT as _LIVE_SCRIPT
from ingest.review.assets import SCRIPT as _SCRIPT
from ingest.review.assets import STYLE as _STYLE

FILTERS = ("all", "good", "fair", "poor", "repaired")

def _when(iso: str) -> str:
    return iso[:19].replace("T", " ")


def run_span(r: dict[str, Any]) -> str:
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


def repair_note(rec: dict[str, Any]) -> str:
    """A repair (ingest.quality.repair's record) in plain words."""
    why = ", ".join(rec.get("why") or rec.get("checks") or [])
    if rec.get("kept") == "alone":
        return f"repaired: {why}, read again alone"
    return f"read again alone ({why}): the chunk's reading kept"


def page_images(original: str | None, kind: str, sizes: dict[int, int], turns: dict[int, int] | None = None
                ) -> dict[int, str]:
    """data: URIs of grayscale JPEG renders of the pages (``sizes``: page index -> long side in pixels), turned as the
    model read them (``turns``: page index -> degrees clockwise). A missing file or a render error: none (the page
    is written without them)."""
    from ingest.pages.render import render_pages

    if not original or not Path(original).exists() or not sizes:
        return {}
    out = {}
    try:
        for i, px in sizes.items():
            page = render_pages(Path(original), kind, i, i, target_px=px)[0]
            buf = io.BytesIO()
            turn(page.image, (turns or {}).get(i, 0)).convert("L").save(buf, format="JPEG", quality=60 if px > 400
                                                                         else 70)
            out[i] = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    except Exception as e:  # an image is a convenience: the page is written without it
        logger.warning("no page images for {}: {}", original, e)
    return out


_FIGURES = ("finish_reason", "tokens", "chars", "plain_chars", "ink_chars", "chars_vs_ink", "words", "unsure_words",
            "mean_logprob", "min_logprob", "low_confidence_share", "distinct_20", "distinct_35", "text_layer_ned",
            "neighbour_chars_ratio")


def rerun_prefix(config_file: str | None, mode: str = "lossless") -> str:
    """``uflash [--config FILE] rerun --mode MODE``: the start of every command the page copies."""
    return uflash_command(config_file, "rerun", "--mode", mode)


def _text_html(text: str, confidences: Sequence[float | None] | None, unsure: float, page_key: str) -> str:
    """The page's text by element (``data-el`` ties each to its box), unsure words marked."""
    e = html.escape
    conf = list(confidences or [])
    k = 0
    parts = []
    for n, seg in enumerate(page_segments(text)):
        lines = []
        for line in seg.lines:
            words = []
            for w in line:
                c = conf[k] if k < len(conf) else None
                k += 1
                if c is not None and c < unsure:
                    words.append(f"<mark class='unsure' title='confidence {c:.0%}'>{e(w.text)}</mark>")
                else:
                    words.append(e(w.text))
            lines.append(" ".join(words))
        label = f"<span class='label'>{e(seg.label)}</span>" if seg.label else ""
        focus = " tabindex='0'" if seg.grid_box is not None else ""
        parts.append(f"<div class='el' data-el='{page_key}-{n}' data-n='{n}' data-words='{1 if seg.lines else 0}'"
                     f"{focus}>{label}<span class='words'>{'<br>'.join(lines)}</span></div>")
    return "".join(parts) or "<div class='el'><em>(no text)</em></div>"


def _boxes_svg(text: str, page_key: str) -> str:
    rects = []
    for n, seg in enumerate(page_segments(text)):
        if seg.grid_box is None:
            continue
        x1, y1, x2, y2 = seg.grid_box
        rects.append(f"<rect data-el='{page_key}-{n}' x='{x1}' y='{y1}' width='{max(1, x2 - x1)}' "
                     f"height='{max(1, y2 - y1)}'><title>{html.escape(seg.label or '')}</title></rect>")
    return ("<svg viewBox='0 0 999 999' preserveAspectRatio='none' aria-hidden='true'>" + "".join(rects) + "</svg>")


def reading_html(p: dict[str, Any], unsure: float) -> str:
    """The page's text as its reading stands (a person's correction, else the model's), by element."""
    text, conf = p["text"] or "", p.get("word_confidence")
    if p.get("person_text") is not None:
        text, conf = p["person_text"], corrected_confidences(text, conf, p["person_text"])
    return _text_html(text, conf, unsure, f"p{p['page_id']}")


def _review_html(p: dict[str, Any], live: bool) -> str:
    """What a person did to the page (corrected, checked) and, served by `uflash review`, the controls to do it."""
    e = html.escape
    cer = f"corrected (model CER {p['cer_vs_correction']:.4f})" if p.get("corrected") else ""
    states = (f"<span class='state corrected'{'' if cer else ' hidden'}>{e(cer)}</span>"
              f"<span class='state checked'{'' if p.get('checked') else ' hidden'}>checked</span>")
    if not live:
        return f"<div class='review'>{states}</div>"
    n = p["index"]
    return (f"<div class='review'><button type='button' class='edit'>edit the text</button>"
            f"<button type='button' class='save' hidden>save</button><button type='button' class='cancel' hidden>"
            f"cancel</button><button type='button' class='undo'>undo: back to the model's reading</button>"
            f"<label><input type='checkbox' class='checked'{' checked' if p.get('checked') else ''} "
            f"aria-label='page {n} checked'> checked</label>{states}</div>")


def _page_html(d: dict[str, Any], p: dict[str, Any], image: str | None, rerun: str, unsure: float,
               live: bool = False) -> str:
    e = html.escape
    g = p["grade"] or "ungraded"
    q = p["quality"] or {}
    key = f"p{p['page_id']}"
    why = "".join(f"<li>{e(explain(code, q))}</li>" for code in p["reasons"])
    if p.get("turned"):
        why += f"<li>scanned turned: read turned {p['turned']} degrees clockwise</li>"
    if q.get("text_layer_ned") is not None and q["text_layer_ned"] > 0.3:
        why += (f"<li class='info'>differs from the PDF's own text layer ({q['text_layer_ned']:.0%} of characters);"
                " not graded: a text layer may be an old OCR</li>")
    rec = p.get("repair")
    repair = ""
    if rec:
        other = rec["chunk"] if rec.get("kept") == "alone" else rec["alone"]
        repair = (f"<div class='repair'><strong>{e(repair_note(rec))}</strong>"
                  f"<details><summary>the other reading ({e(str(other.get('confidence')))} mean log-probability"
                  f")</summary><div class='text'>{_text_html(other.get('text') or '', None, unsure, key + 'o')}"
                  f"</div></details></div>")
    figures = "".join(f"<tr><td>{k}</td><td>{e(str(q.get(k)))}</td></tr>" for k in _FIGURES if k in q)
    figures += "".join(f"<tr><td>{k}</td><td>{e(str(p.get(k)))}</td></tr>"
                       for k in ("mode", "tau", "tokens_per_second", "seconds") if p.get(k) is not None)
    picture = (f"<div class='scan'><img alt='page {p['index']} of {e(d['name'])}' src='{image}'>"
               f"{_boxes_svg(p['text'] or '', key)}</div>") if image else "<div>(no image: the original is gone)</div>"
    cmd = f"{rerun} --doc {d['id']} --pages {p['index']}-{p['index']}"
    return (f"<section class='page{' good-small' if g == 'good' else ''}' id='{key}' tabindex='-1' "
            f"data-doc='{d['id']}' data-page='{p['index']}' data-grade='{e(g)}' data-repaired='{1 if rec else 0}' "
            f"data-corrected='{1 if p.get('corrected') else 0}' "
            f"aria-label='{e(d['name'])} page {p['index']}, {e(g)}'>"
            f"<div class='head'><input type='checkbox' class='pick' id='pick-{key}' "
            f"aria-label='pick page {p['index']} of {e(d['name'])} for a re-run'>"
            f"<h3><label for='pick-{key}'>page {p['index']}</label> <span class='grade g-{e(g)}'>{e(g)}</span></h3>"
            f"<code class='cmd'>{e(cmd)}</code> <button type='button' class='copy'>copy command</button></div>"
            f"{_review_html(p, live)}<ul class='why'>{why}</ul>{repair}"
            f"<div class='cols'><div>{picture}</div><div><div class='text'>{reading_html(p, unsure)}</div>"
            f"<details class='figures'><summary>figures</summary><table>{figures}</table></details></div></div>"
            f"</section>")


def _files_html(files: list[dict[str, Any]]) -> str:
    """What became of every file of the run, one line each."""
    if not files:
        return ""
    e = html.escape
    items = "".join(f"<li class='f-{e(f['outcome'])}'><strong>{e(f['outcome'])}</strong> {e(f['words'])}</li>"
                    for f in files)
    return f"<section class='files' aria-labelledby='files-h'><h2 id='files-h'>files of this run</h2><ul>{items}</ul>" \
           "</section>"


def render_html(rep: dict[str, Any], images: dict[int, str] | None = None, config_file: str | None = None,
                unsure: float = 0.5, token: str | None = None) -> str:
    """The review page (``images``: page_id -> image data URI; ``config_file``: the config the commands name;
    ``token``: served by the review server, ingest.review.server, with its controls and this token)."""
    e = html.escape
    images = images or {}
    r = rep["run"] or {}
    counts = dict(rep["grades"])
    counts["repaired"] = sum(1 for d in rep["documents"] for p in d["pages"] if p.get("repair"))
    rerun = rerun_prefix(config_file)
    live = f" data-token='{e(token)}'" if token else ""
    buttons = "".join(f"<button type='button' data-grade='{g}' aria-pressed='false'>{g} "
                      f"({rep['pages'] if g == 'all' else counts.get(g, 0)})</button>" for g in FILTERS)
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
             f"<meta name='viewport' content='width=device-width,initial-scale=1'>"
             f"<title>uflash run {r.get('id')}: review</title><style>{_STYLE}</style></head>"
             f"<body data-filter='all' data-rerun='{e(rerun)}'{live}>",
             f"<header class='top'><h1>uflash run {r.get('id')} &middot; {e(str(r.get('mode')))} &middot; "
             f"{e(str(r.get('model')))} <small>{e(run_span(r)) if r else ''}</small></h1>",
             f"<p class='warn' role='alert'>{e(rep['not_calibrated'])}</p>" if rep.get("not_calibrated") else "",
             f"<div class='bar' role='toolbar' aria-label='show pages'>{buttons} "
             f"<span>showing <span id='shown'>{rep['pages']}</span> pages</span></div>",
             "<div class='bar' role='toolbar' aria-label='re-run'>"
             "<button type='button' id='pick-shown'>pick all shown</button>"
             "<button type='button' id='pick-none'>pick none</button>"
             "<button type='button' id='copy-picked'>copy the re-run commands of the picked pages</button>"
             + ("<button type='button' id='rerun-picked'>queue a lossless re-run of the picked pages</button>"
                if token else "") +
             "<span><span id='npicked'>0</span> picked</span> <span id='status' role='status' aria-live='polite'>"
             "</span></div><pre id='command' aria-label='re-run commands of the picked pages'></pre>"
             "<ul id='reruns' aria-label='re-runs queued from this page'></ul>"
             "<div class='keys'>keys: j / k next / previous page, x pick it, c copy the commands of the picked pages, "
             "a g f p r show all / good / fair / poor / repaired pages; hover or focus a box or its text to see the "
             "other; <mark class='unsure'>marked</mark> words: the model was unsure of them</div></header><main>",
             _files_html(rep.get("files") or [])]
    for d in rep["documents"]:
        parts.append(f"<h2 data-doc='{d['id']}'>{e(d['name'])} <small>({counted(d['page_count'], 'page')}; document "
                     f"{d['id']})</small></h2>")
        for p in d["pages"]:
            parts.append(_page_html(d, p, images.get(p["page_id"]), rerun, unsure, live=token is not None))
    parts.append(f"</main><script>{_SCRIPT}</script>{f'<script>{_LIVE_SCRIPT}</script>' if token else ''}"
                 "</body></html>")
    return "\n".join(parts)
