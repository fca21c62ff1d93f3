"""The job ledger's tables (SQLAlchemy 2).

A document is one dropped file, keyed by its content SHA-256. Its pages are split into chunks (the unit of
work a worker claims). A run is one pass of a model/mode over chunks; pages are stored per run, so a
re-run keeps the history. Lease and retry times are UNIX seconds (float) so that comparisons are plain
arithmetic on every backend.

Every column holds what it stores on SQLite and on PostgreSQL alike (PostgreSQL enforces declared types, SQLite does
not): file sizes (over 2 GiB) and nanosecond mtimes are 64-bit (``BigInteger``); ids, page numbers, page counts and
attempts are 32-bit (``Integer``, up to 2**31 - 1); token counts and figures live in JSON; times are ``DateTime`` with
the zone (UNIX seconds as double precision for leases); text that may come from a page (its text, its PDF text layer)
or from an error message is ``CleanText``, which drops NUL characters (PostgreSQL text cannot hold them), and JSON is
written without NaN or infinity (PostgreSQL's JSON refuses them; ``db.session`` writes them as null).
"""

from __future__ import annotations

from datetime import datetime, timezone
from enum import StrEnum
from typing import Any

from sqlalchemy import JSON, BigInteger, Enum, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import DateTime, TypeDecorator


