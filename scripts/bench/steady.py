"""The pipeline benchmark's steady mode (`scripts.bench.pipeline --steady`): documents keep arriving in the inbox while
``uflash watch`` runs, and the rates are measured over a window after the first wave.

``InboxFeeder`` drops copies of the benchmark's documents into the inbox (each made distinct by its PDF metadata, so
that its content hash is new: the same pages to render and decode, a new document to the ledger) whenever the pages
waiting (the ledger's pending chunks, and the files dropped but not yet taken in) fall under ``backlog`` pages: the
queue never runs dry, as on a long stream.

``steady_window``: the first wave is over once as many chunks have been stored as the engine has rows (by then every
row has, on average, ended its first chunk and taken another); the window runs from there to the last point of the
run. Over it: stored pages an hour, the engine's decoded tokens a second (from its own trace, chunks in flight
included) and pages-equivalent an hour at the stand-in's tokens a page.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from db.overview import ledger_counts
from db.session import Database


def distinct_copy(src: Path, dst: Path, serial: int) -> Path:
    """``src`` saved as ``dst`` with its own metadata title (a new content hash; the pages are the same)."""
    import pymupdf

    tmp = dst.parent.parent / f".{dst.name}.part"  # made outside the inbox, then moved in whole
    with pymupdf.open(src) as doc:
        doc.set_metadata({**(doc.metadata or {}), "title": f"steady copy {serial}"})
        doc.save(tmp)
    os.replace(tmp, dst)
    return dst


class InboxFeeder:
    """Keeps at least ``backlog`` pages waiting: copies of ``documents`` (``pages[i]`` pages each), in turn."""

    def __init__(self, inbox: Path, documents: list[Path], pages: list[int], db: Database, backlog: int,
                 every: float = 1.0):
        self.inbox, self.documents, self.pages, self.db = inbox, documents, pages, db
        self.backlog, self.every = backlog, every
        self.fed: list[int] = []  # pages of each file dropped, in order
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="feeder", daemon=True)
        self.error: str | None = None

    def waiting(self) -> int:
        """Pages waiting: those of pending chunks, and those of files dropped but not yet documents of the ledger."""
        counts = ledger_counts(self.db, limit=1)
        known = sum(counts["documents"].values()) + counts.get("duplicates", 0)
        return counts["pages_left"] + sum(self.fed[known:])

    def feed(self) -> int:
        """Drop files until the backlog is reached; the number dropped."""
        dropped, waiting = 0, self.waiting()
        while waiting < self.backlog:
            i = len(self.fed)
            src = self.documents[i % len(self.documents)]
            distinct_copy(src, self.inbox / f"{src.stem}-copy{i}{src.suffix}", i)
            self.fed.append(self.pages[i % len(self.documents)])
            waiting += self.fed[-1]
            dropped += 1
        return dropped

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.feed()
            except Exception as e:  # noqa: BLE001 - a busy ledger: tried again at the next tick, the last said
                self.error = f"{type(e).__name__}: {e}"

    def __enter__(self) -> InboxFeeder:
        self.feed()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def steady_window(stored: list[tuple[float, int, int]], trace: list, rows: int | None, end: float,
                  tokens_per_page: int | None) -> dict:
    """The rates over the window after the first wave. ``stored``: (second after the start, chunk id, pages) of each
    chunk stored; ``trace``: the engine's (second after the start, steps, tokens decoded, rows); ``rows``: the engine's
    rows; ``end``: the window's end (seconds after the start)."""
    chunks = sorted(stored)
    if not rows or len(chunks) < rows + 1:
        return {"steady_window": None, "steady_why_not": f"{len(chunks)} chunks stored, the first wave is {rows} "
                                                          "chunks: no window after it"}
    start = chunks[rows - 1][0]
    span = end - start
    if span <= 0:
        return {"steady_window": None, "steady_why_not": "the first wave ended at the end of the run"}
    pages = sum(n for t, _, n in chunks if start < t <= end)
    out = {"steady_window": [round(start, 1), round(end, 1)], "steady_chunks": sum(start < t <= end for t, *_ in chunks),
           "steady_stored_pages_per_hour": round(3600 * pages / span, 1)}
    inside = [p for p in trace if start <= p[0] <= end]
    if len(inside) >= 2 and inside[-1][0] > inside[0][0]:
        tok_s = (inside[-1][2] - inside[0][2]) / (inside[-1][0] - inside[0][0])
        out.update(steady_decoded_tok_s=round(tok_s, 1),
                   steady_mean_rows=round(sum(p[3] for p in inside) / len(inside), 1))
        if tokens_per_page:
            out["steady_decoded_pages_per_hour"] = round(3600 * tok_s / tokens_per_page)
    return out
