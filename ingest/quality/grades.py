"""Page grades: ``good`` (a reviewer can skip the page), ``fair`` (worth a glance), ``poor`` (look at it), with the
reasons in plain words.

The rules and their thresholds (``[quality]`` in config.toml, fields of ``ingest.config.Thresholds``) were chosen on
a labelled difficulty ladder against the truth and checked on a held-out half (docs/grades.md,
``python -m scripts.eval.grades``). A grade never depends on the PDF having a text layer: the agreement with a text
layer is shown beside the grade, not used in it (a born-digital page and its scan, read alike, grade alike).

Figures a page is graded on (``stats.quality``; those of ``ingest.quality.measures.page_quality`` plus these):
- ``unsure_words``: share of the page's words whose confidence (``stats.word_confidence``: the product of their
  tokens' probabilities) is below ``unsure_word_prob``;
- ``plain_chars``: characters of the page's text without markup; ``ink_chars``: characters of print measured on the
  rendered page (``ingest.pages.ink``); ``chars_vs_ink``: their ratio (far below 1: text missed; far above: text made
up); - ``repeats``: ``{"page": N, "share": s}`` when the page's text nearly repeats page N of its chunk (``scope``
  ``chunk``: the model may have copied it) or of its document (``scope`` ``document``): ``share`` of its character
  8-grams found on page N;
- ``pages_mismatch``: the chunk returned another number of pages than it was given (every page it returned is
  suspect: a page may hold its neighbour's text).

A page caught by the checks that the model can get wrong while sure of itself (a repeat within the chunk, text far
from its ink, a page-count mismatch) is decoded again alone first (``ingest.quality.repair``), and graded on the
reading kept.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from ingest.quality.measures import Thresholds
from ingest.reading.words import plain_words

GRAM = 8  # characters per n-gram of the repeat check
COMMON_GRAM_PAGES = 20  # an n-gram on more pages than this (a running header, boilerplate) is not evidence


def plain_text(text: str) -> str:
    """The page's words without markup (element headers, table tags), joined by single spaces."""
    return " ".join(plain_words(text))


def page_figures(text: str, word_confidence: Sequence[float | None] | None, ink: dict[str, Any] | None,
                 t: Thresholds) -> dict[str, Any]:
    """The figures of one page that come from its words and its image (``ink``: ``ingest.pages.ink.InkText.dict()``)."""
    conf = [c for c in (word_confidence or []) if c is not None]
    plain = len(plain_text(text))
    out: dict[str, Any] = {
        "words": len(word_confidence or []),
        "unsure_words": round(sum(c < t.unsure_word_prob for c in conf) / len(conf), 4) if conf else None,
        "plain_chars": plain,
    }
    if ink is not None:
        out.update(ink)
        ink_chars = ink.get("ink_chars") or 0
        # None on a (nearly) blank page that was read as (nearly) blank; text read off a blank page: 99
        out["chars_vs_ink"] = (min(99.0, round(plain / max(ink_chars, 1), 3))
                               if max(ink_chars, plain) >= t.ink_min_chars else None)
    return out


def _grams(text: str) -> set[str]:
    s = " ".join(text.split())
    return {s[i : i + GRAM] for i in range(len(s) - GRAM + 1)}


def repeats(texts: Sequence[str], t: Thresholds, later_only: bool = True) -> list[dict[str, Any] | None]:
    """For each page (plain texts in order), the other page whose text it nearly repeats: the page holding the
    largest share of its character 8-grams, when that share is at least ``repeat_share`` and the page has at least
    ``repeat_min_chars`` characters; None otherwise. ``later_only``: a page is only said to repeat an earlier one
    (within a chunk the model copies what it has written). Page numbers are 1-based positions in ``texts``.
    N-grams found on more than ``COMMON_GRAM_PAGES`` pages (running headers, boilerplate) do not count."""
    grams = [_grams(x) if len(" ".join(x.split())) >= t.repeat_min_chars else set() for x in texts]
    where: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(grams):
        for gram in g:
            where[gram].append(i)
    out: list[dict[str, Any] | None] = []
    for i, g in enumerate(grams):
        if not g:
            out.append(None)
            continue
        shared: Counter[int] = Counter()
        for gram in g:
            pages = where[gram]
            if len(pages) <= COMMON_GRAM_PAGES:
                shared.update(j for j in pages if j != i and (j < i or not later_only))
        best = shared.most_common(1)
        if best and best[0][1] / len(g) >= t.repeat_share:
            out.append({"page": best[0][0] + 1, "share": round(best[0][1] / len(g), 3)})
        else:
            out.append(None)
    return out


def neighbour_ratio(chars: Sequence[int], i: int, min_chars: int = 200) -> float | None:
    """Characters of page ``i`` / the median of its neighbours' (pages i-1 and i+1); None without neighbours or when
    the neighbours hold fewer than ``min_chars`` (too little text to compare)."""
    near = [chars[j] for j in (i - 1, i + 1) if 0 <= j < len(chars)]
    if not near:
        return None
    median = statistics.median(near)
    if median < min_chars:
        return None
    return round(chars[i] / median, 4)


# -- the grade --------------------------------------------------------------------------------------------------

CAUGHT = ("repeats_page", "text_vs_ink", "pages_mismatch")  # checks a page is decoded again alone for


