"""Pages scanned sideways or upside down, turned upright before their chunk is decoded (ingest.pages.orientation says
how a page is found to look turned and how the turn is chosen), without holding up the decode loop: the probes of a
chunk's pages are submitted to the decoder like chunks of their own (``ProbeKey``), the engine decodes them beside
the other rows, and the chunk is submitted once the last of them has ended (``ended``).

A page probed before (its chunk was cut and queued again) keeps the turn chosen then and is not probed again. The
probes' inputs come ready-made from the page-preparation processes when they built them (ingest.pages.inputs), else
the decoder's ``submit`` builds them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from loguru import logger

from ingest.config import Settings
from ingest.pages.orientation import InkMeasures, TurnChoice, decide, measure_ink, probe_score, turn
from ingest.pages.prepare import PreparedChunk


@dataclass(frozen=True)
class ProbeKey:
    """The decoder's key of one probe: the chunk, the page's position in it, the turn read."""

    chunk_id: int
    position: int
    turn: int


@dataclass
class _Probing:
    chunk: PreparedChunk
    measures: dict[int, InkMeasures]  # position -> the measures of a page being probed
    waiting: set[ProbeKey]
    scores: dict[int, dict[int, float]] = field(default_factory=dict)  # position -> turn -> mean log-probability
    started: float = field(default_factory=time.perf_counter)


class Turns:
    """The probes in flight and the turns made (see the module docstring)."""

    LIMIT = 4096  # a watcher runs for weeks: the memory of turns made stays small

    def __init__(self, settings: Settings):
        self.settings = settings
        self.made: dict[tuple[int, int], TurnChoice] = {}  # (document, page) -> the turn chosen for a probed page
        self._probing: dict[int, _Probing] = {}  # chunk id -> its probes

    def start(self, decoder: Any, chunk: PreparedChunk) -> bool:
        """Turn the chunk's pages probed before, and submit the probes of those that look turned. True when probes
        are in flight: ``ended`` hands the chunk back once they have all ended."""
        o = self.settings.orientation
        if not o.auto:
            return False
        probing = _Probing(chunk, {}, set())
        for i, (page, ink) in enumerate(zip(chunk.pages, chunk.ink)):
            earlier = self.made.get((chunk.claim.document_id, page.index))
            if earlier is not None:
                self._apply(chunk, i, earlier, " (made before)")
                continue
            m = ink or measure_ink(page.image, o)
            if m.candidates:
                probing.measures[i] = m
                probing.waiting.update(ProbeKey(chunk.claim.chunk_id, i, t) for t in (0, *m.candidates))
        if not probing.waiting:
            return False
        self._probing[chunk.claim.chunk_id] = probing
        try:
            for key in sorted(probing.waiting, key=lambda k: (k.position, k.turn)):
                page = chunk.pages[key.position]
                early = decoder.submit(key, [turn(page.image, key.turn)], self.settings.engine.context_limit,
                                       o.probe_tokens, inputs=chunk.probe_inputs.get((key.position, key.turn)))
                if early is not None:  # no room to read it at all
                    probing.scores.setdefault(key.position, {})[key.turn] = probe_score(early)
                    probing.waiting.discard(key)
        except Exception:
            self._probing.pop(chunk.claim.chunk_id, None)  # the probes in flight end unheard
            raise
        if not probing.waiting:
            self._decide(self._probing.pop(chunk.claim.chunk_id))
            return False
        return True

    def ended(self, key: ProbeKey, out: Any) -> tuple[PreparedChunk, BaseException | None] | None:
        """A probe that ended (its output or its error): (the chunk, None) when it was its chunk's last and the turns
        are made, (the chunk, the error) when a probe failed (the chunk fails with it), else None."""
        probing = self._probing.get(key.chunk_id)
        if probing is None or key not in probing.waiting:  # its chunk failed already
            return None
        if isinstance(out, BaseException):
            del self._probing[key.chunk_id]
            return probing.chunk, out
        probing.waiting.discard(key)
        probing.scores.setdefault(key.position, {})[key.turn] = probe_score(out)
        if probing.waiting:
            return None
        del self._probing[key.chunk_id]
        self._decide(probing)
        return probing.chunk, None

    def _decide(self, probing: _Probing) -> None:
        o, seconds, chunk = self.settings.orientation, time.perf_counter() - probing.started, probing.chunk
        for i, m in sorted(probing.measures.items()):
            choice = decide(m, probing.scores[i], o, seconds)
            if len(self.made) >= self.LIMIT:
                self.made.clear()
            self.made[(chunk.claim.document_id, chunk.pages[i].index)] = choice
            self._apply(chunk, i, choice, "")

    @staticmethod
    def _apply(chunk: PreparedChunk, i: int, choice: TurnChoice, before: str) -> None:
        page = chunk.pages[i]
        chunk.turned[page.index] = choice
        if choice.turn:
            page.image = turn(page.image, choice.turn)
        logger.info("{}: page {} looks {}; probes {}{}: {}", chunk.label, page.index, choice.looks,
                    choice.record()["probe_mean_logprob"], before,
                    f"turned {choice.turn} degrees clockwise" if choice.turn else "left as it is")


def turned_positions(chunk: PreparedChunk) -> dict[int, int]:
    """Position in the chunk -> degrees its page was turned (pages probed only)."""
    return {i: chunk.turned[p.index].turn for i, p in enumerate(chunk.pages) if p.index in chunk.turned}
