"""A page's reading as a person corrected it on the review page (``uflash review``; db.reviews holds the corrections,
ingest.review.corrections makes them): what the outputs and the review page show of a corrected page. The words the
person kept from the model's reading keep the model's confidence; the words they wrote have full confidence (1.0)."""

from __future__ import annotations

import difflib
from typing import Any

from db.reviews import PageState
from ingest.reading.words import page_words


def corrected_confidences(model: str, confidences: list[float | None] | None, person: str) -> list[float | None]:
    """One confidence per word of the person's reading: a word kept from the model's keeps the model's confidence, a
    word the person wrote has full confidence (1.0)."""
    a, b = [w.text for w in page_words(model)], [w.text for w in page_words(person)]
    conf = list(confidences or [])
    conf = conf if len(conf) == len(a) else [None] * len(a)
    out: list[float | None] = [1.0] * len(b)
    for op, i1, i2, j1, _ in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op == "equal":
            out[j1:j1 + i2 - i1] = conf[i1:i2]
    return out


def with_reading(page: dict[str, Any], state: PageState | None) -> dict[str, Any]:
    """A ``document.json`` page (the model's reading) as its reading stands: the person's correction, when there is
    one, with full confidence on the words the person wrote and ``stats.correction`` saying so."""
    c = state.correction if state else None
    if c is None:
        return page
    stats = page.get("stats") or {}
    conf = corrected_confidences(page["text"], stats.get("word_confidence"), c.text or "")
    record = {"by": c.by, "at": c.created_at.isoformat(), "cer": c.cer, "changes": c.diff, "model_text": page["text"]}
    return {**page, "text": c.text or "", "stats": {**stats, "word_confidence": conf, "correction": record}}
