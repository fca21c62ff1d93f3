"""The exit codes and the typed errors. The CLI (ingest.commands.cli.main) maps each error to its exit code, at that
one edge.

An error of the ledger or of the machine (``infrastructure_problem``) is told apart from a problem of a file here, in
one place: nothing is ever rejected or failed for the former.
"""

from __future__ import annotations

import errno
from enum import IntEnum

from db.session import ledger_error


class ExitCode(IntEnum):
    OK = 0
    UNEXPECTED = 1  # see the log
    CONFIG = 2  # configuration or usage error (a folder that cannot be used included)
    MODEL = 3  # the model is not available
    INPUT = 4  # a file was refused, or a document failed
    INFRASTRUCTURE = 5  # the ledger or the machine failed
    INTERRUPTED = 130  # stopped (Ctrl+C, SIGTERM) before the work was done
    PIPE_CLOSED = 141  # the reader of the output went away (`uflash report | head`)


class UflashError(Exception):
    """Base class: a failure we expected and can explain in one line."""


class ConfigError(UflashError):
    """The configuration file or environment is wrong (bad type, unknown key, looping folders)."""


class UsageError(UflashError):
    """The command line asks for something that cannot be done."""


class ModelUnavailable(UflashError):
    """The model cannot be loaded: no chunk can run until the configuration or the files are fixed."""


class InputRejected(UflashError):
    """A dropped file cannot be processed; ``reason`` is recorded and shown to the user."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class InputIncomplete(InputRejected):
    """The file looks cut short (a PDF without its end marker, a truncated image): a slow copy may still be
    writing it. The watcher leaves it in the inbox and looks again until ``watch.incomplete_grace_seconds`` after
    its last change; only then is it rejected."""


class InfrastructureError(UflashError):
    """The ledger (database) or the machine (disk full, I/O error) failed: not the fault of any file. Nothing is
    rejected for it; a long-running command retries with backoff, a one-shot command stops."""


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
    if isinstance(e, InfrastructureError):
        return str(e)
    if (problem := ledger_error(e)) is not None:
        return problem
    if isinstance(e, OSError) and e.errno in MACHINE_ERRNOS:
        where = f" ({e.filename})" if e.filename else ""
        return f"the machine failed: {e.strerror or e}{where}"[:500]
    return None  # a MemoryError too: a file can cause it (an image bomb), so it stays the file's

