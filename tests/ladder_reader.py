"""A scripted model behind the engine's submit / poll interface that reads calibration-ladder pages (tests of the
ladder's decode job and of calibrating from corrections): ``read`` says what a subclass reads on each page of a chunk
and with what log-probability; the rest (queue, the decoder's interface, the chunk's output) is here."""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

from engine.chunk_output import assemble
from engine.official import DecodeResult
from ingest.synth.ladder import ladder_pages, ladder_rung
from tests.conftest import DEMO


@lru_cache(maxsize=None)
def labels(seed: int) -> list[str]:
    """The ladder document's page labels (its truth)."""
    return ladder_pages(ladder_rung(seed))[1]


def key_pages(key) -> tuple[int, list[int]]:
    """(seed, page numbers) of a decode key: ("alone", seed, page) or (kind, seed, first page, last page)."""
    return (key[1], [key[2]]) if key[0] == "alone" else (key[1], list(range(key[2], key[3] + 1)))


class ScriptedLadderReader:
    mode, model_name, device = "plain", "scripted-ladder-reader", "cpu"

    def __init__(self):
        from transformers import AutoTokenizer

        self.loaded = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(str(DEMO)), dtype="float32")
        self.queue = []

    def read(self, key, n: int) -> list[tuple[str, float]]:
        """(text, log-probability of each of its tokens) for each of the chunk's ``n`` pages."""
        raise NotImplementedError

    @property
    def engine(self):
        return SimpleNamespace(active=len(self.queue), pending=[])

    @property
    def free_rows(self) -> int:
        return 4 - len(self.queue)

    @property
    def busy(self) -> bool:
        return bool(self.queue)

    def describe(self):
        return {"scripted": True}

    def abandon(self):
        dropped, self.queue = self.queue, []
        return dropped

    def submit(self, key, images, context_limit, max_new_tokens=None):
        self.queue.append((key, len(images)))

    def poll(self):
        done, self.queue = self.queue, []
        return [(key, self._output(key, n)) for key, n in done]

    def _output(self, key, n: int):
        tok = self.loaded.tokenizer
        ids, lps, body = [], [], ""
        for text, lp in self.read(key, n):
            piece = ("<PAGE>" if n > 1 else "") + text
            piece_ids = tok(piece, add_special_tokens=False)["input_ids"]
            ids += piece_ids
            lps += [lp] * len(piece_ids)
            body += piece
        res = DecodeResult(prompt_ids=[0] * 10, output_ids=ids, finish_reason="eos", seconds=0.01, text=body,
                           prompt_kind="multi" if n > 1 else "single", n_pages=n, logprobs=lps)
        return assemble(res, n, hit_context=False)
