"""What becomes of a chunk once its decode ended: its pages stored (and the pages it did not finish queued again as
new chunks), or, when the decode failed, the chunk split, retried or failed.

Split rules:
- the output reached the context limit (or ``engine.max_tokens_per_page`` x pages), or was stopped in a repetition
  loop (`engine.batch.loop_watch`), part-way: the complete pages are kept, the page it was cut on goes back alone (a
  page that runs away again costs one more decode of itself only, not of its neighbours) and the pages after it as a
  chunk of their own;
- no page came back (no room for the prompt, or no page at all): the chunk is halved;
- fewer pages came back than went in: the missing ones go back as one chunk;
- out of memory on a multi-page chunk: split in two (fewer pages need less memory); on one page: failed, as any other
  error, with a retry after a backoff until ``worker.max_attempts``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loguru import logger

from db.chunks import split_chunk
from db.queue import Claim, fail
from db.session import Database
from engine.chunk_output import ChunkOutput
from ingest.config import Settings
from ingest.pages.prepare import PreparedChunk, Unreadable
from ingest.quality.calibration import grading_thresholds
from ingest.quality.repair import chunk_page_stats, repair_chunk
from ingest.worker.drafts import alone_replay

WHY_CUT = {"context_limit": "output reached the context limit; ",
           "length": "output reached engine.max_tokens_per_page x pages; ",
           "repetition": "output ran into a repetition loop and was stopped; "}


def requeued_ranges(c: Claim, out: ChunkOutput) -> list[tuple[int, int]]:
    """The page ranges to decode again as new chunks (see the module docstring); empty when the chunk is done."""
    return requeue_rule(c.first_page, c.last_page, len(out.pages), out.finish_reason) if out.requeue else []


def requeue_rule(first: int, last: int, kept: int, finish: str) -> list[tuple[int, int]]:
    """The split rules of the module docstring for a chunk of pages ``first .. last`` that kept ``kept`` pages and
    asked to be queued again."""
    first_left = first + kept
    if finish in WHY_CUT and first_left < last:
        return [(first_left, first_left), (first_left + 1, last)]
    if kept == 0:
        mid = first + (last - first + 1) // 2 - 1
        return [(first, mid), (mid + 1, last)]
    return [(first_left, last)]


def chunk_note(out: ChunkOutput, ranges: list[tuple[int, int]]) -> str | None:
    """The chunk's note: the decoder's, and which pages went back to the queue and why."""
    if not ranges:
        return out.note
    why = WHY_CUT.get(out.finish_reason, "")
    return (out.note + "; " if out.note else "") + why + "pages " + ", ".join(f"{a}-{b}" for a, b in ranges) + \
        " re-queued"


def checked_stats(settings: Settings, chunk: PreparedChunk, out: ChunkOutput, tokenizer: Any,
                  decode_alone: Callable[[list, list[str], list[int] | None], ChunkOutput]) -> list[dict[str, Any]]:
    """Each kept page's stats (ingest.quality.repair: its figures, word confidences, the chunk's checks); the pages
    caught by the checks are decoded again alone (``decode_alone(images, references, replay_ids)``, drafted as
    `ingest.worker.drafts` says) and the better reading kept (``quality.repair``, on by default). ``out.pages`` is
    updated in place."""
    t = grading_thresholds(settings).thresholds
    images, layers = [p.image for p in chunk.pages], [p.text_layer for p in chunk.pages]
    first = chunk.pages[0].index if chunk.pages else 1
    turned = any(choice.turn for choice in chunk.turned.values())  # the print of a turned page is measured again
    stats = chunk_page_stats(out, images, layers, tokenizer, t, first, None if turned else chunk.prints or None)
    if settings.quality.repair:
        def alone(i: int) -> ChunkOutput:
            return decode_alone([images[i]], [chunk.references[i]],
                                alone_replay(chunk, i, out.pages[i].text if i < len(out.pages) else "", tokenizer))

        for i in repair_chunk(out, stats, images, layers, alone, tokenizer, t, first):
            if rec := stats[i].get("repair"):
                logger.info("{}: page {} ({}) decoded again alone; kept the {} reading", chunk.label,
                            chunk.pages[i].index, ", ".join(rec["why"]),
                            "single-page" if rec["kept"] == "alone" else "chunk's")
    return stats


def page_rows(chunk: PreparedChunk, out: ChunkOutput, page_stats: list[dict[str, Any]],
              mode: str | None) -> list[dict[str, Any]]:
    """The ledger rows (``Page`` columns) of the pages the chunk kept: text, boxes, the decoder's stats with the
    page's figures and word confidences (``page_stats``, from ``checked_stats``), the number of chunks decoding
    together when it was decoded (``batch_rows``: the engine's, else 1), its orientation and notes."""
    c, rows = chunk.claim, []
    for po, rendered, extra in zip(out.pages, chunk.pages, page_stats):
        stats = {"batch_rows": 1, **po.stats, "chunk_id": c.chunk_id,
                 "chunk_pages": f"{c.first_page}-{c.last_page}", "mode": mode, **extra}
        notes = [out.note] if out.note else []
        if (choice := chunk.turned.get(rendered.index)) is not None:
            stats["orientation"] = choice.record()
            if choice.turn:
                notes.append(choice.note())
        if notes:
            stats["note"] = "; ".join(notes)
        rows.append(dict(page_index=rendered.index, text=po.text, boxes=po.boxes, stats=stats,
                         text_layer=rendered.text_layer))
    return rows


def is_out_of_memory(e: BaseException) -> bool:
    name = type(e).__name__
    return name == "OutOfMemoryError" or (isinstance(e, RuntimeError) and "out of memory" in str(e).lower())


def unreadable(settings: Settings, db: Database, u: Unreadable) -> None:
    """A chunk whose original cannot be read fails for good (another try reads the same file); one whose preparation
    failed otherwise (``u.permanent`` False: its process died) is tried again after a backoff, as a failed decode."""
    w = settings.worker
    fail(db, u.claim, u.reason, w.max_attempts, w.backoff_seconds, permanent=u.permanent)
    logger.error("{}: {}", u.label, u.reason)


def decode_failed(settings: Settings, db: Database, c: Claim, label: str, e: BaseException, device: str,
                  reserved_for: int | None) -> None:
    """A chunk whose decode raised ``e`` (not the ledger's or the machine's trouble): split or retried or failed."""
    w = settings.worker
    if is_out_of_memory(e):
        n = len(c.pages)
        if n > 1:
            mid = c.first_page + n // 2 - 1
            note = f"out of memory with {n} pages ({e.__class__.__name__}); split into " \
                   f"{c.first_page}-{mid} and {mid + 1}-{c.last_page}"
            split_chunk(db, c, [(c.first_page, mid), (mid + 1, c.last_page)], note, reserved_for)
            logger.warning("{}: {}", label, note)
            return
        reason = f"out of memory decoding one page on {device}: {str(e).splitlines()[0][:300]}"
    else:
        reason = f"{type(e).__name__}: {e}"
    status = fail(db, c, reason, w.max_attempts, w.backoff_seconds)
    logger.opt(exception=not is_out_of_memory(e)).error("{}: {} -> {}", label, reason, status or "lease lost")
