"""What each decode of a chunk drafts from: the earlier readings the ledger holds of the same pages (a re-run), or,
for a page read again alone by the repair, the reading its chunk just made of it. Drafts change speed, never text
(the engine keeps only the target's own tokens), so a wrong or stale reading only costs a rejected draft.

- The chunk's decode: the token ids of the earlier decode of exactly these pages (``PreparedChunk.replay``), else the
  earlier readings of its pages (those made in a multi-page chunk, for a chunk of several pages; those made of the
  page alone, for a chunk of one), as a replay (`engine.chunk_decode.replay_of`); reference texts (the PDF text layer
  or the earlier text kept) as always.
- A page the repair reads again alone (`ingest.quality.repair`): its earlier reading alone, else its earlier
  reading, else the reading its chunk made of it in this decode.
"""

from __future__ import annotations

from typing import Any

from engine.chunk_decode import replay_of
from ingest.pages.prepare import PreparedChunk


def chunk_replay(chunk: PreparedChunk, tokenizer: Any) -> list[int] | None:
    """The replay draft of the chunk's own decode (see the module docstring)."""
    if chunk.replay or tokenizer is None or not chunk.earlier or any(e is None for e in chunk.earlier):
        return chunk.replay
    if len(chunk.pages) == 1:
        texts = [e.alone or e.in_chunk or e.text for e in chunk.earlier]
    else:
        texts = [e.in_chunk or e.text for e in chunk.earlier]
    return replay_of(tokenizer, texts)


def alone_replay(chunk: PreparedChunk, i: int, in_chunk_now: str, tokenizer: Any) -> list[int] | None:
    """The replay draft of page ``i`` (0-based in the chunk) read again alone; ``in_chunk_now``: the reading the
    chunk's decode made of it."""
    earlier = chunk.earlier[i] if chunk.earlier else None
    text = (earlier.alone or earlier.in_chunk or earlier.text) if earlier is not None else in_chunk_now
    return replay_of(tokenizer, [text]) if tokenizer is not None and text else None
