"""Figures of a decoded chunk's pages, and the repair of pages that look fine but are wrong.

``chunk_page_stats`` gives each page the stats the ledger stores beside its text: the figures of
``ingest.quality.measures.page_quality`` and ``ingest.quality.grades.page_figures`` (``quality``), its word confidences
and image size (``ingest.reading.confidence.archival_stats``), the chunk-level checks (a page that repeats an earlier
page of the chunk, a chunk that returned another number of pages than it was given).

``repair_chunk``: a page of a multi-page chunk that fails one of those checks (``ingest.quality.grades.checks``: it
repeats another page of its chunk, its text is far shorter or longer than the print on the page, or its chunk came back
with the wrong number of pages) is decoded again alone (the single-page prompt, the same mode and drafts). The
reading kept is the one that fails fewer checks, a reading that was cut off (the token limit, a repetition loop, the
context) counting one more; of two that fail as many, the one not cut off, then the one the model is more confident
of (the higher mean log-probability of its tokens: a copy of another page, written with confidence, does not win
over a reading of the page itself). Both readings are recorded in ``stats.repair`` (text, confidence, checks), and
the page keeps its chunk's place in the ledger: nothing is re-queued, no page moves.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from engine.chunk_output import ChunkOutput, PageOutput
from ingest.pages.ink import ink_text
from ingest.quality.grades import checks, explain, page_figures, plain_text, repeats
from ingest.quality.measures import Thresholds, page_quality
from ingest.reading.confidence import archival_stats
from ingest.reading.text import page_markdown


def confidence(po: PageOutput) -> float | None:
    """Mean log-probability of the reading's tokens (None when the decoder gave none)."""
    lps = [x for x in po.logprobs if x is not None]
    return round(statistics.fmean(lps), 4) if lps else None


def page_stats(po: PageOutput, image, text_layer: str | None, tokenizer: Any, t: Thresholds,
               ink: dict[str, Any] | None = None) -> dict[str, Any]:
    """The stats one reading of a page gets (before the chunk-level checks)."""
    arch = archival_stats(po.text, po.ids, po.logprobs, image.size, tokenizer)
    ink = ink if ink is not None else ink_text(image).dict()
    quality = {**page_quality(po.stats["finish_reason"], po.ids, po.logprobs, page_markdown(po.text), text_layer, t),
               **page_figures(po.text, arch["word_confidence"], ink, t)}
    return {"quality": quality, **arch}


def _chunk_checks(stats: list[dict[str, Any]], texts: Sequence[str], out: ChunkOutput, t: Thresholds,
                  first: int) -> None:
    """Add the chunk-level figures to each page's quality, in place: repeats of an earlier page (by its page number
    in the document; the chunk starts at page ``first``), page count."""
    mismatch = out.n_input_pages > 1 and out.pages_returned is not None
    found = repeats([plain_text(x) for x in texts], t, later_only=True)
    for st, rep in zip(stats, found):
        q = st["quality"]
        q.pop("repeats", None)
        if rep is not None:
            q["repeats"] = {**rep, "page": first + rep["page"] - 1, "scope": "chunk"}
        if mismatch:
            q["pages_mismatch"] = {"given": out.n_input_pages, "returned": out.pages_returned}


