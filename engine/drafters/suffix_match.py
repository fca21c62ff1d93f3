"""Drafters that follow a known token sequence (the *source*): `reference` and `replay`.

The drafter keeps an alignment (output length, source position) that it trusts while the output keeps
agreeing with the source. When the output departs from it, it re-aligns on the longest suffix of the
output (``max_ngram`` down to ``min_ngram`` tokens) found in the source, preferring the first match at or
after the old position (the output reads the source front to back), else the last one before it.
It proposes the ``k`` source tokens that follow the alignment.

- `ReferenceDrafter`: the source is a known text of the page(s) (a PDF text layer, an earlier output)
  tokenized with the model's tokenizer; pages are joined by the page separator in multi-page chunks.
- `ReplayDrafter`: the source is the token ids of an earlier run of the same pages; it starts aligned at
  position 0 and, when no suffix matches, falls back to the same position in the source.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict

from engine.drafters.markup import open_header

RESUME_WINDOW = 4  # reference: a header closed this recently may resume the text at the reading front


def reading_ids(tokenizer, texts: list[str], page_separator: str | None) -> list[int]:
    """The token ids of page texts as the model writes them: in a multi-page chunk (``page_separator`` given) each
    page after the separator."""
    ids: list[int] = []
    for text in texts:
        if page_separator is not None:
            ids += tokenizer(page_separator, add_special_tokens=False)["input_ids"]
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


class SuffixMatchDrafter:
    name = "suffix_match"

    def __init__(self, source_ids: list[int], start_aligned: bool, min_ngram: int = 2, max_ngram: int = 8):
        self.source = list(source_ids)
        self.start_aligned = start_aligned
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._ends: dict[tuple[int, ...], list[int]] = defaultdict(list)  # n-gram -> sorted end positions
        for n in range(min_ngram, max_ngram + 1):
            for end in range(n, len(self.source) + 1):
                self._ends[tuple(self.source[end - n : end])].append(end)
        self._alignment: tuple[int, int] | None = (0, 0) if start_aligned else None

    def propose(self, committed_ids: list[int], k: int) -> list[int]:
        position = self._align(committed_ids)
        if position is None:
            return []
        self._alignment = (len(committed_ids), position)
        return self.source[position : position + k]

    def _align(self, committed: list[int]) -> int | None:
        if self._alignment is not None:
            length, position = self._alignment
            grown = committed[length:]
            if self.source[position : position + len(grown)] == grown:
                return position + len(grown)
        previous = self._alignment[1] if self._alignment is not None else 0
        for n in range(min(self.max_ngram, len(committed)), self.min_ngram - 1, -1):
            ends = self._ends.get(tuple(committed[-n:]))
            if ends:
                i = bisect_left(ends, previous)
                return ends[i] if i < len(ends) else ends[-1]
        if self.start_aligned and len(committed) < len(self.source):
            return len(committed)
        return None


class ReferenceDrafter(SuffixMatchDrafter):
    """The source has the page's words but none of the output's box headers (``<|det|>label [..]<|/det|>``), so
    around a header the suffix match has nothing to hold on to. Inside a header it proposes nothing (the `markup`
    drafter's part); right after one it resumes at its reading front (the furthest source position it has been
    aligned to), past line breaks and spaces: the next element's text."""

    name = "reference"

    def __init__(self, tokenizer, texts: list[str], page_separator: str | None = None, **ngram_sizes):
        ids = reading_ids(tokenizer, texts, page_separator)
        super().__init__(ids, start_aligned=False, **ngram_sizes)
        open_id, close_id = (tokenizer.convert_tokens_to_ids(t) for t in ("<|det|>", "<|/det|>"))
        known = all(isinstance(i, int) and i != tokenizer.unk_token_id for i in (open_id, close_id))
        self._open, self._close = (open_id, close_id) if known else (None, None)
        self._blank = {i for i in set(ids) if not tokenizer.decode([i]).strip()}
        self._front = 0

    def propose(self, committed_ids: list[int], k: int) -> list[int]:
        self._advance_front(committed_ids)
        if self._open is not None and committed_ids:
            resumed = self._resume_after_header(committed_ids)
            if resumed is not None:
                self._alignment = (len(committed_ids), resumed)
                return self.source[resumed : resumed + k]
            if open_header(committed_ids, self._open, self._close) is not None:
                return []
        return super().propose(committed_ids, k)

    def _resume_after_header(self, committed: list[int]) -> int | None:
        """Source position to go on from when a header closed in the last few tokens and what followed it is the
        source at the front (past blanks); None otherwise."""
        tail = committed[-RESUME_WINDOW:]
        if self._close not in tail:
            return None
        after = tail[len(tail) - tail[::-1].index(self._close):]
        position = self._front
        while position < len(self.source) and self.source[position] in self._blank:
            position += 1
        if self.source[position : position + len(after)] != after:
            return None
        return position + len(after)

    def _advance_front(self, committed: list[int]) -> None:
        """Move the front past the source tokens the output has followed since the last proposal."""
        if self._alignment is None:
            return
        length, position = self._alignment
        matched = 0
        for token, expected in zip(committed[length:], self.source[position:]):
            if token != expected:
                break
            matched += 1
        self._front = max(self._front, position + matched)



class ReplayDrafter(SuffixMatchDrafter):
    name = "replay"
    sits_out = False  # `DraftPolicy`: never benched after a miss (free to ask, re-aligns itself)

    def __init__(self, replay_ids: list[int], **ngram_sizes):
        super().__init__(replay_ids, start_aligned=True, **ngram_sizes)
