"""One chunk (several pages) -> one decode -> per-page results.

The decoder runs one pass over the chunk's pages and hands back the pages it can vouch for:
- every page, when the model finished (EOS) with one page of output per input page;
- with a different page count, the pages it produced, in order, with a note on each (never silently
  shifted), and the missing ones asked to be re-queued;
- when the output reached the context limit, only the pages completed before the last page separator,
  and the rest asked to be re-queued (the worker sends the page the output was cut on back alone, and the
  pages after it as a chunk of their own).
A single page always yields exactly one page; cut at the limit, its finish reason says so.
Each kept page carries its own token ids and their log-probabilities (for ``ingest.quality``): the output
split at the page separator token (separator and EOS left out), or, when the separator is not one token,
a share of the output proportional to the page's text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from loguru import logger

from engine.model import PAGE_SEPARATOR, LoadedModel
from engine.official import DecodeResult, decode_text, official_generate, parse_elements, split_pages

MIN_NEW_TOKENS = 16


@dataclass
class PageOutput:
    text: str
    boxes: list[dict[str, Any]]
    stats: dict[str, Any]
    ids: list[int] = field(default_factory=list)  # the page's output token ids (no separator / EOS)
    logprobs: list[float] = field(default_factory=list)  # one per id (empty when the decoder has none)


@dataclass
class ChunkOutput:
    pages: list[PageOutput]  # the pages kept, in order, for input pages 1..len(pages) of the chunk
    n_input_pages: int
    finish_reason: str  # eos | length | context_limit | no_room
    requeue: bool = False  # pages after len(pages) must be decoded again (in a new chunk)
    note: str | None = None
    output_ids: list[int] = field(default_factory=list)
    chunk_stats: dict[str, Any] = field(default_factory=dict)


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


def no_room(n_pages: int, context_limit: int) -> ChunkOutput:
    return ChunkOutput(pages=[], n_input_pages=n_pages, finish_reason="no_room", requeue=True,
                       note=f"{n_pages} pages leave no room under the context limit {context_limit}")


def page_token_spans(output_ids: list[int], pieces: list[str], groups: list[tuple[int, int]],
                     page_sep_id: int | None, eos_token_id: int | None) -> list[tuple[int, int]]:
    """[start, end) in ``output_ids`` of each kept page, where page k is ``pieces[groups[k][0]..groups[k][1]]``
    (the pieces of ``split_pages``). Separator and final EOS are left out. Falls back to shares
    proportional to the pieces' characters when the ids do not split into the same pieces."""
    n = len(output_ids)
    end_all = n - 1 if n and output_ids[-1] == eos_token_id else n
    segments: list[tuple[int, int]] = []
    if page_sep_id is not None:
        start = 0
        for i in range(end_all):
            if output_ids[i] == page_sep_id:
                segments.append((start, i))
                start = i + 1
        segments.append((start, end_all))
        if len(segments) == len(pieces) + 1:  # the blank text before the first separator, dropped by split_pages
            segments = segments[1:]
    if len(segments) != len(pieces):
        chars = [len(p) + 1 for p in pieces]
        total, start, segments = sum(chars), 0, []
        for k, c in enumerate(chars):
            end = end_all if k == len(chars) - 1 else min(end_all, start + round(end_all * c / total))
            segments.append((start, end))
            start = end
    return [(segments[a][0], segments[b][1]) for a, b in groups]