def chunk_page_stats(out: ChunkOutput, images: Sequence, text_layers: Sequence[str | None], tokenizer: Any,
                     t: Thresholds, first: int = 1,
                     inks: Sequence[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Stats of every page the chunk kept (``images``/``text_layers``: the chunk's pages, in order; ``first``: the
    page number of its first page in the document; ``inks``: the pages' print, ``ingest.pages.ink.InkText.dict()``, when
    it was measured already: then only the images' sizes are read)."""
    stats = [page_stats(po, images[i], text_layers[i], tokenizer, t, None if inks is None else inks[i])
             for i, po in enumerate(out.pages)]
    _chunk_checks(stats, [po.text for po in out.pages], out, t, first)
    return stats


def _reading(po: PageOutput, st: dict[str, Any], t: Thresholds) -> dict[str, Any]:
    return {"text": po.text, "confidence": confidence(po), "tokens": len(po.ids),
            "finish_reason": st["quality"].get("finish_reason"), "checks": checks(st["quality"], t)}


CUT_OFF = ("length", "repetition", "context_limit")  # finish reasons of a reading that did not end by itself


def keeps_alone(alone: dict[str, Any], chunk: dict[str, Any]) -> bool:
    """Keep the reading alone over the chunk's (two ``_reading`` records)? The module's rule; a tie keeps it."""
    def rank(r: dict[str, Any]) -> tuple:
        cut = r["finish_reason"] in CUT_OFF
        return len(r["checks"]) + cut, cut, -(r["confidence"] if r["confidence"] is not None else -1e9)

    return rank(alone) <= rank(chunk)


def repair_chunk(out: ChunkOutput, stats: list[dict[str, Any]], images: Sequence, text_layers: Sequence[str | None],
                 decode_alone: Callable[[int], ChunkOutput], tokenizer: Any, t: Thresholds,
                 first: int = 1) -> list[int]:
    """Decode the caught pages of a multi-page chunk again alone and keep the better reading of each (the module's
    rule); ``out.pages`` and ``stats`` are updated in place (``stats[i]["repair"]`` records both readings).
    ``decode_alone(i)`` decodes page ``i`` (0-based in the chunk) alone. Returns the indexes of the pages repaired."""
    if out.n_input_pages < 2:
        return []
    caught = [i for i, st in enumerate(stats) if checks(st["quality"], t)]
    for i in caught:
        t0 = time.perf_counter()
        alone_out = decode_alone(i)
        if not alone_out.pages:
            continue
        alone = alone_out.pages[0]
        chunk_po, chunk_st = out.pages[i], stats[i]
        alone_st = page_stats(alone, images[i], text_layers[i], tokenizer, t,
                              ink={k: v for k, v in chunk_st["quality"].items() if k.startswith("ink_")})
        texts = [po.text for po in out.pages]
        texts[i] = alone.text
        probe = [dict(st, quality=dict(st["quality"])) for st in stats]
        probe[i] = alone_st
        _chunk_checks(probe, texts, out, t, first)
        alone_st["quality"].pop("pages_mismatch", None)  # read alone: no chunk to miscount
        a, c = _reading(alone, alone_st, t), _reading(chunk_po, chunk_st, t)
        rep = alone_st["quality"].get("repeats")
        if rep is not None and chunk_st["quality"].get("repeats", {}).get("page") == rep["page"]:
            # read alone the page still says what page N says: the model cannot have copied a page it did not see
            alone_st["quality"]["repeats"] = {**rep, "confirmed": True}
            a["checks"] = checks(alone_st["quality"], t)
        keep_alone = keeps_alone(a, c)
        why = [explain(code, chunk_st["quality"], short=True) for code in c["checks"]]
        record = {"checks": c["checks"], "why": why,
                  "kept": "alone" if keep_alone else "chunk", "chunk": c, "alone": a,
                  "seconds": round(time.perf_counter() - t0, 3)}
        if keep_alone:
            alone.stats = {**chunk_po.stats, **{k: v for k, v in alone.stats.items() if k != "chunk_pages"}}
            out.pages[i] = alone
            stats[i] = alone_st
        stats[i]["repair"] = record
    if caught:  # the other pages are checked again against the readings kept
        confirmed = {i: st["quality"]["repeats"] for i, st in enumerate(stats)
                     if (st["quality"].get("repeats") or {}).get("confirmed")}
        _chunk_checks(stats, [po.text for po in out.pages], out, t, first)
        for i, st in enumerate(stats):
            if (st.get("repair") or {}).get("kept") == "alone":
                st["quality"].pop("pages_mismatch", None)
            if i in confirmed and (st["quality"].get("repeats") or {}).get("page") == confirmed[i]["page"]:
                st["quality"]["repeats"] = confirmed[i]
    return caught
