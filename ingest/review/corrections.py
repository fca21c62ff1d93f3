"""Corrections made on the review page: a person edits a page's text block by block (the model's elements: their
labels and boxes are kept), and the result is stored as a reading of the page marked as a person's (db.reviews), with
the words changed against the model's reading and the model's CER against it. The document's outputs are then written
again from each page's reading (ingest.worker.finish; ingest.reading.corrected: full confidence on the words the person
wrote).

Edits name blocks by their number in ``ingest.reading.words.page_segments`` (the ``data-el`` of the review page). A
text block's words are replaced as a whole (its lines kept as the person wrote them); a table's words are replaced one
for one (its cells stay where they are), so a table edit must keep its number of words. An edit may not write markup
(``<|``, table tags): the structure is the model's.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping

from db.models import Page, ReviewKind
from db.pages import latest_pages
from db.reviews import page_states, record_review
from db.session import Database
from ingest.quality.measures import character_error_rate
from ingest.reading.words import page_segments, page_words

_MARKUP = re.compile(r"<\||\|>|</?(?:table|thead|tbody|tfoot|tr|td|th|caption|br|col|colgroup)\b", re.I)


class EditRefused(ValueError):
    """An edit that would change the page's structure, or names no block of it."""


def _structure(text: str) -> list[tuple[str | None, tuple[int, int, int, int] | None, bool]]:
    return [(s.label, s.grid_box, s.table) for s in page_segments(text)]


def apply_block_edits(text: str, edits: Mapping[int, str]) -> str:
    """``text`` with the words of block ``n`` replaced by ``edits[n]`` (see the module); raises ``EditRefused``."""
    segments = page_segments(text)
    spans: list[tuple[int, int, str]] = []
    for n, new in edits.items():
        if not 0 <= n < len(segments) or not any(segments[n].lines):
            raise EditRefused(f"block {n}: no such block with words on this page")
        if _MARKUP.search(new):
            raise EditRefused(f"block {n}: markup cannot be written into a block (the structure is the model's)")
        seg = segments[n]
        lines = [" ".join(line.split()) for line in new.replace("\r\n", "\n").split("\n")]
        lines = [line for line in lines if line]
        if seg.table:
            old = [w for line in seg.lines for w in line]
            words = " ".join(lines).split()
            if len(words) != len(old):
                raise EditRefused(f"block {n} is a table: correct its words one for one ({len(old)} words, "
                                  f"not {len(words)})")
            spans += [(w.start, w.end, new_word) for w, new_word in zip(old, words)]
        else:
            spans.append((seg.lines[0][0].start, seg.lines[-1][-1].end, "\n".join(lines)))
    out = text
    for start, end, new in sorted(spans, reverse=True):
        out = out[:start] + new + out[end:]
    if _structure(out) != _structure(text):
        raise EditRefused("the edit would change the page's blocks (an emptied block that has no box of its own)")
    return out


def word_diff(model: str, person: str) -> list[list[str]]:
    """The words changed from the model's reading to the person's: [operation, the model's words, the person's]."""
    a, b = [w.text for w in page_words(model)], [w.text for w in page_words(person)]
    return [[op, " ".join(a[i1:i2]), " ".join(b[j1:j2])]
            for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
            if op != "equal"]


def model_reading(db: Database, page_id: int) -> Page | None:
    """The model's latest reading of the page that reading ``page_id`` is of (a later re-run's, when there is one)."""
    with db.session() as s:
        page = s.get(Page, page_id)
    if page is None:
        return None
    return latest_pages(db, page.document_id, page.page_index, page.page_index)[0]


def correct_page(db: Database, page: Page, edits: Mapping[int, str]) -> tuple[ReviewKind, str]:
    """Store the person's edits of ``page`` (the model's latest reading of it) as its new reading, made on the reading
    it shows now (an earlier correction, or the model's). A reading equal to the model's is recorded as an undo.
    Returns what was recorded and the page's reading now; raises ``EditRefused``."""
    state = page_states(db, [page.document_id]).get((page.document_id, page.page_index))
    shown = state.correction.text if state and state.correction else page.text
    text = apply_block_edits(shown or "", edits)
    if text == page.text:
        record_review(db, page, ReviewKind.UNDONE)
        return ReviewKind.UNDONE, text
    record_review(db, page, ReviewKind.CORRECTED, text=text, diff=word_diff(page.text, text),
                  cer=round(character_error_rate(page.text, text), 6))
    return ReviewKind.CORRECTED, text
