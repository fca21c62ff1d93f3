"""Watch the inbox: file events (watchdog) plus a periodic full rescan, then intake of settled files.

A file is taken only when its size and mtime have not changed for ``settle_seconds`` and it can be
opened exclusively. One that still looks cut short then (a network copy that stalled longer than the settle
time) stays in the inbox and is looked at again (every ``RECHECK_SECONDS`` at most) until
``incomplete_grace_seconds`` after its last change. Every failure is contained to its file: the watcher logs
it and goes on. Folders inside the inbox and hidden or temporary names are not taken; each is named once in the
log, so nothing is ignored unseen.

An error of the ledger or of the machine (ingest.errors.infrastructure_problem: the database unreachable or locked,
a disk full) is not the file's fault: the file stays in the inbox untouched and is not counted against it, and the
watcher pauses its intake with a growing backoff (ingest.ledger.health), saying so loudly, until a try works again.
Only errors of the file itself, ``MAX_ERRORS`` times, get it refused.
"""

from __future__ import annotations

import fnmatch
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.polling import PollingObserver

from db.session import Database
from ingest.config import Settings
from ingest.errors import infrastructure_problem
from ingest.files import can_open_exclusively, is_ignored_name
from ingest.intake.enqueue import Intake, IntakeResult, IntakeRun, intake_file, reject
from ingest.ledger.health import Trouble


@dataclass
class _Candidate:
    size: int
    mtime_ns: int
    stable_since: float
    errors: int = 0
    not_before: float = 0.0  # an incomplete file: not looked at again before this (monotonic)


class _Events(FileSystemEventHandler):
    def __init__(self, q: queue.SimpleQueue[Path]):
        self.q = q

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.is_directory:
            return
        for p in (getattr(event, "dest_path", None), event.src_path):
            if p:
                self.q.put(Path(p))


