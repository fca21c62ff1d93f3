"""Typed errors. Each carries the exit code the CLI maps it to, at one edge (ingest.cli.main)."""

from __future__ import annotations

import errno


class UflashError(Exception):
    """Base class: a failure we expected and can explain in one line."""

    exit_code = 1


class ConfigError(UflashError):
    """The configuration file or environment is wrong (bad type, unknown key, looping folders)."""

    exit_code = 2


class UsageError(UflashError):
    """The command line asks for something that cannot be done."""

    exit_code = 2


class InputRejected(UflashError):
    """A dropped file cannot be processed; ``reason`` is recorded and shown to the user."""

    exit_code = 4

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class InputIncomplete(InputRejected):
    """The file looks cut short (a PDF without its end marker, a truncated image): a slow copy may still be
    writing it. The watcher leaves it in the inbox and looks again until ``watch.incomplete_grace_seconds`` after
    its last change; only then is it rejected."""


class InfrastructureError(UflashError):
    """The ledger (database) or the machine (disk full, I/O error) failed: not the fault of any file. Nothing is
    rejected for it; a long-running command retries with backoff, a one-shot command stops with this code."""

    exit_code = 5


# errors of the machine: a full disk or quota, a failing or read-only disk, no memory or file handles left, a network
# share or server that went away. Other OSErrors (a file gone, access denied, a name refused) belong to the file.
MACHINE_ERRNOS = frozenset(getattr(errno, name) for name in (
    "ENOSPC", "EDQUOT", "EIO", "EROFS", "ENOMEM", "ENFILE", "EMFILE", "ESTALE", "ENOTCONN", "ECONNRESET",
    "ECONNREFUSED", "ECONNABORTED", "EHOSTDOWN", "EHOSTUNREACH", "ENETDOWN", "ENETUNREACH", "ETIMEDOUT",
) if hasattr(errno, name))


def infrastructure_problem(e: BaseException) -> str | None:
    """One line saying what is wrong when ``e`` is an error of the ledger or of the machine, else None (a problem of
    the file itself, or of uflash). The one place that tells the two apart: every error of the database layer is the
    ledger's (unreachable, locked past its timeout, a value out of range, disk full under it), never the file's."""
    import sqlalchemy.exc

    if isinstance(e, InfrastructureError):
        return str(e)
    if isinstance(e, (sqlalchemy.exc.SQLAlchemyError, _dbapi_errors())):
        orig = getattr(e, "orig", None) or e
        first = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
        return f"the ledger failed: {type(orig).__name__}: {first}"[:500]
    if isinstance(e, OSError) and e.errno in MACHINE_ERRNOS:
        where = f" ({e.filename})" if e.filename else ""
        return f"the machine failed: {e.strerror or e}{where}"[:500]
    return None  # a MemoryError too: a file can cause it (an image bomb), so it stays the file's


def _dbapi_errors() -> tuple[type[BaseException], ...]:
    """The database drivers' own error classes, for an error that escaped SQLAlchemy's wrapping."""
    import sqlite3

    found: list[type[BaseException]] = [sqlite3.Error]
    try:
        import psycopg

        found.append(psycopg.Error)
    except ImportError:
        pass
    return tuple(found)
