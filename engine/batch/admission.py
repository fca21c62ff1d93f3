"""Admission into the batched engine, between decode steps, in bounded pieces.

While rows are free and chunks wait, chunks are taken in queue order in groups of at most ``admit_pages`` pages
(at least one chunk): a group's pixels go to the device, its pages through the vision tower together
(`engine.model.vision`), its chunks of one prefix length are prefilled together (at most ``PREFILL_TOKENS`` prefix
tokens a forward) and each takes its first token in its row. One turn admits at most ``admit_tokens`` prefix tokens
(at least one chunk), then the step runs: the rows already decoding wait for one bounded piece of admission, never
for the whole queue's vision and prefills, and what admission holds on the device (pixels, vision activations,
prefill activations) stays bounded however many rows are free. With padded vision groups (batch-invariant kernels), a
group of fewer pages than one vision call waits a few turns for more free rows while other rows decode
(`worth_a_vision_call`): the padding would cost more than the rows left idle meanwhile.

Out of memory while admitting a group: its chunks not yet in a row go back to the front of the queue (nothing is
lost, none is produced twice). A group of several chunks: ``admit_pages`` halves and the next turn tries again. One
chunk beside rows in flight: the cache keeps fewer rows, enough fewer to free what admission lacks
(`BatchEngine.shrink_for_admission`; the chunks of the rows above go back to the queue). One chunk alone in the
batch: the error is raised, the chunk stays at the front of the queue (the caller decides, e.g. splits it).

On CUDA each admission group's peak memory above what was allocated before it is measured (when it raises the
device's peak): ``BatchEngine.admission_peak`` keeps the largest, and ``admission_need`` (the model's estimate,
`engine.batch.memory.admission_bytes`) grows to it, and to what a group that failed held plus the allocation it failed
on, so that an out-of-memory error frees what admission really takes.
"""

from __future__ import annotations

import re
import time

import torch
from loguru import logger

from engine.batch.requests import ChunkResult
from engine.batch.rows import Row
from engine.batch.vision_ahead import take_embeds
from engine.model.vision import embed_chunks

PREFILL_TOKENS = 16384  # prefix tokens prefilled in one forward at most (chunks of one prefix length together)
ADMIT_PAGES = 64  # pages a group brings to the device at most (pixels, vision features)
ADMIT_TOKENS = 8192  # prefix tokens one turn admits at most before the next decode step (at least one chunk)
VISION_GROUP = 8  # pages through the vision tower in one call (`engine.model.vision.embed_chunks`)
ADMIT_WAIT_TURNS = 8  # turns a group smaller than a padded vision call waits for more free rows at most


def prefill_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of chunks grouped by prefix length, each group within ``budget`` tokens (at least one chunk)."""
    groups: list[list[int]] = []
    for length in sorted(set(lengths)):
        same = [i for i, n in enumerate(lengths) if n == length]
        per = max(1, budget // length)
        groups += [same[i : i + per] for i in range(0, len(same), per)]
    return groups


def _prefix_len(request) -> int:
    return len(request.inputs["input_ids"][0])


def next_group(pending, free: int, pages: int, tokens: int, first: bool = True) -> list:
    """The first waiting chunks the next group takes: at most ``free`` chunks, ``pages`` pages and ``tokens`` prefix
    tokens; at least one chunk when it is the turn's ``first`` group."""
    count = used_pages = used_tokens = 0
    for request in pending:
        if count >= free:
            break
        if (count or not first) and (used_pages + request.n_pages > pages or
                                     used_tokens + _prefix_len(request) > tokens):
            break
        count, used_pages, used_tokens = count + 1, used_pages + request.n_pages, used_tokens + _prefix_len(request)
    return [pending[i] for i in range(count)]


def worth_a_vision_call(engine, group: list) -> bool:
    """Whether ``group`` goes to the device this turn. With padded vision groups (batch-invariant kernels) a vision
    call costs ``vision_group`` pages whatever it holds: a 1-page chunk admitted alone pays for 8 pages of SAM and
    CLIP (~1.1 TFLOP a page at the real size: `scripts.bench.vision_cost`). So while rows decode, a group
    of fewer pages than a vision call takes waits, up to ``ADMIT_WAIT_TURNS`` turns, for more rows to free (a free
    row idle a few steps costs far less); with no row decoding, or unpadded vision, it goes at once."""
    if not engine.pad_vision or not engine.active or sum(r.n_pages for r in group) >= engine.vision_group:
        engine.admit_waited = 0
        return True
    engine.admit_waited += 1
    if engine.admit_waited > ADMIT_WAIT_TURNS:
        engine.admit_waited = 0
        return True
    return False


