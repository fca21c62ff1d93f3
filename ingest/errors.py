"""Typed errors. Each carries the exit code the CLI maps it to, at one edge (ingest.cli.main)."""

from __future__ import annotations


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
