"""Chunk decoders: the official reference (`OfficialDecoder`) and the batched engine (`EngineDecoder`), both handing
back a chunk's pages by the rules of `engine.chunk_output`; a decoder is loaded by `engine.loading.load_decoder`."""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

from engine.chunk_output import ChunkOutput, assemble, no_room
from engine.model.load import LoadedModel
from engine.official import DecodeResult, decode_text, official_generate

MIN_NEW_TOKENS = 16


class ChunkDecoder(Protocol):
    mode: str
    model_name: str
    device: str

    def decode(self, images: list, context_limit: int, max_new_tokens: int | None = None,
               reference_texts: list[str] | None = None, replay_ids: list[int] | None = None) -> ChunkOutput:
        """reference_texts / replay_ids are draft hints (a page's known text, an earlier run's ids):
        decoders that speculate use them; none lets them change the output."""

    def describe(self) -> dict[str, Any]: ...

    def free_memory(self) -> None: ...

    def close(self) -> None:
        """Give the device memory back now (the decoder is done)."""


def replay_of(tokenizer: Any, texts: list[str]) -> list[int]:
    """A replay draft from earlier readings of a chunk's pages (texts a decoder wrote; ``replay_ids`` of ``decode``):
    their token ids as the model writes them, pages after the page separator when there are several."""
    from engine.drafters.suffix_match import reading_ids
    from engine.model.load import PAGE_SEPARATOR

    return reading_ids(tokenizer, texts, PAGE_SEPARATOR if len(texts) > 1 else None)


def describe_model(lm: LoadedModel) -> dict[str, Any]:
    """What a run records about the model it decoded with."""
    return {"path": lm.path, "device": str(lm.device), "dtype": str(lm.dtype).removeprefix("torch."),
            "tokens_per_page": lm.tokens_per_page, "sliding_window": lm.sliding_window}