def assemble(res: DecodeResult, n_in: int, hit_context: bool, page_sep_id: int | None = None,
             eos_token_id: int | None = None) -> ChunkOutput:
    """Turn one decode of ``n_in`` pages into kept pages, following the module's rules."""
    finished = res.finish_reason == "eos"
    tokens = len(res.output_ids)
    if n_in == 1:
        text = res.text.replace(PAGE_SEPARATOR, "\n").strip() if PAGE_SEPARATOR in res.text else res.text.strip()
        reason = "eos" if finished else ("context_limit" if hit_context else "length")
        texts, kept_reasons, requeue, note = [text], [reason], False, None
    else:
        pieces = split_pages(res.text, PAGE_SEPARATOR)
        if not finished:
            complete = pieces[:-1]  # the last piece was cut by the limit
            texts = complete[:n_in]
            requeue = len(texts) < n_in
            note = None
            if not requeue and len(complete) > n_in:
                note = f"model produced {len(complete)} pages for {n_in} input pages; extra text kept on page {n_in}"
                texts[-1] = "\n\n".join(complete[n_in - 1 :])
        elif len(pieces) >= n_in:
            texts, requeue, note = pieces[:n_in], False, None
            if len(pieces) > n_in:
                note = f"model produced {len(pieces)} pages for {n_in} input pages; extra text kept on page {n_in}"
                texts[-1] = "\n\n".join(pieces[n_in - 1 :])
        else:
            texts = pieces if any(pieces) else []
            requeue = True
            note = f"model produced {len(texts)} pages for {n_in} input pages"  # the worker names what it re-queues
        kept_reasons = ["page_separator"] * len(texts)
        if texts and finished and not requeue:
            kept_reasons[-1] = "eos"
    n_chars = sum(len(t) for t in texts) or 1
    eos = eos_token_id if eos_token_id is not None else (res.output_ids[-1] if finished and tokens else None)
    if n_in == 1:
        spans = [(0, tokens - 1 if finished and tokens else tokens)]
    else:
        groups = [(k, k) for k in range(len(texts))]
        if texts and note and "extra text kept" in note:  # the last page holds the extra pieces
            groups[-1] = (len(texts) - 1, len(pieces) - (1 if finished else 2))
        spans = page_token_spans(res.output_ids, pieces, groups, page_sep_id, eos)
    lps = res.logprobs if len(res.logprobs) == tokens else []
    pages = [
        PageOutput(
            text=t,
            boxes=parse_elements(t),
            stats={
                "finish_reason": kept_reasons[i],
                "tokens": round(tokens * len(t) / n_chars) if len(texts) > 1 else tokens,
                "seconds": round(res.seconds * (len(t) / n_chars if len(texts) > 1 else 1.0), 4),
                "chunk_pages": n_in,
                **({"note": note} if note else {}),
            },
            ids=list(res.output_ids[spans[i][0]:spans[i][1]]),
            logprobs=list(lps[spans[i][0]:spans[i][1]]),
        )
        for i, t in enumerate(texts)
    ]
    finish = "eos" if finished else ("context_limit" if hit_context else "length")
    return ChunkOutput(pages=pages, n_input_pages=n_in, finish_reason=finish, requeue=requeue, note=note,
                       output_ids=list(res.output_ids), chunk_stats={
                           "prompt_tokens": len(res.prompt_ids), "output_tokens": tokens,
                           "seconds": round(res.seconds, 4),
                           "tokens_per_second": round(tokens / res.seconds, 2) if res.seconds > 0 else 0.0,
                           "finish_reason": finish, "prompt_kind": res.prompt_kind, "ngram_window": res.ngram_window,
                           "pages_in": n_in, "pages_out": len(pages)})


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
    """`engine.batch_engine.BatchEngine` as a ChunkDecoder (modes plain, lossless, fast): ``decode`` runs one chunk
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

    @property
    def free_rows(self) -> int:
        """Chunks the engine can take now without queueing."""
        return max(0, self.engine.row_limit - self.engine.active - len(self.engine.pending))

    @property
    def busy(self) -> bool:
        return self.engine.busy

    def submit(self, key: Any, images: list, context_limit: int, max_new_tokens: int | None = None,
               reference_texts: list[str] | None = None, replay_ids: list[int] | None = None) -> ChunkOutput | None:
        """Queue a chunk; returns its output at once when it cannot be decoded (no room under the context limit),
        else None (``poll`` hands it back when it ends)."""
        n = len(images)
        budget = token_budget(self.loaded, n, context_limit, max_new_tokens)
        if budget is None:
            return no_room(n, context_limit)
        request = self.engine.prepare(images, budget[0], key, reference_texts, replay_ids)
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
        hit_context = res.finish_reason != "eos" and self._limits.pop(id(request), False)
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


def load_decoder(path: str, device: str = "auto", dtype: str = "auto", mode: str = "official",
                 fast_threshold: float | None = None, max_batch: int | str = 1, kernels: str = "auto",
                 max_pages_per_chunk: int = 0) -> ChunkDecoder:
    """official: transformers generate(); plain / lossless / fast: `BatchEngine` (CUDA graphs on a GPU) with
    ``max_batch`` rows (``auto``: as many as the free GPU memory holds, `engine.memory.auto_batch`; 1 on the CPU).
    kernels: ``torch`` or ``invariant`` (`engine.forward`); ``auto`` = invariant in bf16/fp16 on CUDA, so that a
    chunk's tokens do not depend on its batch. lossless and fast also draft with the checkpoint's block drafter
    when it has one (`load_block_drafter`). max_pages_per_chunk: sizes the rows' prefix region up front."""
    from engine.batch_engine import BatchEngine
    from engine.memory import auto_batch
    from engine.model import load_model
    from engine.rows import MODES

    if mode != "official" and mode not in MODES:
        raise ValueError(f"engine mode {mode!r} is not available; use 'official', 'plain', 'lossless' or 'fast'")
    loaded = load_model(path, device, dtype)
    if mode == "official":
        return OfficialDecoder(loaded)
    if kernels == "auto":
        kernels = default_kernels(loaded)
    prefix = prompt_length(loaded, max(1, max_pages_per_chunk)) if max_pages_per_chunk else 0
    net = load_block_drafter(loaded) if mode != "plain" else None
    if max_batch == "auto":
        max_batch = auto_batch(loaded, prefix or prompt_length(loaded, 1), k_max=16 if mode != "plain" else 0)
    extra = {"fast_threshold": fast_threshold} if fast_threshold is not None else {}
    engine = BatchEngine(loaded, mode, max_batch=int(max_batch), block_net=net, kernels=kernels,
                         prefix_capacity=prefix, **extra)
    return EngineDecoder(engine)


