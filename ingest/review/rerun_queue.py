"""Re-runs queued from the review page (``uflash review``): the pages a person picked, one ``uflash rerun --mode
lossless --doc D --pages A-B`` per document and run of pages, started one after another in a process of their own
(the re-run command itself: its run, its report, its rewrite of the outputs, all in the same ledger), so that the
review server stays free while they decode. The queue lives as long as the server; stopping the server lets the
re-run in hand finish and drops those not started (``uflash rerun`` can be run for them by hand)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from loguru import logger


@dataclass
class QueuedRerun:
    doc_id: int
    first: int
    last: int
    state: str = "queued"  # queued | running | done | failed | dropped
    run: int | None = None
    note: str = ""

    @property
    def what(self) -> str:
        pages = f"page {self.first}" if self.first == self.last else f"pages {self.first}-{self.last}"
        return f"document {self.doc_id} {pages}"

    def dict(self) -> dict:
        return {"what": self.what, "state": self.state, "run": self.run, "note": self.note}


def page_ranges(pages: Iterable[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(document, page) pairs as (document, first, last): one per document and run of consecutive pages."""
    out: list[tuple[int, int, int]] = []
    for doc, page in sorted(set(pages)):
        if out and out[-1][0] == doc and out[-1][2] == page - 1:
            out[-1] = (doc, out[-1][1], page)
        else:
            out.append((doc, page, page))
    return out


class RerunQueue:
    """Runs queued re-runs one at a time in a background thread (see the module)."""

    def __init__(self, config_file: Path | None, cwd: Path):
        self.config_file, self.cwd = config_file, cwd
        self.items: list[QueuedRerun] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._serve, name="review-reruns", daemon=True)
        self._thread.start()

    def add(self, pages: Iterable[tuple[int, int]]) -> list[QueuedRerun]:
        new = [QueuedRerun(d, a, b) for d, a, b in page_ranges(pages)]
        with self._lock:
            self.items += new
        self._wake.set()
        return new

    def snapshot(self) -> list[dict]:
        with self._lock:
            return [item.dict() for item in self.items]

    def command(self, item: QueuedRerun) -> list[str]:
        config = ["--config", str(self.config_file)] if self.config_file else []
        return [sys.executable, "-m", "ingest.commands.cli", *config, "rerun", "--mode", "lossless",
                "--doc", str(item.doc_id), "--pages", f"{item.first}-{item.last}"]

    def _next(self) -> QueuedRerun | None:
        with self._lock:
            return next((i for i in self.items if i.state == "queued"), None)

    def _serve(self) -> None:
        while not self._stop.is_set():
            item = self._next()
            if item is None:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            item.state = "running"
            logger.info("re-run of {} started", item.what)
            # a session of its own: Ctrl+C in the server's terminal stops the server, not the re-run in hand
            self._proc = subprocess.Popen(self.command(item), cwd=self.cwd, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
            out, _ = self._proc.communicate()
            run = re.search(r"-> run (\d+)", out or "")
            item.run = int(run.group(1)) if run else None
            item.state = "done" if self._proc.returncode == 0 else "failed"
            if item.state == "failed":
                item.note = (out or "").strip().splitlines()[-1][:300] if (out or "").strip() else \
                    f"exit code {self._proc.returncode}"
            logger.info("re-run of {}: {}{}", item.what, item.state, f" (run {item.run})" if item.run else "")

    def close(self) -> None:
        """Drop the re-runs not started and wait for the one in hand; interrupted while it waits (a second Ctrl+C),
        stop that one with SIGTERM, which lets it finish its chunk and close its run."""
        with self._lock:
            for item in self.items:
                if item.state == "queued":
                    item.state = "dropped"
            running = [item.what for item in self.items if item.state == "running"]
        self._stop.set()
        self._wake.set()
        if running:
            logger.info("waiting for the re-run of {} to finish (Ctrl+C again stops it)", running[0])
        try:
            self._thread.join()
        except KeyboardInterrupt:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.terminate()
            self._thread.join(60)
