"""`ngram` drafter: prompt-lookup in the output so far (tables, markup and boxes repeat).

It finds the most recent earlier occurrence of the output's last ``max_ngram`` .. ``min_ngram`` tokens
and proposes the tokens that followed it. The index (n-gram -> latest end) grows with each call, covering
every n-gram that ends before the current last token.
"""

from __future__ import annotations


class NgramDrafter:
    name = "ngram"

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._latest_end: dict[tuple[int, ...], int] = {}
        self._indexed_to = 0  # n-grams ending at positions <= this are indexed

    def propose(self, committed_ids: list[int], k: int) -> list[int]:
        for end in range(self._indexed_to + 1, len(committed_ids)):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._latest_end[tuple(committed_ids[end - n : end])] = end
        self._indexed_to = max(self._indexed_to, len(committed_ids) - 1)
        for n in range(min(self.max_ngram, len(committed_ids)), self.min_ngram - 1, -1):
            end = self._latest_end.get(tuple(committed_ids[-n:]))
            if end is not None:
                return committed_ids[end : end + k]
        return []
