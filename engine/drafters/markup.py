"""`markup` drafter: the fixed parts of Unlimited-OCR's box headers, ``<|det|>label [x1, y1, x2, y2]<|/det|>``.

A page's text can come from a text layer or an earlier run, but its headers cannot: their coordinates are new on
every element. Their *punctuation* is not: after a coordinate comes ``, `` (or ``]<|/det|>`` after the fourth),
after ``]`` comes ``<|/det|>``, and after ``<|det|>`` comes one of the labels the output has used before. Drafting
those lets one verify forward emit the punctuation *and* the target's own next coordinate, so a header costs about
one forward per coordinate instead of one per token.

State is read from the output's tail since the last ``<|det|>`` (decoded, so any tokenizer works); labels are
collected from the headers the output has closed (the most recent first; Unlimited-OCR's commonest labels
until then). Outside a header it proposes nothing
(text is the other drafters' job). Drafted strings are tokenized on their own: with a BPE tokenizer that can differ
from the target's in-context tokens, which only costs a rejected draft.
"""

from __future__ import annotations

import re

DET_OPEN, DET_CLOSE = "<|det|>", "<|/det|>"
COORDINATES = 4
COMMON_LABELS = ("text", "title", "sub_title")  # guessed (in this order) until the output has shown its own
_BOX = re.compile(r"^(?P<label>[^\[\]<]*?)\s*\[(?P<box>[\d, ]*)(?P<end>\]?)$")


def open_header(ids: list[int], open_id: int, close_id: int, lookback: int = 64) -> int | None:
    """Index of the ``<|det|>`` of the header ``ids`` ends inside (opened, not yet closed, within the last
    ``lookback`` tokens), or None."""
    for i in range(len(ids) - 1, max(-1, len(ids) - lookback), -1):
        if ids[i] == close_id:
            return None
        if ids[i] == open_id:
            return i
    return None


class MarkupDrafter:
    name = "markup"

    def __init__(self, tokenizer, max_labels: int = 16):
        self.tokenizer = tokenizer
        self.open_id = tokenizer.convert_tokens_to_ids(DET_OPEN)
        self.close_id = tokenizer.convert_tokens_to_ids(DET_CLOSE)
        self.usable = all(isinstance(i, int) and i != tokenizer.unk_token_id for i in (self.open_id, self.close_id))
        self.max_labels = max_labels
        self.labels: list[str] = list(COMMON_LABELS)  # most recent first
        self._scanned = 0  # headers closed before this output position are in `labels`
        self._ids: dict[str, list[int]] = {}

    def propose(self, committed_ids: list[int], k: int) -> list[int]:
        if not self.usable or not committed_ids:
            return []
        self._collect_labels(committed_ids)
        start = open_header(committed_ids, self.open_id, self.close_id)
        if start is None:
            return []
        tail = self.tokenizer.decode(committed_ids[start + 1:], skip_special_tokens=False)
        return self._continuation(tail)[:k]

    def _continuation(self, tail: str) -> list[int]:
        match = _BOX.match(tail)
        if match is None:  # still in the label: the most recent label it can be, then " ["
            for label in self.labels:
                if label.startswith(tail) and label != tail:
                    return self._tokens(label[len(tail):] + " [")
            return self._tokens(" [") if tail in self.labels else []
        if match["end"]:
            return [self.close_id]
        box = match["box"]
        if not box or box.endswith(" "):  # a coordinate comes next: nothing fixed to draft
            return []
        if box.endswith(","):
            return self._tokens(" ")
        done = len([c for c in box.split(",") if c.strip()])
        return self._tokens(", ") if done < COORDINATES else self._tokens("]") + [self.close_id]

    def _collect_labels(self, ids: list[int]) -> None:
        for i in range(self._scanned, len(ids)):
            if ids[i] != self.close_id:
                continue
            window = max(0, i - 64)  # the header's <|det|> is within open_header's lookback: no copy of the output
            start = open_header(ids[window:i], self.open_id, self.close_id)
            if start is not None:
                start += window
                match = _BOX.match(self.tokenizer.decode(ids[start + 1:i], skip_special_tokens=False))
                label = match["label"] if match else None
                if label:
                    if label in self.labels:
                        self.labels.remove(label)
                    self.labels.insert(0, label)
                    del self.labels[self.max_labels:]
        self._scanned = len(ids)

    def _tokens(self, text: str) -> list[int]:
        if text not in self._ids:
            self._ids[text] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._ids[text]
