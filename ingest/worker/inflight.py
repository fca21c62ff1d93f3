"""The worker's one view of a decoder: chunks submitted with a key, polled until they end.

``engine.chunk_decode.EngineDecoder`` keeps many chunks in flight itself (``submit`` / ``poll`` / ``free_rows``).
Any other ``ChunkDecoder`` (the official ``generate()`` path, a scripted test decoder) is wrapped in ``OneAtATime``:
``submit`` decodes the chunk there and then, and the next ``poll`` hands its output back. The worker runs the same
code over both, so batch 1 is the batched worker with one row.

A poll that raises (an engine step failing for a reason no single chunk can be blamed for) ends every chunk in flight
with that error: ``poll_all`` returns ``(key, error)`` for each, after dropping them from the decoder.
"""

from __future__ import annotations

from typing import Any

from engine.chunk_decode import ChunkDecoder
from engine.chunk_output import ChunkOutput

Ended = tuple[Any, "ChunkOutput | BaseException"]


class OneAtATime:
    """A decoder without ``submit`` seen as one with a single row."""

    def __init__(self, inner: ChunkDecoder):
        self.inner = inner
        self._ended: list[Ended] = []

    def __getattr__(self, name: str) -> Any:  # mode, model_name, device, loaded, describe, free_memory, decode
        return getattr(self.inner, name)

    @property
    def rows(self) -> int:
        return 1

    @property
    def free_rows(self) -> int:
        return 0 if self._ended else 1

    @property
    def busy(self) -> bool:
        return bool(self._ended)

    def submit(self, key: Any, images: list, context_limit: int, max_new_tokens: int | None = None,
               reference_texts: list[str] | None = None, replay_ids: list[int] | None = None,
               inputs: Any = None) -> None:
        """Decode the chunk now (``inputs``, processor outputs built ahead, are not used: ``decode`` takes images)."""
        try:
            out: ChunkOutput | BaseException = self.inner.decode(
                images, context_limit, max_new_tokens, reference_texts=reference_texts, replay_ids=replay_ids)
        except Exception as e:  # handed back as the chunk's result, as the engine hands back its errors
            out = e
        self._ended.append((key, out))

    def poll(self) -> list[Ended]:
        ended, self._ended = self._ended, []
        return ended

    def abandon(self) -> list[Any]:
        keys = [key for key, _ in self._ended]
        self._ended = []
        return keys


def batched(decoder: ChunkDecoder) -> Any:
    """``decoder`` itself when it keeps chunks in flight, else wrapped in ``OneAtATime``."""
    return decoder if hasattr(decoder, "submit") and hasattr(decoder, "poll") else OneAtATime(decoder)


def poll_all(decoder: Any) -> list[Ended]:
    """The chunks that ended in one step; when the step itself fails, every chunk in flight, with its error."""
    try:
        return decoder.poll()
    except Exception as e:
        return [(key, e) for key in decoder.abandon()]