class CleanText(TypeDecorator):
    """Text without NUL characters: PostgreSQL refuses them in text (a broken PDF text layer can hold some), so they
    are dropped on every backend, and both store the same."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        return value.replace("\x00", "") if isinstance(value, str) else value


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    type_annotation_map = {datetime: DateTime(timezone=True), dict[str, Any]: JSON, list[Any]: JSON}


class DocStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class ChunkStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    SPLIT = "split"  # output hit the context limit; the remaining pages went to a new chunk
    CANCELLED = "cancelled"  # reserved for a re-run that ended (stopped or crashed) before decoding it


def status_column(enum: type[StrEnum]) -> Enum:
    """A status column: stored as its value in a VARCHAR(16) (no database enum type, no constraint: the schema is
    the same as plain strings), read back as the enum member."""
    return Enum(enum, native_enum=False, create_constraint=False, length=16,
                values_callable=lambda members: [m.value for m in members])


class SchemaVersion(Base):
    __tablename__ = "schema_version"
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    applied_at: Mapped[datetime] = mapped_column(default=utcnow)


class Document(Base):
    __tablename__ = "documents"
    id: Mapped[int] = mapped_column(primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    original_path: Mapped[str] = mapped_column(Text, index=True)
    original_name: Mapped[str] = mapped_column(String(512))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    mtime_ns: Mapped[int] = mapped_column(BigInteger)  # st_mtime_ns: ~1.8e18, beyond 32 bits
    kind: Mapped[str] = mapped_column(String(16))  # pdf | tiff | png | jpeg
    page_count: Mapped[int] = mapped_column(Integer)
    status: Mapped[DocStatus] = mapped_column(status_column(DocStatus), default=DocStatus.QUEUED, index=True)
    error: Mapped[str | None] = mapped_column(CleanText, default=None)
    archived_path: Mapped[str | None] = mapped_column(Text, default=None)
    # while failed: where its original lies (in failed/, beside <name>.error.txt; or where it stayed, when it could
    # not be put there; "" when it was not found); None while it is not failed, or not yet filed (ingest.intake.failed)
    failed_path: Mapped[str | None] = mapped_column(Text, default=None)
    output_dir: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    completed_at: Mapped[datetime | None] = mapped_column(default=None)

    chunks: Mapped[list[Chunk]] = relationship(back_populates="document", order_by="Chunk.first_page")
    duplicates: Mapped[list[Duplicate]] = relationship(back_populates="document")


class Duplicate(Base):
    """A file whose content equals an existing document's: recorded, not processed again; ``run_id``: the run that
    took it in (None: taken in by a watcher that decodes nothing, ``uflash watch --intake-only``)."""

    __tablename__ = "duplicates"
    id: Mapped[int] = mapped_column(primary_key=True)
    document_id: Mapped[int] = mapped_column(ForeignKey("documents.id"), index=True)
    path: Mapped[str] = mapped_column(Text)
    name: Mapped[str] = mapped_column(String(512))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    mtime_ns: Mapped[int] = mapped_column(BigInteger)
    moved_to: Mapped[str | None] = mapped_column(Text, default=None)
    seen_at: Mapped[datetime] = mapped_column(default=utcnow)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id"), default=None, index=True)

    document: Mapped[Document] = relationship(back_populates="duplicates")


class Rejected(Base):
    """A dropped file that cannot be processed, with its reason and where it was moved (in failed/, beside its
    ``.error.txt``); ``run_id``: the run that took it in (None as for a duplicate); ``retried_at``: when ``uflash
    retry`` put it back into the inbox, to be taken in again (refused again only if it still cannot be processed)."""

    __tablename__ = "rejected_files"
    id: Mapped[int] = mapped_column(primary_key=True)
    path: Mapped[str] = mapped_column(Text)
    name: Mapped[str] = mapped_column(String(512))
    sha256: Mapped[str | None] = mapped_column(String(64), default=None, index=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    reason: Mapped[str] = mapped_column(CleanText)
    moved_to: Mapped[str | None] = mapped_column(Text, default=None)
    seen_at: Mapped[datetime] = mapped_column(default=utcnow)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id"), default=None, index=True)
    retried_at: Mapped[datetime | None] = mapped_column(default=None)


class RunEnd(StrEnum):
    CLOSED = "closed"  # closed by its own process (done, or stopped by a signal)
    CRASHED = "crashed"  # closed by a later uflash process that found its owner gone


class Run(Base):
    """One pass of a model in one mode; pages point at the run that produced them. Open while ``finished_at`` is
    None; ``end_reason`` (RunEnd) says how it was closed."""

    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(primary_key=True)
    mode: Mapped[str] = mapped_column(String(16))
    model: Mapped[str] = mapped_column(Text)
    engine_version: Mapped[str] = mapped_column(String(32))
    host: Mapped[str | None] = mapped_column(String(255), default=None)
    owner: Mapped[str | None] = mapped_column(String(255), default=None)  # host:pid:started (ingest.ledger.owners)
    settings: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    end_reason: Mapped[RunEnd | None] = mapped_column(status_column(RunEnd), default=None)


class Chunk(Base):
    __tablename__ = "chunks"
    __table_args__ = (Index("ix_chunks_claim", "status", "next_attempt_at"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    document_id: Mapped[int] = mapped_column(ForeignKey("documents.id"), index=True)
    first_page: Mapped[int] = mapped_column(Integer)  # 1-based, inclusive
    last_page: Mapped[int] = mapped_column(Integer)  # 1-based, inclusive
    status: Mapped[ChunkStatus] = mapped_column(status_column(ChunkStatus), default=ChunkStatus.QUEUED)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # at most this many chunks decode beside it in one worker, itself included (None: no limit); set when a worker
    # died with it in flight (db.queue says how)
    batch_limit: Mapped[int | None] = mapped_column(Integer, default=None)
    solo_crashes: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # its worker died; it alone
    lease_owner: Mapped[str | None] = mapped_column(String(255), default=None)
    lease_expires_at: Mapped[float | None] = mapped_column(Float, default=None)
    next_attempt_at: Mapped[float] = mapped_column(Float, default=0.0)
    last_error: Mapped[str | None] = mapped_column(CleanText, default=None)
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("chunks.id"), default=None)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id"), default=None)
    note: Mapped[str | None] = mapped_column(CleanText, default=None)  # e.g. page-count mismatch
    stats: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    output_ids: Mapped[list[Any] | None] = mapped_column(default=None)  # the decode's token ids (for replay)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    document: Mapped[Document] = relationship(back_populates="chunks")

    @property
    def pages(self) -> range:
        return range(self.first_page, self.last_page + 1)


class Page(Base):
    __tablename__ = "pages"
    __table_args__ = (UniqueConstraint("run_id", "document_id", "page_index"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    document_id: Mapped[int] = mapped_column(ForeignKey("documents.id"), index=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    chunk_id: Mapped[int | None] = mapped_column(ForeignKey("chunks.id"), default=None)
    page_index: Mapped[int] = mapped_column(Integer)  # 1-based
    text: Mapped[str] = mapped_column(CleanText, default="")
    boxes: Mapped[list[Any]] = mapped_column(default=list)
    stats: Mapped[dict[str, Any]] = mapped_column(default=dict)
    text_layer: Mapped[str | None] = mapped_column(CleanText, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ReviewKind(StrEnum):
    CORRECTED = "corrected"  # a person's reading of the page (``text``)
    UNDONE = "undone"  # back to the model's reading
    CHECKED = "checked"  # a person looked at the page and marked it checked
    UNCHECKED = "unchecked"


class PageReview(Base):
    """What a person did to a page on the review page (``uflash review``), one row per act, never changed: a reading of
    the page marked as a person's (``corrected``, with its ``text``), a return to the model's reading (``undone``), a
    page marked checked or not. ``page_id``: the model's reading the person saw (the latest stored decode of the page
    then); ``diff``: the words changed against it, ``cer``: its character error rate against the person's reading.
    The model's readings (``pages``) are never touched; what a page shows is its latest correction unless undone
    (db.reviews)."""

    __tablename__ = "page_reviews"
    __table_args__ = (Index("ix_page_reviews_page", "document_id", "page_index"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    document_id: Mapped[int] = mapped_column(ForeignKey("documents.id"))
    page_index: Mapped[int] = mapped_column(Integer)  # 1-based
    page_id: Mapped[int] = mapped_column(ForeignKey("pages.id"))
    kind: Mapped[ReviewKind] = mapped_column(status_column(ReviewKind))
    text: Mapped[str | None] = mapped_column(CleanText, default=None)
    diff: Mapped[list[Any] | None] = mapped_column(default=None)
    cer: Mapped[float | None] = mapped_column(Float, default=None)
    by: Mapped[str] = mapped_column(String(255), default="person")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
