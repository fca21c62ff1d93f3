"""Per-page quality without ground truth: pure functions on token ids, log-probabilities and texts.

- ``distinct_n(ids, n)``: share of distinct n-grams among the page's n-grams (1.0 = no repeated n-gram;
  a repetition loop drives it down). None when the page has fewer than n tokens.
- ``loop_tail(ids)``: the period and length of a looping tail (the last tokens repeat a unit of ``period``
  tokens at least ``min_repeats`` times and cover at least ``min_tokens``), else None. Under the official
  no-repeat-ngram rule (n=35) an exact loop needs a period beyond the rule's window (a repeated long line);
  shorter loops are forced into near-loops, which ``looping`` also catches: the last ``tail_tokens`` tokens, or
  twice or three times that many (a near-loop of a longer unit: a repeated paragraph in a multi-page chunk, whose
  rule bans every exact repeat over 1,024 tokens), have Distinct-10 below ``tail_distinct``.
- ``finish_reason(raw, ids)``: eos / page_separator / context_limit / length / repetition as the decoder reported
  it (the engine stops a page caught looping while it decodes: ``loop_stopper``), but ``repetition`` when a page that
  ran out of room (context_limit or length) ends in a loop.
- ``edit_distance(a, b)`` (Levenshtein, bit-parallel: Hyyrö 2001) and ``normalized_edit_distance``
  (distance / the longer length; 0 = equal, 1 = nothing in common).
- ``page_quality(...)``: the stats of one page (``ingest.quality.grades`` grades pages on them).

Log-probabilities are those of the emitted tokens under the target model's distribution: the log-softmax
of its fp32 logits at each emitted position, before the no-repeat-ngram bans (the engine takes them from the
verify logits, the official path from generate's logits). A token is low-confidence when its probability
is below ``Thresholds.low_confidence_prob``.

The thresholds are ``ingest.config.Thresholds`` (the ``[quality]`` section of config.toml).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from rapidfuzz.distance import Levenshtein

from ingest.config import Thresholds


def distinct_n(ids: Sequence[Hashable], n: int) -> float | None:
    """Distinct n-grams / n-grams (Distinct-n); None with fewer than n tokens."""
    total = len(ids) - n + 1
    if total <= 0:
        return None
    return len(set(zip(*(ids[i:] for i in range(n))))) / total


def loop_tail(ids: Sequence[Hashable], min_repeats: int = 3, min_tokens: int = 32,
              max_period: int = 1024) -> tuple[int, int] | None:
    """(period, tail length) of the shortest unit that the sequence's end repeats, or None.

    The tail of length L with period p satisfies ids[i] == ids[i - p] for its last L - p tokens; it is a
    loop when L >= min_repeats * p and L >= min_tokens."""
    n = len(ids)
    limit = min(max_period, n // max(min_repeats, 1))
    periods = range(1, limit + 1)
    if min_repeats > 1 and limit:  # a period p needs ids[-1] == ids[-1 - p]: only those are walked
        last = ids[-1]
        periods = [p for p, t in zip(range(limit, 0, -1), ids[n - 1 - limit : n - 1]) if t == last][::-1]
    for p in periods:
        run = 0  # trailing positions i with ids[i] == ids[i - p]
        i = n - 1
        while i >= p and ids[i] == ids[i - p]:
            run += 1
            i -= 1
        tail = run + p
        if tail >= min_repeats * p and tail >= min_tokens:
            return p, tail
    return None


def looping(ids: Sequence[Hashable], thresholds: Thresholds | None = None) -> bool:
    """The sequence ends in a loop: an exact periodic tail, or a near-loop (low Distinct-10 at the end)."""
    t = thresholds or Thresholds()
    if loop_tail(ids, t.loop_min_repeats, t.loop_min_tokens) is not None:
        return True
    for n in (t.loop_tail_tokens, 2 * t.loop_tail_tokens, 3 * t.loop_tail_tokens):
        if len(ids) < n:
            return False
        d = distinct_n(ids[-n:], 10)
        if d is not None and d < t.loop_tail_distinct:
            return True
    return False


LOOP_WINDOW = 1536  # tokens the online check looks back over: loops of a period up to a third of it


def loop_stopper(thresholds: Thresholds | None = None) -> Callable[[Sequence[Hashable]], bool]:
    """The repetition rule as the engine asks it while a page decodes (`engine.batch.loop_watch`): ``looping`` over
    the page's last ``LOOP_WINDOW`` tokens (a bounded cost per check; a loop of a longer period is still found once
    the page has ended, by ``finish_reason``)."""
    t = thresholds or Thresholds()
    return lambda ids: looping(ids[-LOOP_WINDOW:], t)


def finish_reason(raw: str, ids: Sequence[Hashable], thresholds: Thresholds | None = None) -> str:
    """The page's finish reason: ``repetition`` when it ran out of room (context_limit / length) in a loop."""
    if raw in ("context_limit", "length") and looping(ids, thresholds):
        return "repetition"
    return raw


def edit_distance(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Levenshtein distance (insert, delete, substitute: 1 each) of two strings or token lists."""
    return Levenshtein.distance(a, b)


def character_error_rate(read: str, truth: str) -> float:
    """CER of a reading against the truth: the Levenshtein distance of their plain texts (markup removed:
    ingest.synth.documents.strip_markup) over the truth's length (at least 1)."""
    from ingest.synth.documents import strip_markup

    plain = strip_markup(truth)
    return edit_distance(strip_markup(read), plain) / max(1, len(plain))


def normalized_edit_distance(a: Sequence[Hashable], b: Sequence[Hashable]) -> float:
    """edit_distance / max(len): 0.0 equal, 1.0 nothing in common (two empty inputs: 0.0)."""
    longest = max(len(a), len(b))
    return edit_distance(a, b) / longest if longest else 0.0


def _words(text: str) -> str:
    return " ".join(text.split())


def page_quality(raw_finish: str, ids: Sequence[int], logprobs: Sequence[float] | None, text: str,
                 text_layer: str | None, thresholds: Thresholds = Thresholds()) -> dict[str, Any]:
    """Stats of one page from its token ids (separator / EOS excluded), their log-probabilities, its
    readable text and the PDF text layer (None when there is none)."""
    t = thresholds
    lps = [lp for lp in (logprobs or []) if lp is not None and not math.isnan(lp)]
    low = math.log(t.low_confidence_prob)
    layer = _words(text_layer or "")
    loop = loop_tail(ids, t.loop_min_repeats, t.loop_min_tokens)
    return {
        "finish_reason": finish_reason(raw_finish, ids, t),
        "tokens": len(ids),
        "chars": len(text),
        "distinct_20": _round(distinct_n(ids, 20)),
        "distinct_35": _round(distinct_n(ids, 35)),
        "loop_period": loop[0] if loop else None,
        "mean_logprob": _round(statistics.fmean(lps)) if lps else None,
        "min_logprob": _round(min(lps)) if lps else None,
        "low_confidence_share": _round(sum(lp < low for lp in lps) / len(lps)) if lps else None,
        "text_layer_ned": (_round(normalized_edit_distance(_words(text), layer))
                           if len(layer) >= t.text_layer_min_chars else None),
    }


def _round(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(v, digits)


