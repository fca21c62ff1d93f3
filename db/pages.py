"""Stored pages. Pages are never overwritten: every decode of a page is a row of its run, and what a document shows is
the **latest** version of each of its pages (``latest_pages``, the one query that decides it: the highest id per
document and page index)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, NamedTuple

from sqlalchemy import ColumnElement, func, select, update

from db.models import DocStatus, Document, Page
from db.session import Database, among


def _latest_ids(*where: ColumnElement):
    """The ids of the latest version of each page among the pages matching ``where``."""
    return select(func.max(Page.id)).where(*where).group_by(Page.document_id, Page.page_index)


def latest_pages(db: Database, doc_id: int | None = None, first: int | None = None, last: int | None = None,
                 not_of_chunk: int | None = None) -> list[Page]:
    """The latest stored version of every page (the one the document outputs show), by document and page index; of
    one document, of its pages ``first``..``last``, and leaving out the pages of chunk ``not_of_chunk``, as asked."""
    where = []
    if doc_id is not None:
        where.append(Page.document_id == doc_id)
    if first is not None and last is not None:
        where.append(Page.page_index.between(first, last))
    if not_of_chunk is not None:
        where.append(Page.chunk_id != not_of_chunk)
    with db.session() as s:
        return list(s.scalars(select(Page).where(Page.id.in_(_latest_ids(*where)))
                              .order_by(Page.document_id, Page.page_index)))


class EarlierReading(NamedTuple):
    """What the ledger holds of a page's latest earlier decode: the text kept, and the readings behind it (a re-run's
    drafts): the one made in a multi-page chunk and the one made of the page alone (its chunk had one page, or the
    repair read it again alone: ``ingest.quality.repair`` keeps both)."""

    text: str
    in_chunk: str | None
    alone: str | None


def earlier_readings(db: Database, doc_id: int, first: int, last: int, chunk_id: int) -> dict[int, EarlierReading]:
    """Page index -> the latest earlier reading of pages ``first``..``last`` stored by another chunk than
    ``chunk_id``."""
    found = {}
    for p in latest_pages(db, doc_id, first, last, not_of_chunk=chunk_id):
        stats = p.stats or {}
        repair = stats.get("repair") or {}
        if repair:
            found[p.page_index] = EarlierReading(p.text, repair.get("chunk", {}).get("text"),
                                                 repair.get("alone", {}).get("text"))
        else:
            a, _, b = str(stats.get("chunk_pages", "")).partition("-")
            alone = a == b  # a chunk of one page (or no record of its chunk: taken as read alone)
            found[p.page_index] = EarlierReading(p.text, None if alone else p.text, p.text if alone else None)
    return found


def set_page_stats(db: Database, stats: Mapping[int, dict[str, Any]]) -> None:
    """Replace the stats of the pages ``stats`` names (page id -> stats)."""
    P = Page.__table__
    with db.engine.begin() as conn:
        for page_id, value in stats.items():
            conn.execute(update(P).where(P.c.id == page_id).values(stats=value))


def done_documents_with_pages_of_run(db: Database, run_id: int, doc_ids: Collection[int]) -> list[int]:
    """Of ``doc_ids``, the finished documents that run ``run_id`` stored pages of."""
    with db.session() as s:
        return list(s.scalars(select(Page.document_id).where(Page.run_id == run_id, among(Page.document_id, doc_ids))
                              .join(Document, Document.id == Page.document_id)
                              .where(Document.status == DocStatus.DONE).distinct().order_by(Page.document_id)))


def page_row_counts(db: Database) -> dict[tuple[int, int], int]:
    """(document id, page index) -> how many page rows the ledger holds for it (one per decode kept: a re-run adds
    one, a crash must not)."""
    with db.session() as s:
        return {(d, i): n for d, i, n in s.execute(select(Page.document_id, Page.page_index, func.count())
                                                   .group_by(Page.document_id, Page.page_index))}
