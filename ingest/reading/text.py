"""A page's readable text: the model's output without its grounding markup (element labels and boxes), table cells
kept. Every output that shows a page's text (document.md, the searchable PDF, the figures a page is graded on) reads
it through ``page_markdown``."""

from __future__ import annotations

import re

_DET = re.compile(r"<\|det\|>.*?<\|/det\|>", re.S)
_DET_CUT = re.compile(r"<\|det\|>(?:(?!<\|/det\|>).)*$", re.S)  # an element header cut off by the end of the output
_SPECIAL = re.compile(r"<\|/?(?:ref|grounding)\|>")


def page_markdown(text: str) -> str:
    """The readable text of a page: grounding markup (labels and boxes) removed, table cells kept."""
    t = _SPECIAL.sub("", _DET_CUT.sub("", _DET.sub("", text)))
    t = t.replace("<td>", " | ").replace("</td>", "")
    return re.sub(r"\n{3,}", "\n\n", t).strip()