def admit(engine) -> list[ChunkResult]:
    """Admit into ``engine`` (a `engine.batch.engine.BatchEngine`) what one turn may; the chunks that ended at once."""
    finished: list[ChunkResult] = []
    budget = engine.admit_tokens
    while engine.pending and budget > 0:
        free = [i for i in range(engine.row_limit) if engine.rows[i] is None]
        if not free:
            break
        group = next_group(engine.pending, len(free), engine.admit_pages, budget, budget == engine.admit_tokens)
        if not group or not worth_a_vision_call(engine, group):
            break
        if _make_room(engine, max(_prefix_len(r) for r in group)):
            continue  # the cache holds fewer rows now: the free rows again
        for _ in group:
            engine.pending.popleft()
        try:
            finished += _admit_group(engine, group, free)
            budget -= sum(_prefix_len(r) for r in group)
            continue
        except torch.OutOfMemoryError:
            admitted = {id(r.request) for r in engine.rows if r is not None}
            back = [r for r in group if id(r) not in admitted]
            engine.pending.extendleft(reversed(back))
            if len(back) > 1:
                engine.admit_pages = max(1, sum(r.n_pages for r in back) // 2)
                logger.warning("out of memory while admitting {} chunks: {} pages a group from now on",
                               len(back), engine.admit_pages)
                return finished
            if not engine.active:
                raise
        # out of memory admitting one chunk beside rows in flight; shrink outside the handler, whose traceback held
        # the failed admission's tensors
        engine.shrink_for_admission("out of memory while admitting (OutOfMemoryError)")
        return finished
    return finished


def _make_room(engine, prefix_len: int) -> bool:
    """Grow the rows' prefix region for ``prefix_len`` tokens; True when the cache then holds fewer rows than the
    batch had (out of memory: `engine.model.kv_slots`), whose chunks went back to the queue."""
    rows = engine.kv.rows
    if engine.kv.ensure_capacity(prefix_len) and engine.graphs is not None:
        engine.graphs.clear()  # captured over the old buffers
    if engine.kv.rows == rows:
        return False
    engine.fit_rows()
    return True


def _admit_group(engine, take: list, free: list[int]) -> list[ChunkResult]:
    cuda = engine.loaded.device.type == "cuda"
    if cuda:
        allocated, peak = torch.cuda.memory_allocated(engine.loaded.device), \
            torch.cuda.max_memory_allocated(engine.loaded.device)
    try:
        finished = _admit(engine, take, free)
    except torch.OutOfMemoryError as exc:
        if cuda:  # what the group held when it failed (its tensors are alive in the traceback) and what it asked for
            need = torch.cuda.memory_allocated(engine.loaded.device) - allocated + failed_allocation(exc)
            engine.admission_need = max(engine.admission_need, need)
            engine.admission_measured = max(engine.admission_measured, need)
        raise
    if cuda and torch.cuda.max_memory_allocated(engine.loaded.device) > peak:
        took = torch.cuda.max_memory_allocated(engine.loaded.device) - allocated
        engine.admission_peak = max(engine.admission_peak, took)
        engine.admission_need = max(engine.admission_need, took)
        engine.admission_measured = max(engine.admission_measured, took)
        logger.debug("admission of {} chunk(s), {} pages took {:.2f} GiB at its peak ({:.2f} GiB allocated before)",
                     len(take), sum(r.n_pages for r in take), took / 2**30, allocated / 2**30)
    return finished


def _admit(engine, take: list, free: list[int]) -> list[ChunkResult]:
    t0 = time.perf_counter()
    engine.admission_hook(take)
    ahead = [take_embeds(r, engine.loaded.device) for r in take]  # made while earlier steps ran, or None
    inputs = [r.inputs.to(engine.loaded.device, dtype=engine.loaded.dtype) for r, e in zip(take, ahead) if e is None]
    made = iter(embed_chunks(engine.loaded.model, engine.loaded.image_token_id, inputs, engine.vision_group,
                             engine.pad_vision, attention=engine.vision_attention) if inputs else [])
    embeds = [e if e is not None else next(made) for e in ahead]
    del inputs, ahead
    vision_s = (time.perf_counter() - t0) / len(take)
    engine.timing["vision_s"] += vision_s * len(take)
    finished = []
    for group in prefill_groups([e.shape[1] for e in embeds], PREFILL_TOKENS):
        t1 = time.perf_counter()
        rows = [free[j] for j in group]
        logits, features = engine.forward.prefill(rows, torch.cat([embeds[j] for j in group]))
        engine.timing["prefill_s"] += time.perf_counter() - t1
        share = vision_s + (time.perf_counter() - t1) / len(group)
        for k, j in enumerate(group):
            row = Row(take[j], rows[k], engine.rules[take[j].kind], engine._drafters_for(take[j], rows[k]),
                      engine.k_max, engine.watch_for_loops())
            if engine.block is not None:
                engine.block.start(rows[k], features[k])
            row.start(logits[k], prefill_s=share, eos=engine.eos)
            engine.decoded += 1
            engine.rows[rows[k]] = row
            if row.done(engine.eos):
                finished.append(engine._finish(row))
    return finished


def failed_allocation(exc: BaseException) -> int:
    """The bytes an out-of-memory error says it tried to allocate (torch's CUDA message), else 0."""
    found = re.search(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)", str(exc))
    if not found:
        return 0
    return int(float(found.group(1)) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(found.group(2)))