def free_device_memory() -> None:
    """After an out-of-memory error: drop garbage and the allocator's cached blocks."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompt_length(loaded: LoadedModel, n_pages: int) -> int:
    """Tokens in the prefix: BOS + one page of image tokens per page + the prompt text."""
    from engine.official import PROMPTS

    text = PROMPTS["single" if n_pages == 1 else "multi"]
    n_text = len(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])
    return 1 + n_pages * loaded.tokens_per_page + n_text


def token_budget(loaded: LoadedModel, n_pages: int, context_limit: int,
                 max_new_tokens: int | None) -> tuple[int, bool] | None:
    """(new-token limit, whether the limit is the context room) for a chunk of ``n_pages``; None when a
    multi-page chunk leaves fewer than MIN_NEW_TOKENS (ValueError for a single page: it cannot shrink)."""
    room = context_limit - prompt_length(loaded, n_pages)
    if room < MIN_NEW_TOKENS:
        if n_pages == 1:
            raise ValueError(f"one page's prompt leaves {room} tokens under the context limit {context_limit}")
        return None
    limit = room if max_new_tokens is None else min(room, max_new_tokens)
    return limit, limit == room


class OfficialDecoder:
    """transformers ``generate()``: the reference every faster engine must match token for token."""

    mode = "official"

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model_name = loaded.name
        self.device = str(loaded.device)

    def describe(self) -> dict[str, Any]:
        return describe_model(self.loaded)

    def free_memory(self) -> None:
        free_device_memory()

    def close(self) -> None:
        free_device_memory()

    def decode(self, images: list, context_limit: int, max_new_tokens: int | None = None,
               reference_texts: list[str] | None = None, replay_ids: list[int] | None = None) -> ChunkOutput:
        n = len(images)  # the official path takes no draft hints
        budget = token_budget(self.loaded, n, context_limit, max_new_tokens)
        if budget is None:
            return no_room(n, context_limit)
        limit, limit_is_room = budget
        t0 = time.perf_counter()
        res = official_generate(self.loaded, images, "single" if n == 1 else "multi", limit)
        out = assemble(res, n, hit_context=(res.finish_reason != "eos" and limit_is_room),
                       page_sep_id=self.loaded.page_sep_id)
        out.chunk_stats["wall_seconds"] = round(time.perf_counter() - t0, 4)
        return out


SHARED_STATS = ("verify_rounds", "single_steps", "draft_tokens", "accepted_tokens", "relaxed_tokens",
                "prefill_s", "draft_s", "verify_s", "single_s")


class EngineDecoder:
    """`engine.batch.engine.BatchEngine` as a ChunkDecoder (modes plain, lossless, fast): ``decode`` runs one chunk
    to its end; ``submit`` / ``poll`` keep many in flight (the batch worker). Every chunk's tokens equal official
    ``generate()`` of that chunk alone (fast mode: relaxed, never cut short)."""

    def __init__(self, engine):
        self.engine = engine
        self.loaded = engine.loaded
        self.mode = engine.mode
        self.model_name = self.loaded.name
        self.device = str(self.loaded.device)
        self._limits: dict[int, bool] = {}  # id(request) -> whether its token limit is the context room
        self._ended: list[tuple[Any, ChunkOutput | BaseException]] = []  # ended during another caller's decode

    def describe(self) -> dict[str, Any]:
        e = self.engine
        return {**describe_model(self.loaded), "mode": e.mode, "k_max": e.k_max, "max_batch": e.max_batch,
                "kernels": e.forward.kernels, "backend": "graphs" if e.graphs is not None else "eager",
                "drafters": [] if e.mode == "plain" else [n for n in e.drafter_names if n != "block" or e.block],
                **({"fast_threshold": e.fast_threshold} if e.mode == "fast" else {})}

    def free_memory(self) -> None:
        free_device_memory()

    def close(self) -> None:
        """The engine's memory back at once (`BatchEngine.close`)."""
        self.engine.close()
        free_device_memory()

    @property
    def rows(self) -> int:
        """Chunks the engine decodes together at most (now: fewer after running out of memory)."""
        return self.engine.row_limit

    @property
    def free_rows(self) -> int:
        """Chunks the engine can take now without queueing."""
        return max(0, self.engine.row_limit - self.engine.active - len(self.engine.pending))

    @property
    def busy(self) -> bool:
        return self.engine.busy

    def submit(self, key: Any, images: list, context_limit: int, max_new_tokens: int | None = None,
               reference_texts: list[str] | None = None, replay_ids: list[int] | None = None,
               inputs: Any = None) -> ChunkOutput | None:
        """Queue a chunk; returns its output at once when it cannot be decoded (no room under the context limit),
        else None (``poll`` hands it back when it ends). ``inputs``: the processor's outputs for ``images``, when
        they were built already (`BatchEngine.prepare`)."""
        n = len(images)
        budget = token_budget(self.loaded, n, context_limit, max_new_tokens)
        if budget is None:
            return no_room(n, context_limit)
        request = self.engine.prepare(images, budget[0], key, reference_texts, replay_ids, inputs)
        self._limits[id(request)] = budget[1]
        self.engine.submit(request)
        return None

    def poll(self) -> list[tuple[Any, ChunkOutput | BaseException]]:
        """One engine step; the chunks that ended in it (and those another caller's ``decode`` saw end). A chunk
        that does not fit alone in memory comes back as its ``torch.OutOfMemoryError`` (the engine first gives
        the batch's other rows back to the queue), so the caller can split it."""
        done, self._ended = self._ended, []
        return done + self.engine_step()

    def abandon(self) -> list[Any]:
        """Drop every chunk in flight or queued (after an error); returns their keys."""
        dropped = self.engine.reset()
        for request in dropped:
            self._limits.pop(id(request), None)
        return [r.key for r in dropped]

    def decode(self, images: list, context_limit: int, max_new_tokens: int | None = None,
               reference_texts: list[str] | None = None, replay_ids: list[int] | None = None) -> ChunkOutput:
        """One chunk to its end (e.g. an orientation probe). Other chunks in flight go on meanwhile; those that
        end come back from the next ``poll``."""
        mine = object()
        early = self.submit(mine, images, context_limit, max_new_tokens, reference_texts, replay_ids)
        if early is not None:
            return early
        while True:
            for key, out in self.engine_step():
                if key is mine:
                    if isinstance(out, BaseException):
                        raise out
                    return out
                self._ended.append((key, out))

    def engine_step(self) -> list[tuple[Any, ChunkOutput | BaseException]]:
        """One engine step: the chunks that ended in it; out of memory with one chunk alone in the batch: that
        chunk, with the error (the queue stays)."""
        try:
            return [(res.request.key, self._output(res)) for res in self.engine.step()]
        except torch.OutOfMemoryError as exc:
            dropped = self.engine.drop_rows() or [self.engine.pending.popleft()]  # the admission of one chunk
            for request in dropped:
                self._limits.pop(id(request), None)
            return [(request.key, exc) for request in dropped]

    def _output(self, res) -> ChunkOutput:
        request = res.request
        limit_is_room = self._limits.pop(id(request), False)
        hit_context = res.finish_reason == "length" and limit_is_room
        stats = res.stats
        result = DecodeResult(prompt_ids=request.prompt_ids, output_ids=res.output_ids,
                              finish_reason=res.finish_reason, seconds=res.seconds,
                              text=decode_text(self.loaded, res.output_ids), prompt_kind=request.kind,
                              n_pages=request.n_pages, ngram_window=self.engine.rules[request.kind][1],
                              logprobs=res.logprobs)
        out = assemble(result, request.n_pages, hit_context=hit_context, page_sep_id=self.loaded.page_sep_id)
        out.chunk_stats.update(stats, wall_seconds=round(res.seconds, 4),
                               queued_s=round(time.perf_counter() - request.submitted_at - res.seconds, 4))
        for page in out.pages:
            share = page.stats["tokens"] / len(res.output_ids) if res.output_ids else 0.0
            page.stats.update({key: _scaled(stats[key], share) for key in SHARED_STATS}, tau=stats["tau"],
                              mode=self.mode, draft_share=stats["draft_share"], drafters=stats["drafters"],
                              backend=stats["backend"], batch_rows=stats["batch_rows"])
        return out


def _scaled(value: float, share: float) -> float:
    return round(value * share, 4) if isinstance(value, float) else round(value * share, 2)
