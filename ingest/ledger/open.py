"""Opening the ledger for a command: created or migrated to this uflash's schema, with the database layer's own errors
turned into the typed errors of ingest.errors (a URL that cannot work: ConfigError; a ledger of a newer uflash:
UsageError; an unreachable server: what the database raised, an infrastructure problem)."""

from __future__ import annotations

import threading
from pathlib import Path

from db.session import Database, LedgerUrlError, SchemaTooNew, masked_url
from ingest.config import Settings
from ingest.errors import ConfigError, UsageError, infrastructure_problem
from ingest.ledger.health import Trouble


def open_ledger(settings: Settings) -> Database:
    try:
        return Database(settings.database_url, settings.database.busy_timeout_ms)
    except SchemaTooNew as e:
        raise UsageError(str(e)) from None
    except LedgerUrlError as e:
        raise ConfigError(str(e)) from None


def open_ledger_waiting(settings: Settings, stop: threading.Event) -> Database | None:
    """``open_ledger`` for the long-running watcher: while the ledger cannot be reached (its server not up yet after a
    power cut, the network down), say so loudly and try again with a growing backoff. None when stopped first."""
    trouble = Trouble(settings.logs, "start")
    while not stop.is_set():
        try:
            db = open_ledger(settings)
            trouble.ok()
            return db
        except Exception as e:
            problem = infrastructure_problem(e)
            if problem is None:
                raise
            stop.wait(trouble.failed(f"cannot open the ledger {masked_url(settings.database_url)}: {problem}"))
    return None


def missing_ledger(settings: Settings) -> Path | None:
    """The SQLite ledger file the settings name, when it does not exist: the commands that only read it must not
    create an empty one (a status run from the wrong folder would report an empty ledger, and leave one behind)."""
    url, prefix = settings.database_url, "sqlite:///"
    if url.startswith(prefix) and ":memory:" not in url and not Path(url[len(prefix):]).exists():
        return Path(url[len(prefix):])
    return None


def open_existing_ledger(settings: Settings) -> Database:
    if (missing := missing_ledger(settings)) is not None:
        raise UsageError(f"no ledger at {missing}: nothing has been taken in with this configuration "
                         "(--config or UFLASH_CONFIG names another)")
    return open_ledger(settings)
