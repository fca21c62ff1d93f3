"""The stand-in's tokenizer: a word-level vocabulary of the real size with the real model's special-token ids.

Ids 0, 1, 2: BOS, EOS, PAD (as DeepSeek's tokenizer); 128815-128822: ``<image>``, ``<|ref|>``, ``<|/ref|>``,
``<|det|>``, ``<|/det|>``, ``<|grounding|>``, ``<td>``, ``</td>`` (the ids of the real tokenizer); ``<PAGE>`` at
128823 (its id in the real tokenizer is not among the documented ones). The words of the official prompts come
next, then pseudo-words (syllable strings) fill the vocabulary. Words are split on whitespace and punctuation, so
both prompts end with the tokens ``parsing`` ``.``; decoding joins tokens with spaces.
"""

from __future__ import annotations

import itertools

BOS, EOS, PAD, UNK = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<unk>"
SPECIALS = {128815: "<image>", 128816: "<|ref|>", 128817: "<|/ref|>", 128818: "<|det|>", 128819: "<|/det|>",
            128820: "<|grounding|>", 128821: "<td>", 128822: "</td>", 128823: "<PAGE>"}
PROMPT_WORDS = ["document", "parsing", ".", "Multi", "page"]
VOCAB_SIZE = 129_280
_ONSETS = "b c d f g h j k l m n p r s t v w z br ch dr gl kr pl sh st th tr".split()
_VOWELS = "a e i o u ai ea io ou".split()


def _pseudo_words():
    syllables = [o + v for o, v in itertools.product(_ONSETS, _VOWELS)]
    for length in itertools.count(1):
        for parts in itertools.product(syllables, repeat=length):
            yield "".join(parts)


def vocabulary(size: int = VOCAB_SIZE) -> dict[str, int]:
    """token -> id for ``size`` ids (special ids above ``size`` are left out: a small test vocabulary)."""
    fixed = {0: BOS, 1: EOS, 2: PAD, 3: UNK, **{i: t for i, t in SPECIALS.items() if i < size}}
    words = itertools.chain(PROMPT_WORDS, (w for w in _pseudo_words() if w not in PROMPT_WORDS))
    vocab = {}
    for i in range(size):
        token = fixed.get(i) or next(words)
        vocab[token] = i
    return vocab


def build_tokenizer(size: int = VOCAB_SIZE):
    """A ``PreTrainedTokenizerFast`` over `vocabulary` (no download, a second or two at the full size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary(size)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    specials = [t for i, t in sorted(SPECIALS.items()) if i < size]
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                                   additional_special_tokens=specials, model_max_length=32768)
