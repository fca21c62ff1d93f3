"""Database engine and schema.

SQLite (the default) runs in WAL mode with a busy timeout, and every transaction starts with
``BEGIN IMMEDIATE``: a writer takes the write lock up front instead of failing half-way with
"database is locked" when two processes race. Transactions are kept short (a claim is one statement).

Schema versioning is a documented version table (``schema_version``): ``SCHEMA_VERSION`` is the version
this code writes; ``MIGRATIONS[v]`` upgrades a database at version ``v - 1`` to ``v``. ``open_db`` creates
a new database at the current version, migrates an older one in order, and refuses a newer one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    bindparam,
    create_engine,
    event,
    func,
    inspect,
    make_url,
    select,
    text,
    update,
)
from sqlalchemy.orm import Session, sessionmaker

from db.models import Base, PageReview, Run, RunEnd, SchemaVersion

SCHEMA_VERSION = 6


def _v2_run_owner_and_end(conn: Connection) -> None:
    """runs.owner (was only in runs.settings) and runs.end_reason: a run left open by a process that died can be
    found and closed as crashed. Runs already finished were closed by their own process."""
    conn.execute(text("ALTER TABLE runs ADD COLUMN owner VARCHAR(255)"))
    conn.execute(text("ALTER TABLE runs ADD COLUMN end_reason VARCHAR(16)"))
    runs = Run.__table__
    for rid, settings, finished in conn.execute(select(runs.c.id, runs.c.settings, runs.c.finished_at)).all():
        conn.execute(update(runs).where(runs.c.id == rid).values(
            owner=(settings or {}).get("owner"), end_reason=RunEnd.CLOSED if finished is not None else None))


def _v3_64_bit_sizes_and_mtimes(conn: Connection) -> None:
    """File sizes and nanosecond mtimes as 64-bit integers. PostgreSQL enforced the 32-bit INTEGER they were declared
    with (an mtime in nanoseconds is ~1.8e18: no file could be taken in); SQLite's INTEGER is 64-bit already, so there
    nothing changes but the version."""
    if conn.dialect.name == "sqlite":
        return
    for table, columns in (("documents", ("size_bytes", "mtime_ns")), ("duplicates", ("size_bytes", "mtime_ns")),
                           ("rejected_files", ("size_bytes",))):
        conn.execute(text(f"ALTER TABLE {table} " + ", ".join(f"ALTER COLUMN {c} TYPE BIGINT" for c in columns)))


def _v4_batch_limits_and_failed_paths(conn: Connection) -> None:
    """chunks.batch_limit and chunks.solo_crashes (a worker that died with chunks in flight: db.queue), and
    documents.failed_path (where a failed document's original lies: ingest.intake.failed). Chunks get no limit, and
    documents failed before keep their originals where they are (their failed_path is set to it). A column already
    there is left as it is."""
    have = {t: {c["name"] for c in inspect(conn).get_columns(t)} for t in ("chunks", "documents")}
    for table, column, kind in (("chunks", "batch_limit", "INTEGER"),
                                ("chunks", "solo_crashes", "INTEGER NOT NULL DEFAULT 0"),
                                ("documents", "failed_path", "TEXT")):
        if column not in have[table]:
            conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} {kind}"))
    conn.execute(text("UPDATE documents SET failed_path = COALESCE(archived_path, original_path) "
                      "WHERE status = 'failed' AND failed_path IS NULL"))


def _v5_runs_of_refusals_and_duplicates(conn: Connection) -> None:
    """duplicates.run_id and rejected_files.run_id (the run that took the file in: its report names the file), with
    their indexes, and rejected_files.retried_at (`uflash retry` put the file back into the inbox). Files recorded
    before keep no run, and a refused file is not retried. A column or an index already there is left as it is."""
    stamp = "DATETIME" if conn.dialect.name == "sqlite" else "TIMESTAMP WITH TIME ZONE"
    tables = ("duplicates", "rejected_files")
    have = {t: {c["name"] for c in inspect(conn).get_columns(t)} for t in tables}
    indexes = {t: {i["name"] for i in inspect(conn).get_indexes(t)} for t in tables}
    for table, column, kind in (("duplicates", "run_id", "INTEGER REFERENCES runs (id)"),
                                ("rejected_files", "run_id", "INTEGER REFERENCES runs (id)"),
                                ("rejected_files", "retried_at", stamp)):
        if column not in have[table]:
            conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} {kind}"))
    for table in tables:
        if f"ix_{table}_run_id" not in indexes[table]:
            conn.execute(text(f"CREATE INDEX ix_{table}_run_id ON {table} (run_id)"))


def _v6_page_reviews(conn: Connection) -> None:
    """page_reviews: what a person did to a page on the review page (a correction, an undo, checked), one row per act
    (db.reviews). No page has been reviewed before. A table already there is left as it is."""
    Base.metadata.create_all(conn, tables=[PageReview.__table__])


# version -> function(connection) that upgrades from version-1. Add an entry with every schema change.
MIGRATIONS: dict[int, Callable[[Connection], None]] = {2: _v2_run_owner_and_end, 3: _v3_64_bit_sizes_and_mtimes,
                                                       4: _v4_batch_limits_and_failed_paths,
                                                       5: _v5_runs_of_refusals_and_duplicates, 6: _v6_page_reviews}


class SchemaTooNew(RuntimeError):
    """The ledger was written by a newer uflash."""


class LedgerUrlError(ValueError):
    """``database.url`` cannot work: not a database URL, or its driver is not installed (``driver`` names it)."""

    def __init__(self, message: str, driver: str | None = None):
        super().__init__(message)
        self.driver = driver


def among(column: ColumnElement, ids: Collection[int]) -> ColumnElement:
    """``column IN (ids)`` with the ids written into the SQL rather than bound one parameter each, so that a
    `uflash run` of a folder of many thousand files stays under SQLite's and PostgreSQL's parameter limits."""
    return column.in_(bindparam("ids", sorted(ids), expanding=True, literal_execute=True, unique=True))


def masked_url(url: str) -> str:
    """The database URL without its password (for logs and screens)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url


def ledger_error(e: BaseException) -> str | None:
    """One line saying what failed when ``e`` is an error of the database layer (SQLAlchemy's or a driver's: the
    ledger unreachable, locked past its timeout, a value refused, the disk full under it), else None."""
    import sqlite3

    from sqlalchemy.exc import SQLAlchemyError

    drivers: list[type[BaseException]] = [sqlite3.Error]
    try:
        import psycopg

        drivers.append(psycopg.Error)
    except ImportError:
        pass
    if not isinstance(e, (SQLAlchemyError, *drivers)):
        return None
    orig = getattr(e, "orig", None) or e
    first = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
    return f"the ledger failed: {type(orig).__name__}: {first}"[:500]


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def json_dumps(value: Any) -> str:
    """JSON for the ledger, the same on every backend: NaN and infinity (which PostgreSQL's JSON refuses) as null."""
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(value), allow_nan=False)