def checks(q: dict[str, Any], t: Thresholds) -> list[str]:
    """The "looks fine but wrong" checks a page fails (codes of ``CAUGHT``): what ``ingest.quality.repair`` repairs."""
    out = []
    rep = q.get("repeats")
    if rep and rep.get("scope", "chunk") == "chunk" and not rep.get("confirmed"):
        out.append("repeats_page")
    ratio = q.get("chars_vs_ink")
    if ratio is not None and not t.ink_short <= ratio <= t.ink_long:
        out.append("text_vs_ink")
    if q.get("pages_mismatch"):
        out.append("pages_mismatch")
    return out


def grade(q: dict[str, Any], t: Thresholds) -> tuple[str, list[str]]:
    """(grade, reason codes) of a page from its figures; poor reasons first. Codes: repetition, context_limit,
    length, repeats_page, text_vs_ink, pages_mismatch, low_distinct_20, unsure_words, low_mean_logprob,
    repeats_page_elsewhere, chars_vs_neighbours. Figures that are missing (no words, too little ink to measure) fire
    no rule; the PDF text layer is never used."""
    poor: list[str] = []
    fair: list[str] = []

    def rule(value: float | None, poor_if, fair_if, code: str) -> None:
        if value is None:
            return
        if poor_if(value):
            poor.append(code)
        elif fair_if(value):
            fair.append(code)

    finish = q.get("finish_reason")
    if finish in ("repetition", "context_limit", "length"):
        poor.append(finish)
    poor += checks(q, t)
    rule(q.get("distinct_20"), lambda v: v < t.distinct_20_poor, lambda v: v < t.distinct_20_fair, "low_distinct_20")
    rule(q.get("unsure_words"), lambda v: v > t.unsure_words_poor, lambda v: v > t.unsure_words_fair, "unsure_words")
    rule(q.get("mean_logprob"), lambda v: v < t.mean_logprob_poor, lambda v: v < t.mean_logprob_fair,
         "low_mean_logprob")
    ratio = q.get("chars_vs_ink")
    if ratio is not None and "text_vs_ink" not in poor and not t.ink_short_fair <= ratio <= t.ink_long_fair:
        fair.append("text_vs_ink")
    rep = q.get("repeats")
    if rep and (rep.get("scope") == "document" or rep.get("confirmed")):
        fair.append("repeats_page_elsewhere")
    nb = q.get("neighbour_chars_ratio")
    if nb is not None and not t.neighbour_low <= nb <= t.neighbour_high:
        fair.append("chars_vs_neighbours")
    if poor:
        return "poor", list(dict.fromkeys(poor + fair))
    return ("fair", list(dict.fromkeys(fair))) if fair else ("good", [])


def grade_document(pages: list[dict[str, Any]], t: Thresholds) -> list[dict[str, Any]]:
    """Each page's figures (in document order; ``chunk_id`` tells which chunk a page came from, when known)
    completed with the document-level checks (a page repeating a page of another chunk, characters against the
    neighbours), ``grade`` and ``reasons``."""
    texts = [p.get("plain") or "" for p in pages]
    doc_repeats = repeats(texts, t, later_only=True) if any(texts) else [None] * len(pages)
    chars = [p.get("chars", 0) for p in pages]
    out = []
    for i, p in enumerate(pages):
        q = {k: v for k, v in p.items() if k not in ("plain", "chunk_id")}
        q["neighbour_chars_ratio"] = neighbour_ratio(chars, i, t.neighbour_min_chars)
        other = doc_repeats[i]
        if other and not q.get("repeats"):
            same_chunk = pages[other["page"] - 1].get("chunk_id") == p.get("chunk_id") is not None
            q["repeats"] = {**other, "scope": "chunk" if same_chunk else "document"}
        q["grade"], q["reasons"] = grade(q, t)
        out.append(q)
    return out


# -- plain words ------------------------------------------------------------------------------------------------

def explain(code: str, q: dict[str, Any], short: bool = False) -> str:
    """A reason code in plain words, with the page's figures (``short``: without the figures)."""
    rep = q.get("repeats") or {}
    ratio = q.get("chars_vs_ink")
    share = q.get("unsure_words")
    mismatch = q.get("pages_mismatch") or {}
    less = "far less" if (ratio or 0) < 1 else "far more"
    long = {
        "repeats_page": f" ({round(100 * rep.get('share', 0))}% of its text is there)",
        "text_vs_ink": f" ({q.get('plain_chars')} characters read, about {q.get('ink_chars')} on the page)",
    }
    texts = {
        "repetition": "the text runs into a loop and was cut",
        "context_limit": "the text was cut at the model's context limit",
        "length": "the text was cut at the token limit (engine.max_tokens_per_page)",
        "repeats_page": f"repeats page {rep.get('page')}",
        "repeats_page_elsewhere": f"nearly the same text as page {rep.get('page')}",
        "text_vs_ink": f"{less} text than the page's print suggests",
        "pages_mismatch": f"its chunk came back with {mismatch.get('returned')} pages for {mismatch.get('given')}",
        "low_distinct_20": "much of the text repeats itself",
        "unsure_words": f"the model was unsure of {round(100 * (share or 0))}% of its words",
        "low_mean_logprob": "the model was unsure of the text as a whole",
        "chars_vs_neighbours": "much shorter or longer than the pages beside it",
    }
    return texts.get(code, code.replace("_", " ")) + ("" if short else long.get(code, ""))
