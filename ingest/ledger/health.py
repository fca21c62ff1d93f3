"""Trouble with the ledger or the machine (ingest.errors.infrastructure_problem) that a long-running loop waits out.

No file is ever rejected for such trouble. The loop that meets it (the watcher's intake, the worker) says so loudly
in the log, waits with a growing backoff (``BACKOFF_S``, then every ``BACKOFF_S[-1]`` seconds) and tries again; when
a try succeeds it says how long the trouble lasted. Each process keeps a small record of it in a JSON file of its
own, ``<logs>/health/<host>-<pid>.json``: what is wrong, since when, how many tries, the next one, and when it was
over. ``uflash status`` reads these files, so it can say what is wrong even while the database is down.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from loguru import logger

from ingest.errors import infrastructure_problem
from ingest.files import write_atomic
from ingest.ledger.owners import is_gone, this_process

T = TypeVar("T")

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0)  # seconds before the 1st, 2nd, ... retry; then every 15 s
REPEAT_LOG_S = 300.0  # once the backoff is at its longest, the log says "still failing" this often
KEEP_DAYS = 7  # records of processes that are gone are removed after this long
FOLDER = "health"

_lock = threading.Lock()  # the loops of one process share its record file
_loops: dict[Path, dict[str, dict[str, Any]]] = {}


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def _record_path(folder: Path, owner: str) -> Path:
    host, pid = (owner.split(":") + [""])[:2]
    return folder / FOLDER / (re.sub(r"[^A-Za-z0-9._-]", "_", f"{host}-{pid}") + ".json")


@dataclass
class Trouble:
    """The trouble one loop (``loop``: "intake", "worker") of this process is in, if any. ``failed()`` after a try
    that met an infrastructure problem, ``ok()`` after one that worked. Threads of one loop may call both (the
    worker's loop and its checks thread, which stores): each call's state change and record are one step."""

    folder: Path | None  # the logs folder (None: log only, no record)
    loop: str
    backoff: tuple[float, ...] = BACKOFF_S
    tries: int = 0  # failed tries in a row
    since: float | None = None  # when the trouble began (None: no trouble)
    _logged_at: float = field(default=0.0, repr=False)
    _turn: threading.RLock = field(default_factory=threading.RLock, repr=False)

    @property
    def active(self) -> bool:
        return self.since is not None

    def failed(self, problem: str) -> float:
        """Note a failed try: log it, update the record, and return the seconds to wait before the next one."""
        with self._turn:
            return self._failed(problem)

    def _failed(self, problem: str) -> float:
        now = time.time()
        if self.since is None:
            self.since, self.tries = now, 0
        self.tries += 1
        wait = self.backoff[min(self.tries, len(self.backoff)) - 1]
        if self.tries == 1:
            logger.error("{}: {}. Not the fault of any file: nothing is rejected for it, files wait in the inbox and "
                         "work in the ledger; retrying in {:g} s (and with a growing pause after that)",
                         self.loop, problem, wait)
            self._logged_at = now
        elif self.tries <= len(self.backoff) or now - self._logged_at >= REPEAT_LOG_S:
            logger.error("{}: still failing after {} ({} tries): {}; next try in {:g} s", self.loop,
                         _duration(now - self.since), self.tries, problem, wait)
            self._logged_at = now
        self._record({"problem": problem, "since": _iso(self.since), "last_seen": _iso(now), "tries": self.tries,
                      "next_try": _iso(now + wait), "over_at": None})
        return wait

    def retrying(self, what: str, stop: threading.Event | None, action: Callable[[], T]) -> T:
        """``action()``, tried again with this backoff while the ledger or the machine fails (until ``stop``): a
        decoded result is kept and stored once the ledger takes it. Other errors, and the last one when stopped,
        are raised."""
        while True:
            try:
                return action()
            except Exception as e:
                problem = infrastructure_problem(e)
                if problem is None or stop is None or stop.is_set() or stop.wait(self.failed(f"{what}: {problem}")):
                    raise

    def ok(self) -> None:
        """Note a try that worked: if there was trouble, log and record that it is over."""
        with self._turn:
            if self.since is None:
                return
            now = time.time()
            logger.warning("{}: working again after {} of trouble ({} failed tries)", self.loop,
                           _duration(now - self.since), self.tries)
            self._record({"over_at": _iso(now)})
            self.since, self.tries = None, 0

    def _record(self, values: dict[str, Any]) -> None:
        if self.folder is None:
            return
        owner = this_process()
        path = _record_path(self.folder, owner)
        with _lock:
            loops = _loops.setdefault(path, {})
            loops[self.loop] = {**loops.get(self.loop, {}), **values}
            body = {"owner": owner, "updated": _iso(time.time()), "loops": loops}
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(path, json.dumps(body, indent=1) + "\n")
                _prune(path.parent, keep=path)
            except OSError as e:  # the disk this would go to may be the trouble itself: the log has said it
                logger.debug("could not write {}: {}", path, e)


def _prune(folder: Path, keep: Path) -> None:
    """Remove the records of processes that are gone and that have not changed for KEEP_DAYS."""
    cutoff = time.time() - KEEP_DAYS * 86400
    for p in folder.glob("*.json"):
        try:
            if p != keep and p.stat().st_mtime < cutoff and is_gone(json.loads(p.read_text("utf-8")).get("owner")):
                p.unlink()
        except (OSError, ValueError):
            continue


def read_trouble(logs: Path) -> list[dict[str, Any]]:
    """Every loop's record under ``logs``, newest first: owner, loop, problem, since, last_seen, tries, next_try,
    over_at (None while it lasts) and owner_gone."""
    out = []
    for p in sorted((logs / FOLDER).glob("*.json")) if (logs / FOLDER).is_dir() else []:
        try:
            body = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        owner = body.get("owner")
        gone = is_gone(owner)
        for loop, rec in (body.get("loops") or {}).items():
            out.append({"owner": owner, "loop": loop, "owner_gone": gone, **rec})
    return sorted(out, key=lambda r: r.get("last_seen") or "", reverse=True)


def format_trouble(records: list[dict[str, Any]]) -> list[str]:
    """Status lines: every trouble that lasts (loudly), and the last one that is over (or whose process ended
    before it was over)."""
    lines, past = [], []
    for r in records:
        if r.get("over_at") is None and not r["owner_gone"]:
            lines.append(f"TROUBLE:   {r['loop']} of {r['owner']} since {(r.get('since') or '?')[:19]} "
                         f"({r.get('tries')} tries, next {(r.get('next_try') or '?')[11:19]}): {r.get('problem')}")
        else:
            past.append(r)
    if past:
        r = max(past, key=lambda r: r.get("over_at") or r.get("last_seen") or "")
        until = f"to {r['over_at'][:19]}" if r.get("over_at") else \
            f"until its process ended (last seen {(r.get('last_seen') or '?')[:19]})"
        lines.append(f"last infrastructure error: {r['loop']} of {r['owner']}, {(r.get('since') or '?')[:19]} "
                     f"{until} ({r.get('tries')} failed tries): {r.get('problem')}")
    return lines


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else \
        f"{seconds / 3600:.1f} h"
