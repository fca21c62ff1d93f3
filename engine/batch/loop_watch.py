"""Stopping a row that runs into a repetition loop while it decodes, without changing a token before the stop.

A page caught in a loop would otherwise decode to its token limit (up to the 32K context: minutes of a row at full
size). The caller gives the engine a ``check(page_ids) -> bool`` (the pipeline's repetition rule,
`ingest.quality.measures.looping`); the engine asks it about each page's output at every ``every``-th token of that
page (page-relative, counted from the token after the last page separator), and a row whose page is caught ends
right there: its output is cut to exactly that token, its finish reason is ``repetition``.

Why it stays exact: where a row stops depends only on its own tokens (the check points are token counts, never
steps), so a chunk stops at the same token whatever the mode, the batch or the drafts, and what it emitted is the
first tokens of official ``generate()``'s output for that chunk. The check of the tokens committed so far runs
while the device computes the next step (`engine.batch.engine`); a row caught there also drops what that step
committed past the stop, and a row that ends for another reason is checked once more first, so that an end found
after the stop point never wins over the stop.
"""

from __future__ import annotations

from collections.abc import Callable

LOOP_EVERY = 64  # page tokens between two checks of a page


class LoopWatch:
    """One row's watch: ``scan(output)`` checks the page tokens committed since the last call; ``stop`` is the output
    length to cut to once a loop was found (None until then)."""

    def __init__(self, check: Callable[[list[int]], bool], every: int, page_sep: int | None):
        self.check, self.every, self.page_sep = check, max(1, every), page_sep
        self.page_start = 0  # output index of the current page's first token
        self.scanned = 0  # output tokens looked at so far
        self.stop: int | None = None

    def scan(self, output: list[int]) -> int | None:
        """The stop found in the tokens ``output`` holds beyond those already scanned (kept once found)."""
        end = len(output)
        while self.stop is None and self.scanned < end:
            point = self.page_start + self.every * ((self.scanned - self.page_start) // self.every + 1)
            sep = self._separator(output, self.scanned, min(end, point))
            if sep is not None:  # a new page starts before the next check point
                self.page_start = self.scanned = sep + 1
            elif point > end:
                self.scanned = end
            else:
                self.scanned = point
                if self.check(output[self.page_start : point]):
                    self.stop = point
        return self.stop

    def _separator(self, output: list[int], start: int, end: int) -> int | None:
        if self.page_sep is None:
            return None
        try:
            return output.index(self.page_sep, start, end)
        except ValueError:
            return None
