"""Vision ahead: the pages of chunks still waiting for a row go through the vision tower while the rows decode.

Each turn, when chunks still wait after admission (every row taken, or the turn's admission budget spent), the first
waiting chunks whose prompt embeddings are not made yet (up to one vision call of pages, at least one chunk, and at
most ``ahead_pages`` pages made ahead in all; with padded vision calls and rows free, only a full call) are run
through the vision tower (`engine.model.vision.embed_chunks`, with the engine's SAM attention and padding) before the
decode step: on CUDA on a second stream, so that the tower's kernels run beside the step's instead of holding every
row up at admission; off CUDA there and then (the same sums, earlier). Admission then only prefills them
(`engine.batch.admission`): their embeddings wait for the second stream's event on the step's stream, and are marked
as used there so that their memory is not reused before the prefill has read it. A chunk that leaves the queue
unadmitted (dropped, reset) takes its embeddings with it; a chunk that goes back to the queue after admission is seen
again from its pixels.

Anything that goes wrong ahead (out of memory beside the step, a kernel this machine cannot run) is said once, the
embeddings made ahead are dropped (admission makes them as before) and vision ahead stays off.
"""

from __future__ import annotations

import contextlib
import time

import torch
from loguru import logger

from engine.model.vision import embed_chunks


class VisionAhead:
    def __init__(self, device: torch.device, enabled: bool, ahead_pages: int):
        self.enabled = enabled
        self.ahead_pages = ahead_pages
        self.stream = torch.cuda.Stream(device) if enabled and device.type == "cuda" else None
        self.pages = 0  # pages made ahead so far (all runs)

    def launch(self, engine) -> None:
        """Make the prompt embeddings of the next waiting chunks ahead (called after the turn's admission)."""
        if not self.enabled or not engine.pending or not engine.active:
            return
        ready = sum(r.n_pages for r in engine.pending if r.embeds is not None)
        take, pages = [], 0
        for r in engine.pending:
            if r.embeds is not None:
                continue
            if take and pages + r.n_pages > engine.vision_group:
                break
            take.append(r)
            pages += r.n_pages
        if not take or ready + pages > max(self.ahead_pages, pages):
            return
        if engine.pad_vision and pages < engine.vision_group and None in engine.rows[: engine.row_limit]:
            return  # a padded call of a few pages: admission waits for more free rows (`worth_a_vision_call`)
        t0 = time.perf_counter()
        try:
            self._embed(engine, take)
        except Exception as e:  # noqa: BLE001 - admission makes them as before
            self.stop(engine, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            return
        engine.timing["vision_ahead_s"] += time.perf_counter() - t0
        self.pages += pages

    def _embed(self, engine, take: list) -> None:
        loaded = engine.loaded
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(loaded.device))  # the pixels' memory and the weights
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            inputs = [r.inputs.to(loaded.device, dtype=loaded.dtype) for r in take]
            embeds = embed_chunks(loaded.model, loaded.image_token_id, inputs, engine.vision_group, engine.pad_vision,
                                  attention=engine.vision_attention)
            event = torch.cuda.Event() if self.stream is not None else None
            if event is not None:
                event.record(self.stream)
        for r, e in zip(take, embeds):
            r.embeds, r.embeds_ready = e, event

    def stop(self, engine, why: str) -> None:
        """Vision ahead off from now on; the embeddings made ahead dropped."""
        logger.warning("vision ahead of admission failed ({}): off from now on", why)
        self.enabled = False
        for r in engine.pending:
            r.embeds = r.embeds_ready = None


def take_embeds(request, device: torch.device):
    """The request's embeddings made ahead, ready for the current stream to read (None: none were made)."""
    embeds, event = request.embeds, request.embeds_ready
    request.embeds = request.embeds_ready = None
    if embeds is not None and event is not None:
        stream = torch.cuda.current_stream(device)
        stream.wait_event(event)
        embeds.record_stream(stream)
    return embeds

