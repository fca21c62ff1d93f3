"""What people do to pages on the review page, in the ledger (db.reviews), on SQLite and on PostgreSQL: every act is
kept in order, a page's reading is its latest correction unless undone after it, checked is its latest checked or
unchecked, and the model's readings are never touched; a correction keeps the model's blocks and gives the words the
person wrote full confidence (ingest.review.corrections); a version 5 ledger gets the table on open."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, select, text

from db.models import Document, Page, ReviewKind, Run, SchemaVersion
from db.reviews import page_history, page_states, record_review, standing_corrections
from ingest.reading.corrected import with_reading
from ingest.review.corrections import EditRefused, apply_block_edits, correct_page
from tests.conftest import reopened

TEXT = ("<|det|>title [10, 10, 500, 50]<|/det|>Register of deeds\n"
        "<|det|>text [10, 60, 900, 300]<|/det|>Entry one, 1851.\nThe parish record.\n"
        "<|det|>table [10, 320, 900, 600]<|/det|><table><tr><td>name</td><td>year</td></tr>"
        "<tr><td>Smith</td><td>1851</td></tr></table>")


def _pages(db, n: int = 2) -> list[Page]:
    with db.engine.begin() as conn:
        doc = conn.execute(Document.__table__.insert().values(
            sha256="c" * 64, original_path="/x.pdf", original_name="x.pdf", size_bytes=1, mtime_ns=1, kind="pdf",
            page_count=n, status="done")).inserted_primary_key[0]
        run = conn.execute(Run.__table__.insert().values(mode="lossless", model="m", engine_version="0")
                           ).inserted_primary_key[0]
        conn.execute(Page.__table__.insert(), [dict(document_id=doc, run_id=run, page_index=i, text=TEXT, boxes=[],
                                                    stats={"word_confidence": [0.5] * 13}) for i in range(1, n + 1)])
    with db.session() as s:
        return list(s.scalars(select(Page).order_by(Page.page_index)))


def test_acts_are_kept_in_order_and_decide_a_pages_reading(db):
    one, two = _pages(db)
    kind, fixed = correct_page(db, one, {1: "Entry one, 1852.\nThe parish record."})
    assert kind == ReviewKind.CORRECTED and "1852." in fixed and fixed.count("<|det|>") == 3
    record_review(db, one, ReviewKind.CHECKED)
    kind, again = correct_page(db, one, {0: "Register of Deeds"})  # made on the reading shown: both fixes
    assert kind == ReviewKind.CORRECTED and "Deeds" in again and "1852." in again
    record_review(db, two, ReviewKind.CHECKED)
    record_review(db, two, ReviewKind.UNCHECKED)
    states = page_states(db, [one.document_id])
    assert states[(one.document_id, 1)].correction.text == again and states[(one.document_id, 1)].checked
    assert states[(one.document_id, 2)].correction is None and not states[(one.document_id, 2)].checked
    [(standing, model)] = standing_corrections(db)
    assert standing.text == again and model.id == one.id and model.text == TEXT  # the model's reading untouched
    assert standing.diff == [["replace", "deeds", "Deeds"], ["replace", "1851.", "1852."]] and 0 < standing.cer < 0.1
    page = with_reading({"index": 1, "text": TEXT, "stats": one.stats}, states[(one.document_id, 1)])
    assert page["text"] == again and page["stats"]["correction"]["model_text"] == TEXT
    assert page["stats"]["word_confidence"] == [0.5, 0.5, 1.0, 0.5, 0.5, 1.0] + [0.5] * 7  # the person's words: 1.0
    kind, back = correct_page(db, one, {0: "Register of deeds", 1: "Entry one, 1851.\nThe parish record."})
    assert kind == ReviewKind.UNDONE and back == TEXT  # a reading equal to the model's is an undo
    assert standing_corrections(db) == [] and page_states(db, [one.document_id])[(one.document_id, 1)].correction is None
    assert [r.kind for r in page_history(db, one.document_id, 1)] == ["corrected", "checked", "corrected", "undone"]


def test_an_edit_keeps_the_blocks_and_a_tables_cells():
    fixed = apply_block_edits(TEXT, {2: "name year Smyth 1851"})  # a table: word for word, in its cells
    assert "<td>Smyth</td><td>1851</td>" in fixed and fixed.replace("Smyth", "Smith") == TEXT
    for edits, why in (({2: "name year"}, "one for one"), ({1: "<|det|>text [1, 1, 2, 2]<|/det|>x"}, "markup"),
                       ({1: "a <td>b"}, "markup"), ({7: "x"}, "no such block"), ({-1: "x"}, "no such block")):
        with pytest.raises(EditRefused, match=why):
            apply_block_edits(TEXT, edits)


def test_a_version_5_ledger_gets_page_reviews(db):
    one, _ = _pages(db)
    with db.engine.begin() as conn:
        conn.execute(text("DROP TABLE page_reviews"))
        conn.execute(SchemaVersion.__table__.delete().where(SchemaVersion.version == 6))
    with reopened(db) as again:
        with again.engine.connect() as conn:
            assert "page_reviews" in inspect(conn).get_table_names()
        record_review(again, one, ReviewKind.CHECKED)
        assert page_states(again, [one.document_id])[(one.document_id, 1)].checked