def default_kernels(loaded: LoadedModel) -> str:
    """The step kernels for ``loaded`` (`engine.forward`): ``invariant`` in bf16/fp16 on CUDA, so that a chunk's
    tokens do not depend on its batch; ``torch`` otherwise (fp32 is exact with either)."""
    return "invariant" if loaded.device.type == "cuda" and loaded.dtype != torch.float32 else "torch"


def load_block_drafter(loaded):
    """The checkpoint's own block drafter (``<model folder>/drafter``, ``python -m scripts.train.drafter``), or None
    when it has none. One that does not fit the model is refused with a warning, and decoding goes on without it."""
    from engine.drafters.block import CONFIG_FILE, BlockDrafterNet, drafter_folder

    folder = drafter_folder(loaded.path)
    if not (folder / CONFIG_FILE).is_file():
        return None
    try:
        net = BlockDrafterNet.load(folder, loaded.device, loaded.dtype)
    except Exception as exc:  # noqa: BLE001 - a broken drafter must not stop decoding
        logger.warning("block drafter in {} not loaded: {}: {}", folder, type(exc).__name__, exc)
        return None
    if net.config.target_hidden != loaded.model.config.text_config.hidden_size or \
            max(net.config.layers) >= loaded.model.config.text_config.num_hidden_layers:
        logger.warning("block drafter in {} was made for another model: not used", folder)
        return None
    logger.info("block drafter loaded from {} (block {}, layers {})", folder, net.config.block, net.config.layers)
    return net