def make_engine(url: str, busy_timeout_ms: int = 30_000) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("sqlite:///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": busy_timeout_ms / 1000}, json_serializer=json_dumps)

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):  # noqa: ANN001
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn):  # noqa: ANN001
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    # a server that went away is seen within seconds, not after the system's TCP timeouts (minutes to hours);
    # a pooled connection it dropped is replaced before use (pre-ping)
    connect_args = {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10,
                    "keepalives_count": 3} if make_url(url).get_driver_name() in ("psycopg", "psycopg2") else {}
    return create_engine(url, pool_pre_ping=True, json_serializer=json_dumps, connect_args=connect_args)


def open_engine(url: str, busy_timeout_ms: int = 30_000) -> Engine:
    """``make_engine``, with a URL that cannot work (bad URL, driver not installed) raised as ``LedgerUrlError``."""
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        return make_engine(url, busy_timeout_ms)
    except ImportError as e:
        raise LedgerUrlError(f"database.url {masked_url(url)} needs a database driver that is not installed "
                             f"({e.name}): pip install -e \".[postgres]\"", e.name) from None
    except (ArgumentError, NoSuchModuleError) as e:
        raise LedgerUrlError(f"database.url {masked_url(url)} is not a usable database URL: {e}") from None


def schema_version(conn: Connection) -> int | None:
    """The schema version of the ledger on ``conn``, or None when it has no uflash tables yet."""
    if not conn.dialect.has_table(conn, SchemaVersion.__tablename__):
        return None
    return conn.execute(select(func.max(SchemaVersion.version))).scalar()


def init_schema(engine: Engine) -> int:
    """Create or migrate the schema; returns the version now in force."""
    with engine.begin() as conn:
        current = schema_version(conn)
        if current is None:
            Base.metadata.create_all(conn)
            conn.execute(SchemaVersion.__table__.insert().values(version=SCHEMA_VERSION))
            return SCHEMA_VERSION
        if current > SCHEMA_VERSION:
            raise SchemaTooNew(
                f"database schema version {current} is newer than this uflash ({SCHEMA_VERSION}); upgrade uflash"
            )
        for v in range(current + 1, SCHEMA_VERSION + 1):
            MIGRATIONS[v](conn)
            conn.execute(SchemaVersion.__table__.insert().values(version=v))
        return SCHEMA_VERSION


class Database:
    """An engine plus a session factory; the one handle the rest of uflash passes around. A URL that cannot work
    raises ``LedgerUrlError``, a ledger of a newer uflash ``SchemaTooNew``; an unreachable server raises what the
    database layer raised (``ledger_error`` describes it)."""

    def __init__(self, url: str, busy_timeout_ms: int = 30_000, create: bool = True):
        self.url = url
        self.engine = open_engine(url, busy_timeout_ms)
        if create:
            init_schema(self.engine)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def session(self) -> Session:
        return self.sessions()

    def dispose(self) -> None:
        self.engine.dispose()
