"""The official no-repeat-ngram rule, for one growing sequence, with drafted tokens on top.

Exactly transformers' ``UnlimitedOcrSlidingWindowNoRepeatNgramLogitsProcessor(n, window)``: before the
next token of a sequence ``s`` (prompt + output so far, length e), take ``w = s[-window:]`` (start
``b = e - len(w)``); if ``len(w) >= n``, every start ``i`` in ``[b, e - n]`` whose (n-1)-gram
``s[i : i+n-1]`` equals the current suffix ``s[e-n+1 : e]`` bans its successor ``s[i+n-1]`` (logit -inf).
The suffix's own position (``i = e-n+1``) is not a candidate. The window covers the prompt too.

Committed ids are indexed once ((n-1)-gram -> sorted starts), so a query costs one dict lookup plus a
direct check of the few starts whose gram reaches into the drafted tail.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict

import torch

from engine.model.load import LoadedModel
from engine.official import official_generation_config


class NoRepeatNgramRule:
    def __init__(self, ngram_size: int, window_size: int, prompt_ids: list[int]):
        if ngram_size < 2 or window_size < 1:
            raise ValueError("ngram_size must be >= 2 and window_size >= 1")
        self.n = ngram_size
        self.window = window_size
        self.ids: list[int] = []
        self._starts: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self.extend(prompt_ids)

    def extend(self, new_ids: list[int]) -> None:
        """Commit tokens; index every start whose successor is now known (i <= len(ids) - n)."""
        first_new = max(0, len(self.ids) - self.n + 1)
        self.ids.extend(new_ids)
        for i in range(first_new, len(self.ids) - self.n + 1):
            self._starts[tuple(self.ids[i : i + self.n - 1])].append(i)

    def banned(self, tail: list[int] = ()) -> set[int]:
        """Tokens banned as the next token after ``ids + tail``."""
        n, ids, tail = self.n, self.ids, list(tail)
        end = len(ids) + len(tail)
        begin = max(0, end - self.window)
        if end - begin < n:
            return set()
        from_ids = n - 1 - min(len(tail), n - 1)  # suffix tokens that come from the committed ids
        suffix = tuple(ids[len(ids) - from_ids:] + tail[len(tail) - (n - 1 - from_ids):])
        starts = self._starts.get(suffix, [])
        out = {ids[i + n - 1] for i in starts[bisect_left(starts, begin):]}
        last, first = suffix[-1], suffix[0]
        for i in range(max(begin, len(ids) - n + 1), end - n + 1):  # grams reaching into the tail
            # cheap checks first (the gram's last and first tokens): most starts fail them
            if self._token(i + n - 2, tail) == last and self._token(i, tail) == first \
                    and self._at(i, n - 1, tail) == suffix:
                out.add(self._token(i + n - 1, tail))
        return out

    def _token(self, position: int, tail: list[int]) -> int:
        ids = self.ids
        return ids[position] if position < len(ids) else tail[position - len(ids)]

    def _at(self, start: int, length: int, tail: list[int]) -> tuple[int, ...]:
        ids = self.ids
        return tuple(ids[start : start + length] + tail[max(0, start - len(ids)) : max(0, start + length - len(ids))])


def greedy_token(logits: torch.Tensor, banned: set[int]) -> int:
    """argmax of one row of logits after the bans (-inf), first index on ties, as ``generate`` does.
    Banned ids beyond the logits (prompt-only ids) are ignored, as the processor does."""
    banned = [i for i in banned if i < logits.shape[-1]]
    if banned:
        logits = logits.clone()
        logits[banned] = -float("inf")
    return int(logits.argmax())


def official_rule(loaded: LoadedModel, prompt_kind: str) -> tuple[int, int]:
    """(ngram_size, window_size) of the rule generate() installs with the official config (merged with the
    checkpoint's generation config, as generate does); raises if generate would also apply any other logits
    processor or stopping rule than EOS and max_new_tokens (the engine would then not be exact)."""
    from transformers.models.unlimited_ocr.generation_unlimited_ocr import (
        UnlimitedOcrSlidingWindowNoRepeatNgramLogitsProcessor as Rule,
    )

    config, _ = loaded.model._prepare_generation_config(official_generation_config(loaded, prompt_kind, 1))
    processors = loaded.model._get_logits_processor(config, input_ids_seq_length=1, device="cpu", model_kwargs={})
    others = [type(p).__name__ for p in processors if not isinstance(p, Rule)]
    rules = [p for p in processors if isinstance(p, Rule)]
    if others or len(rules) != 1:
        raise ValueError(f"official generate uses logits processors the engine does not reproduce: {others}")
    if config.stop_strings is not None or config.max_time is not None:
        raise ValueError("official generate stops on stop_strings or max_time; the engine does not reproduce that")
    return rules[0].ngram_size, rules[0].window_size
