"""What people did to pages on the review page (``uflash review``): corrections, undos, pages marked checked. Each act
is a row of ``page_reviews`` (db.models.PageReview), written here and nowhere else, never changed afterwards: the
history of a page is its rows in order. The model's readings (``pages``) are never touched.

A page's **reading** is its latest correction, unless an undo came after it (then the model's latest reading, as
db.pages.latest_pages decides it); it is **checked** when its latest checked/unchecked row says checked.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select

from db.models import Page, PageReview, ReviewKind
from db.session import Database, among

READING = (ReviewKind.CORRECTED, ReviewKind.UNDONE)
CHECK = (ReviewKind.CHECKED, ReviewKind.UNCHECKED)


@dataclass
class PageState:
    """A page's review state: its standing correction (None: the model's reading stands) and whether it is checked."""

    correction: PageReview | None = None
    checked_at: datetime | None = None

    @property
    def checked(self) -> bool:
        return self.checked_at is not None


def record_review(db: Database, page: Page, kind: ReviewKind, text: str | None = None, diff: list[Any] | None = None,
                  cer: float | None = None, by: str = "person") -> int:
    """Record one act of a person on the page whose model reading ``page`` is (the one they saw); its id."""
    R = PageReview.__table__
    with db.engine.begin() as conn:
        return conn.execute(R.insert().values(document_id=page.document_id, page_index=page.page_index,
                                              page_id=page.id, kind=kind, text=text, diff=diff, cer=cer, by=by)
                            .returning(R.c.id)).scalar_one()


def page_states(db: Database, doc_ids: Collection[int]) -> dict[tuple[int, int], PageState]:
    """(document id, page index) -> its review state, for every reviewed page of these documents."""
    out: dict[tuple[int, int], PageState] = {}
    if not doc_ids:
        return out
    with db.session() as s:
        rows = s.scalars(select(PageReview).where(among(PageReview.document_id, doc_ids)).order_by(PageReview.id))
        for r in rows:
            state = out.setdefault((r.document_id, r.page_index), PageState())
            if r.kind in READING:
                state.correction = r if r.kind == ReviewKind.CORRECTED else None
            else:
                state.checked_at = r.created_at if r.kind == ReviewKind.CHECKED else None
    return out


def page_history(db: Database, doc_id: int, page_index: int) -> list[PageReview]:
    """Every act on one page, oldest first."""
    with db.session() as s:
        return list(s.scalars(select(PageReview).where(PageReview.document_id == doc_id,
                                                       PageReview.page_index == page_index).order_by(PageReview.id)))


def standing_corrections(db: Database) -> list[tuple[PageReview, Page]]:
    """Every page's standing correction with the model's reading it corrects, by document and page index."""
    states = {}
    with db.session() as s:
        for r in s.scalars(select(PageReview).where(PageReview.kind.in_(READING)).order_by(PageReview.id)):
            states[(r.document_id, r.page_index)] = r if r.kind == ReviewKind.CORRECTED else None
        standing = [r for _, r in sorted(states.items()) if r is not None]
        pages = {p.id: p for p in s.scalars(select(Page).where(among(Page.id, {r.page_id for r in standing})))} \
            if standing else {}
    return [(r, pages[r.page_id]) for r in standing]
