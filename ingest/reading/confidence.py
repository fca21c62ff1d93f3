"""Word confidences from the model's own token probabilities, computed once when a page is stored.

**The formula** (ALTO ``WC``, hOCR ``x_wconf`` / 100): a word's confidence is the product of the probabilities the
model gave to the tokens that overlap the word's characters, i.e. ``exp(sum of their log-probabilities)``:
the model's own probability of having written exactly those tokens, given the text before them. It lies in [0, 1].
Why the product: it is a probability, not a score, and it is never above the probability of the word's weakest
token, so one doubtful character marks the whole word (a geometric mean would dilute it over a long word), while
several doubtful tokens count together (a minimum would see only one of them). A token that spans two words
(``"e t"``) counts for both; markup tokens (``<|det|>``, ``<td>``...) overlap no word and count for none.
The log-probabilities are those every mode records (log-softmax of the logits before the no-repeat rule).

Tokens to characters: each token's bytes (byte-level BPE pieces through the byte alphabet, added tokens such as
``<|det|>`` or ``<td>`` as their text, begin/end/pad tokens as nothing; any other tokenizer: the token decoded
alone) are fed to an incremental UTF-8 decoder, so a character split over two tokens belongs to both. The text
so rebuilt is matched to the stored page text (which was stripped), exactly where it can be, else character by
character (rapidfuzz's alignment, linear in practice; a page of 5,000 characters in milliseconds) when the
decoder's text differs (e.g. a tokenizer that cleans up spaces, or one that decodes a token alone without the space
the whole text puts before it).
"""

from __future__ import annotations

import codecs
import math
from functools import lru_cache
from typing import Any

from rapidfuzz.distance import Indel

from ingest.reading.words import page_words

FORMULA = ("WC = product of the probabilities the model gave the tokens overlapping the word "
           "(exp of the sum of their log-probabilities)")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (printable character -> byte), as transformers' tokenizers map it, reversed.
    Imported here: a tokenizer, and so transformers, is loaded whenever token pieces are read."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(tokenizer: Any, ids: list[int]) -> list[bytes]:
    """The bytes each token contributes to the decoded text."""
    drop = {getattr(tokenizer, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")} - {None}
    added = {i: t.content for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
    table = _byte_decoder()
    out = []
    for i, piece in zip(ids, tokenizer.convert_ids_to_tokens(list(ids))):
        if i in drop:
            out.append(b"")
        elif i in added:
            out.append(added[i].encode("utf-8"))
        else:
            try:
                out.append(bytes(table[c] for c in piece))
            except (KeyError, TypeError):  # not a byte-level piece
                out.append(tokenizer.decode([i], skip_special_tokens=False).encode("utf-8"))
    return out


def char_tokens(pieces: list[bytes]) -> tuple[str, list[tuple[int, int]]]:
    """The text the pieces decode to, and per character the first and last token that hold its bytes."""
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    chars: list[str] = []
    owners: list[tuple[int, int]] = []
    pending: int | None = None  # the token whose bytes the decoder holds back (a character not yet complete)
    for k, b in enumerate(pieces):
        out = dec.decode(b)
        for j, ch in enumerate(out):
            chars.append(ch)
            owners.append((pending if j == 0 and pending is not None else k, k))
        if dec.getstate()[0]:
            pending = k if (pending is None or out) else pending
        else:
            pending = None
    tail = dec.decode(b"", final=True)
    for ch in tail:
        chars.append(ch)
        owners.append((pending if pending is not None else len(pieces) - 1, len(pieces) - 1))
    return "".join(chars), owners


def _text_to_decoded(text: str, decoded: str) -> list[int | None]:
    """Per character of ``text``, its position in ``decoded`` (None where they differ)."""
    at = decoded.find(text) if text else -1
    if at >= 0:
        return list(range(at, at + len(text)))
    pos: list[int | None] = [None] * len(text)
    for tag, a0, a1, b0, _ in Indel.opcodes(decoded, text):
        if tag == "equal":
            pos[b0:b0 + a1 - a0] = range(a0, a1)
    return pos


def word_confidences(text: str, ids: list[int], logprobs: list[float], tokenizer: Any) -> list[float | None]:
    """One confidence per word of ``page_words(text)`` (the formula above); None for every word when the decoder gave
    no log-probabilities, and for a word no token could be matched to."""
    words = page_words(text)
    if not words:
        return []
    if not ids or len(logprobs) != len(ids) or tokenizer is None:
        return [None] * len(words)
    decoded, owners = char_tokens(token_bytes(tokenizer, ids))
    where = _text_to_decoded(text, decoded)
    out: list[float | None] = []
    for w in words:
        tokens: set[int] = set()
        for c in range(w.start, w.end):
            if (d := where[c]) is not None:
                first, last = owners[d]
                tokens.update(range(first, last + 1))
        out.append(round(math.exp(sum(logprobs[t] for t in tokens)), 4) if tokens else None)
    return out


def archival_stats(text: str, ids: list[int], logprobs: list[float], image_size: tuple[int, int],
                   tokenizer: Any) -> dict[str, Any]:
    """What the archival writers need of a page, stored with it: the size of the page image the model read
    (``image_size``: the pixel space of ALTO, hOCR and the PDF text layer) and one confidence per word
    (``word_confidence``)."""
    return {"image_size": [int(image_size[0]), int(image_size[1])],
            "word_confidence": word_confidences(text, ids, logprobs, tokenizer)}
