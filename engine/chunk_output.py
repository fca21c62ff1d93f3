"""One decode of a chunk (several pages) -> the pages it can vouch for.

The decoder runs one pass over the chunk's pages and hands back the pages it can vouch for:
- every page, when the model finished (EOS) with one page of output per input page;
- with a different page count, the pages it produced, in order, with a note on each (never silently
  shifted), and the missing ones asked to be re-queued;
- when the output reached the context limit (or its token limit, or was stopped in a repetition loop:
  `engine.batch.loop_watch`), only the pages completed before the last page separator, and the rest asked to be
  re-queued (the worker sends the page the output was cut on back alone, and the pages after it as a chunk of their
  own).
A single page always yields exactly one page; cut at the limit, its finish reason says so.
Each kept page carries its own token ids and their log-probabilities (for ``ingest.quality.measures``): the output
split at the page separator token (separator and EOS left out), or, when the separator is not one token,
a share of the output proportional to the page's text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.model.load import PAGE_SEPARATOR
from engine.official import DecodeResult, parse_elements, split_pages


@dataclass
class PageOutput:
    text: str
    boxes: list[dict[str, Any]]
    stats: dict[str, Any]
    ids: list[int] = field(default_factory=list)  # the page's output token ids (no separator / EOS)
    logprobs: list[float] = field(default_factory=list)  # one per id (empty when the decoder has none)


@dataclass
class ChunkOutput:
    pages: list[PageOutput]  # the pages kept, in order, for input pages 1..len(pages) of the chunk
    n_input_pages: int
    finish_reason: str  # eos | length | context_limit | repetition | no_room
    requeue: bool = False  # pages after len(pages) must be decoded again (in a new chunk)
    note: str | None = None
    pages_returned: int | None = None  # the pages the model wrote, where not one per input page
    output_ids: list[int] = field(default_factory=list)
    chunk_stats: dict[str, Any] = field(default_factory=dict)


def no_room(n_pages: int, context_limit: int) -> ChunkOutput:
    return ChunkOutput(pages=[], n_input_pages=n_pages, finish_reason="no_room", requeue=True,
                       note=f"{n_pages} pages leave no room under the context limit {context_limit}")


def page_token_spans(output_ids: list[int], pieces: list[str], groups: list[tuple[int, int]],
                     page_sep_id: int | None, eos_token_id: int | None) -> list[tuple[int, int]]:
    """[start, end) in ``output_ids`` of each kept page, where page k is ``pieces[groups[k][0]..groups[k][1]]``
    (the pieces of ``split_pages``). Separator and final EOS are left out. Falls back to shares
    proportional to the pieces' characters when the ids do not split into the same pieces."""
    n = len(output_ids)
    end_all = n - 1 if n and output_ids[-1] == eos_token_id else n
    segments: list[tuple[int, int]] = []
    if page_sep_id is not None:
        start = 0
        for i in range(end_all):
            if output_ids[i] == page_sep_id:
                segments.append((start, i))
                start = i + 1
        segments.append((start, end_all))
        if len(segments) == len(pieces) + 1:  # the blank text before the first separator, dropped by split_pages
            segments = segments[1:]
    if len(segments) != len(pieces):
        chars = [len(p) + 1 for p in pieces]
        total, start, segments = sum(chars), 0, []
        for k, c in enumerate(chars):
            end = end_all if k == len(chars) - 1 else min(end_all, start + round(end_all * c / total))
            segments.append((start, end))
            start = end
    return [(segments[a][0], segments[b][1]) for a, b in groups]


def assemble(res: DecodeResult, n_in: int, hit_context: bool, page_sep_id: int | None = None,
             eos_token_id: int | None = None) -> ChunkOutput:
    """Turn one decode of ``n_in`` pages into kept pages, following the module's rules."""
    finished = res.finish_reason == "eos"
    tokens = len(res.output_ids)
    cut = "repetition" if res.finish_reason == "repetition" else "context_limit" if hit_context else "length"
    if n_in == 1:
        text = res.text.replace(PAGE_SEPARATOR, "\n").strip() if PAGE_SEPARATOR in res.text else res.text.strip()
        reason = "eos" if finished else cut
        texts, kept_reasons, requeue, note, returned = [text], [reason], False, None, None
    else:
        pieces = split_pages(res.text, PAGE_SEPARATOR)
        if not finished:
            complete = pieces[:-1]  # the last piece was cut by the limit
            texts = complete[:n_in]
            requeue = len(texts) < n_in
            note, returned = None, None
            if not requeue and len(complete) > n_in:
                returned = len(complete)
                note = f"model produced {len(complete)} pages for {n_in} input pages; extra text kept on page {n_in}"
                texts[-1] = "\n\n".join(complete[n_in - 1 :])
        elif len(pieces) >= n_in:
            texts, requeue, note, returned = pieces[:n_in], False, None, None
            if len(pieces) > n_in:
                returned = len(pieces)
                note = f"model produced {len(pieces)} pages for {n_in} input pages; extra text kept on page {n_in}"
                texts[-1] = "\n\n".join(pieces[n_in - 1 :])
        else:
            texts = pieces if any(pieces) else []
            requeue, returned = True, len(texts)
            note = f"model produced {len(texts)} pages for {n_in} input pages"  # the worker names what it re-queues
        kept_reasons = ["page_separator"] * len(texts)
        if texts and finished and not requeue:
            kept_reasons[-1] = "eos"
    n_chars = sum(len(t) for t in texts) or 1
    eos = eos_token_id if eos_token_id is not None else (res.output_ids[-1] if finished and tokens else None)
    if n_in == 1:
        spans = [(0, tokens - 1 if finished and tokens else tokens)]
    else:
        groups = [(k, k) for k in range(len(texts))]
        if texts and note and "extra text kept" in note:  # the last page holds the extra pieces
            groups[-1] = (len(texts) - 1, len(pieces) - (1 if finished else 2))
        spans = page_token_spans(res.output_ids, pieces, groups, page_sep_id, eos)
    lps = res.logprobs if len(res.logprobs) == tokens else []
    pages = [
        PageOutput(
            text=t,
            boxes=parse_elements(t),
            stats={
                "finish_reason": kept_reasons[i],
                "tokens": round(tokens * len(t) / n_chars) if len(texts) > 1 else tokens,
                "seconds": round(res.seconds * (len(t) / n_chars if len(texts) > 1 else 1.0), 4),
                "chunk_pages": n_in,
                **({"note": note} if note else {}),
            },
            ids=list(res.output_ids[spans[i][0]:spans[i][1]]),
            logprobs=list(lps[spans[i][0]:spans[i][1]]),
        )
        for i, t in enumerate(texts)
    ]
    finish = "eos" if finished else cut
    return ChunkOutput(pages=pages, n_input_pages=n_in, finish_reason=finish, requeue=requeue, note=note,
                       pages_returned=returned, output_ids=list(res.output_ids), chunk_stats={
                           "prompt_tokens": len(res.prompt_ids), "output_tokens": tokens,
                           "seconds": round(res.seconds, 4),
                           "tokens_per_second": round(tokens / res.seconds, 2) if res.seconds > 0 else 0.0,
                           "finish_reason": finish, "prompt_kind": res.prompt_kind, "ngram_window": res.ngram_window,
                           "pages_in": n_in, "pages_out": len(pages)})
