"""What the ledger stores comes back the same on SQLite and on a real PostgreSQL server: nanosecond mtimes, file sizes
over 2 GiB, page text with NUL characters, figures that are not finite; and ledgers made by an earlier uflash are
migrated on both."""

from __future__ import annotations

import math
import os

import pytest
from sqlalchemy import func, select, text

from db.documents import document_of_file as known_document
from db.models import Chunk, Document, Duplicate, Page, Rejected, Run, SchemaVersion
from db.session import Database
from ingest.intake.enqueue import intake_file
from ingest.pages.prepare import replaced
from tests.conftest import make_pdf, reopened

BIG = 5 * 2**30 + 12345  # a 5 GiB scan
MTIME_NS = 1_767_225_600_123_456_789  # 2026-01-01, to the nanosecond


def test_a_pdf_is_taken_in_and_known_again_by_its_nanosecond_mtime(settings, db):
    """On PostgreSQL the mtime in nanoseconds (~1.8e18) overflowed a 32-bit column: no file could be taken in."""
    pdf = make_pdf(settings.inbox / "two.pdf", 2)
    os.utime(pdf, ns=(MTIME_NS, MTIME_NS))
    res = intake_file(db, settings, pdf)
    assert res.outcome == "document"
    with db.session() as s:
        doc = s.get(Document, res.document_id)
    assert (doc.mtime_ns, doc.size_bytes) == (MTIME_NS, pdf.stat().st_size)
    assert intake_file(db, settings, pdf).outcome == "known"  # the same file, compared to the nanosecond
    os.utime(pdf, ns=(MTIME_NS + 1, MTIME_NS + 1))  # touched: one nanosecond later is another look (same content)
    assert known_document(db, pdf, pdf.stat().st_size, MTIME_NS + 1) is None
    assert intake_file(db, settings, pdf).outcome == "known"


def test_files_over_2_gib_are_stored_and_compared_exactly(settings, db, tmp_path):
    """A 5 GiB original (a sparse file: nothing written) with an mtime in nanoseconds: its document, a duplicate and a
    rejected file keep the exact figures; the worker sees the file unchanged by comparing them."""
    big = settings.inbox / "huge.pdf"
    with open(big, "wb") as f:
        f.truncate(BIG)
    os.utime(big, ns=(MTIME_NS, MTIME_NS))
    st = big.stat()
    assert (st.st_size, st.st_mtime_ns) == (BIG, MTIME_NS)
    with db.session() as s, s.begin():
        doc = Document(sha256="a" * 64, original_path=str(big), original_name=big.name, size_bytes=st.st_size,
                       mtime_ns=st.st_mtime_ns, kind="pdf", page_count=1)
        s.add(doc)
        s.flush()
        s.add(Chunk(document_id=doc.id, first_page=1, last_page=1))
        s.add(Duplicate(document_id=doc.id, path="/elsewhere/huge.pdf", name="huge.pdf", size_bytes=BIG + 1,
                        mtime_ns=MTIME_NS + 1))
        s.add(Rejected(path="/in/bad.pdf", name="bad.pdf", size_bytes=3 * 2**40, reason="not a PDF"))
    assert known_document(db, big, BIG, MTIME_NS) == doc.id
    assert known_document(db, big, BIG - 2**32, MTIME_NS) is None  # no wrap-around at 32 bits
    assert known_document(db, big, BIG, MTIME_NS - 1) is None
    with db.session() as s:
        d = s.get(Document, doc.id)
        dup = s.scalar(select(Duplicate))
        rej = s.scalar(select(Rejected))
        assert s.scalar(select(func.sum(Document.size_bytes))) == BIG
    assert (d.size_bytes, d.mtime_ns, dup.size_bytes, dup.mtime_ns, rej.size_bytes) == (
        BIG, MTIME_NS, BIG + 1, MTIME_NS + 1, 3 * 2**40)
    assert replaced(db, d, big) is None  # equal figures: no need to read 5 GiB again


def test_page_text_with_nul_characters_and_figures_that_are_not_finite_are_stored(settings, db):
    """A broken PDF text layer can hold NUL characters (PostgreSQL text refuses them) and a page measure can be
    infinite or NaN (PostgreSQL JSON refuses them): both backends store the page, and the same thing."""
    with db.session() as s, s.begin():
        doc = Document(sha256="b" * 64, original_path="/in/x.pdf", original_name="x.pdf", size_bytes=1, mtime_ns=1,
                       kind="pdf", page_count=1)
        run = Run(mode="lossless", model="m", engine_version="1")
        s.add_all([doc, run])
        s.flush()
        s.add(Page(document_id=doc.id, run_id=run.id, page_index=1, text="Kapitel\x00 1", text_layer="a\x00b",
                   stats={"orientation": {"stripe_ratio": math.inf}, "mean_logprob": math.nan, "tau": 2.5,
                          "ids": [1, 2, 3]}))
    with db.session() as s:
        page = s.scalar(select(Page))
    assert (page.text, page.text_layer) == ("Kapitel 1", "ab")
    assert page.stats == {"orientation": {"stripe_ratio": None}, "mean_logprob": None, "tau": 2.5, "ids": [1, 2, 3]}


def _as_version_2(db: Database) -> None:
    """Make ``db`` a ledger as uflash wrote it at schema version 2: sizes and mtimes declared INTEGER (32-bit on
    PostgreSQL; SQLite's INTEGER has always been 64-bit)."""
    with db.engine.begin() as conn:
        if db.dialect == "postgresql":
            for table, columns in (("documents", ("size_bytes", "mtime_ns")),
                                   ("duplicates", ("size_bytes", "mtime_ns")), ("rejected_files", ("size_bytes",))):
                conn.execute(text(f"ALTER TABLE {table} "
                                  + ", ".join(f"ALTER COLUMN {c} TYPE INTEGER" for c in columns)))
        conn.execute(SchemaVersion.__table__.delete())
        conn.execute(SchemaVersion.__table__.insert().values(version=2))


def test_a_version_2_ledger_is_migrated_to_64_bit_sizes_and_mtimes(settings, db):
    """A ledger made before sizes and mtimes were 64-bit: its documents are kept, and once opened by this uflash a file
    with a nanosecond mtime is taken in (on PostgreSQL it could not be before)."""
    old = intake_file(db, settings, make_pdf(settings.inbox / "old.pdf", 1))  # a document of the earlier ledger
    with db.engine.begin() as conn:  # values an INTEGER column holds
        conn.execute(Document.__table__.update().values(mtime_ns=1_700_000_000, size_bytes=1000))
    _as_version_2(db)
    pdf = make_pdf(settings.inbox / "new.pdf", 1)
    os.utime(pdf, ns=(MTIME_NS, MTIME_NS))
    if db.dialect == "postgresql":  # an INTEGER column refuses a nanosecond mtime: integer out of range
        with pytest.raises(Exception, match="out of range"):
            intake_file(db, settings, pdf)
    with reopened(db) as again:
        with again.session() as s:
            kept = s.get(Document, old.document_id)
        assert (kept.original_name, kept.mtime_ns, kept.size_bytes) == ("old.pdf", 1_700_000_000, 1000)
        res = intake_file(again, settings, pdf)
        assert res.outcome == "document"
        with again.session() as s:
            assert s.get(Document, res.document_id).mtime_ns == MTIME_NS
            s.add(Rejected(path="/in/x", name="x", size_bytes=BIG, reason="r"))
            s.commit()
            assert s.scalar(select(Rejected.size_bytes)) == BIG