@dataclass
class InboxWatcher:
    settings: Settings
    db: Database
    on_result: object = None  # optional callable(Path, IntakeResult), for the CLI's counters
    intake_run: IntakeRun | None = None  # the run refused files and duplicates are recorded in (the worker's)
    _pending: dict[Path, _Candidate] = field(default_factory=dict)
    _events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _last_rescan: float = 0.0
    _told: set = field(default_factory=set)  # paths already named in the log as skipped or incomplete
    trouble: Trouble | None = None  # the ledger's or the machine's trouble, if any (made from the settings)
    _paused_until: float = 0.0  # no intake before this (monotonic): backing off from that trouble

    MAX_ERRORS = 5
    RECHECK_SECONDS = 30.0

    def __post_init__(self) -> None:
        if self.trouble is None:
            self.trouble = Trouble(self.settings.logs, "intake")

    @property
    def inbox(self) -> Path:
        return self.settings.inbox

    def wanted(self, path: Path) -> bool:
        """Files the watcher considers: anything directly in the inbox except temp/side files.
        Names outside ``patterns`` are still taken, and rejected with a reason (nothing vanishes silently)."""
        return path.parent == self.inbox and not is_ignored_name(path.name)

    def matches_patterns(self, path: Path) -> bool:
        return any(fnmatch.fnmatch(path.name.lower(), pat.lower()) for pat in self.settings.watch.patterns)

    def rescan(self) -> None:
        self._last_rescan = time.monotonic()
        try:
            for p in self.inbox.iterdir():
                if p.is_file():
                    self._note(p)
                elif p.is_dir() and not is_ignored_name(p.name):
                    self._tell_once(p, f"folder {p.name} in the inbox is not looked into: uflash takes the files "
                                       "placed directly in the inbox (move them up one level)")
        except OSError as e:
            logger.error("cannot list inbox {}: {}", self.inbox, e)

    def _tell_once(self, path: Path, message: str, level: str = "WARNING") -> None:
        if path not in self._told:
            self._told.add(path)
            logger.log(level, "{}", message)

    def _note(self, path: Path) -> None:
        if path.parent == self.inbox and is_ignored_name(path.name) and path.is_file():
            self._tell_once(path, f"{path.name} in the inbox is not taken: its name marks a hidden or temporary "
                                  "file (one being copied is taken under its final name)", "INFO")
        if not self.wanted(path) or path in self._pending:
            return
        try:
            st = path.stat()
        except OSError:
            return
        self._pending[path] = _Candidate(st.st_size, st.st_mtime_ns, time.monotonic())

    def _drain_events(self) -> None:
        while True:
            try:
                p = self._events.get_nowait()
            except queue.Empty:
                return
            self._note(p.absolute())

    def settled(self) -> list[Path]:
        """Pending files whose size and mtime held still for the settle time (and that can be opened)."""
        now, ready = time.monotonic(), []
        for path, c in list(self._pending.items()):
            try:
                st = path.stat()
            except OSError:  # gone (moved away, or renamed: the rename's event brings the new name)
                del self._pending[path]
                continue
            if (st.st_size, st.st_mtime_ns) != (c.size, c.mtime_ns):
                c.size, c.mtime_ns, c.stable_since, c.not_before = st.st_size, st.st_mtime_ns, now, 0.0
                continue
            if now < c.not_before:
                continue
            if now - c.stable_since >= self.settings.watch.settle_seconds and can_open_exclusively(path):
                ready.append(path)
        return sorted(ready, key=lambda p: (self._pending[p].stable_since, p.name))

    def take(self, path: Path) -> IntakeResult | None:
        """Intake one settled file; any unexpected error is contained and retried a few times. An error of the ledger
        or of the machine is not counted against the file: it waits in the inbox while the intake backs off."""
        c = self._pending[path]
        try:
            if not self.matches_patterns(path):
                pats = ", ".join(self.settings.watch.patterns)
                res = reject(self.db, self.settings, path,
                             f"unsupported file type '{path.suffix or '(no extension)'}': watch.patterns takes {pats}",
                             run=self.intake_run)
            else:
                res = intake_file(self.db, self.settings, path, self.settings.watch.incomplete_grace_seconds,
                                  run=self.intake_run)
        except Exception as e:  # never let one file stop the watcher
            if self._infrastructure(path, e):
                return None
            if isinstance(e, FileNotFoundError) and not path.exists():  # moved away meanwhile (archived once done)
                del self._pending[path]
                return None
            c.errors += 1
            c.stable_since = time.monotonic()
            logger.opt(exception=c.errors == 1).error("intake of {} failed ({}x): {}", path.name, c.errors, e)
            if c.errors >= self.MAX_ERRORS:
                try:
                    res = reject(self.db, self.settings, path, f"intake failed {c.errors} times: {e}",
                                 run=self.intake_run)
                except Exception as e2:
                    if self._infrastructure(path, e2):
                        return None
                    logger.error("cannot reject {} either: {}; will retry at the next rescan", path.name, e2)
                    del self._pending[path]
                    return None
            else:
                return None
        if res.outcome not in (Intake.KNOWN, Intake.INCOMPLETE):  # the ledger took a write: any trouble with it is over
            self.trouble.ok()
        if res.outcome == Intake.INCOMPLETE:  # left in the inbox: look again later (or sooner, if it changes)
            grace = self.settings.watch.incomplete_grace_seconds
            c.not_before = time.monotonic() + min(self.RECHECK_SECONDS, max(self.settings.watch.settle_seconds, grace))
            self._tell_once(path, f"{path.name} looks incomplete, waiting for the rest of it: {res.reason} "
                                  f"(refused if still so {grace:.0f} s after its last change)")
            return None
        del self._pending[path]
        if callable(self.on_result):
            self.on_result(path, res)
        return res

    def _infrastructure(self, path: Path, e: BaseException) -> bool:
        """True when ``e`` is the ledger's or the machine's trouble: the file stays pending (tried after the others
        that are ready), and intake pauses for the backoff."""
        problem = infrastructure_problem(e)
        if problem is None:
            return False
        if path in self._pending:
            self._pending[path].stable_since = time.monotonic()
        self._paused_until = time.monotonic() + self.trouble.failed(f"cannot take {path.name} in: {problem}")
        return True

    def poll(self) -> list[IntakeResult]:
        """One tick: events, rescan when due, intake of every settled file (none while backing off from trouble with
        the ledger or the machine)."""
        self._drain_events()
        if time.monotonic() - self._last_rescan >= self.settings.watch.rescan_seconds:
            self.rescan()
        results = []
        for p in self.settled():
            if time.monotonic() < self._paused_until:
                break
            if (r := self.take(p)) is not None:
                results.append(r)
        return results

    def start_observer(self):  # noqa: ANN201
        obs = PollingObserver(timeout=1.0) if self.settings.watch.polling else Observer()
        obs.schedule(_Events(self._events), str(self.inbox), recursive=False)
        obs.daemon = True
        obs.start()
        return obs

    def run(self, stop: threading.Event, tick: float = 0.5) -> None:
        """Watch until ``stop`` is set. The observer failing to start falls back to rescans alone."""
        self.inbox.mkdir(parents=True, exist_ok=True)
        try:
            obs = self.start_observer()
        except Exception as e:
            logger.warning("file events unavailable ({}); relying on rescans every {}s", e,
                           self.settings.watch.rescan_seconds)
            obs = None
        self.rescan()
        logger.info("watching {} (settle {}s, rescan every {}s, {})", self.inbox, self.settings.watch.settle_seconds,
                    self.settings.watch.rescan_seconds, "polling" if self.settings.watch.polling else "events")
        try:
            while not stop.is_set():
                self.poll()
                stop.wait(tick)
        finally:
            if obs is not None:
                obs.stop()
                obs.join(timeout=5)
