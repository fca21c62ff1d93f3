"""What each decode drafts from (`ingest.worker.drafts`, `db.pages.earlier_readings`): a re-run's chunk from the
earlier decode of the same chunk, else from its pages' earlier readings; a page read again alone from its earlier
reading alone, else its earlier reading, else its chunk's reading now."""

from __future__ import annotations

from types import SimpleNamespace

from db.models import Chunk, Document, Page, Run
from db.pages import EarlierReading, earlier_readings
from db.session import Database
from engine.model.load import PAGE_SEPARATOR
from ingest.worker.drafts import alone_replay, chunk_replay


class Words:
    """A tokenizer of whitespace-separated words: one id a word, the page separator one id."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [hash(w) % 1000 for w in text.split()]}


def ids(*texts: str, multi: bool = False) -> list[int]:
    tok, out = Words(), []
    for t in texts:
        out += (tok(PAGE_SEPARATOR)["input_ids"] if multi else []) + tok(t)["input_ids"]
    return out


def chunk(n_pages: int, earlier=None, replay=None):
    return SimpleNamespace(pages=[object()] * n_pages, earlier=earlier or [], replay=replay)


def test_a_chunk_replays_its_earlier_decode_else_its_pages_earlier_readings():
    both = [EarlierReading("kept one", "in chunk one", "alone one"), EarlierReading("kept two", None, "alone two")]
    assert chunk_replay(chunk(2, both, replay=[7, 8]), Words()) == [7, 8]  # the same chunk decoded before: its ids
    assert chunk_replay(chunk(2, both), Words()) == ids("in chunk one", "kept two", multi=True)
    assert chunk_replay(chunk(1, both[1:]), Words()) == ids("alone two")
    assert chunk_replay(chunk(2, [both[0], None]), Words()) is None  # a page never read before: no replay
    assert chunk_replay(chunk(2), Words()) is None  # a first run


def test_a_page_read_again_alone_replays_its_reading_alone_else_what_its_chunk_just_read():
    earlier = [EarlierReading("kept", "in chunk", "alone"), EarlierReading("kept two", "in chunk two", None)]
    c = chunk(2, earlier)
    assert alone_replay(c, 0, "now", Words()) == ids("alone")
    assert alone_replay(c, 1, "now", Words()) == ids("in chunk two")
    assert alone_replay(chunk(2), 1, "what the chunk read", Words()) == ids("what the chunk read")
    assert alone_replay(chunk(2), 1, "", Words()) is None and alone_replay(c, 0, "now", None) is None


def test_earlier_readings_come_from_the_repair_record_or_the_chunk_the_page_was_read_in(tmp_path):
    db = Database(f"sqlite:///{tmp_path / 'l.db'}")
    with db.session() as s:
        doc = Document(sha256="0" * 64, original_path="x.pdf", original_name="x.pdf", size_bytes=1, mtime_ns=1,
                       kind="pdf", page_count=3)
        run = Run(mode="fast", model="m", engine_version="1")
        s.add_all([doc, run])
        s.flush()
        first, again = Chunk(document_id=doc.id, first_page=1, last_page=2), Chunk(document_id=doc.id, first_page=3,
                                                                                   last_page=3)
        s.add_all([first, again])
        s.flush()
        repair = {"kept": "alone", "chunk": {"text": "chunk reading"}, "alone": {"text": "alone reading"}}
        s.add_all([Page(document_id=doc.id, run_id=run.id, chunk_id=first.id, page_index=1, text="alone reading",
                        stats={"chunk_pages": "1-2", "repair": repair}),
                   Page(document_id=doc.id, run_id=run.id, chunk_id=first.id, page_index=2, text="two",
                        stats={"chunk_pages": "1-2"}),
                   Page(document_id=doc.id, run_id=run.id, chunk_id=again.id, page_index=3, text="three",
                        stats={"chunk_pages": "3-3"})])
        s.commit()
        doc_id = doc.id
    found = earlier_readings(db, doc_id, 1, 3, chunk_id=10**6)
    assert found == {1: EarlierReading("alone reading", "chunk reading", "alone reading"),
                     2: EarlierReading("two", "two", None), 3: EarlierReading("three", None, "three")}
    db.dispose()
