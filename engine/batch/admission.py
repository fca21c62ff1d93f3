"""Admission into the batched engine: while rows are free and chunks wait, their pages go through the vision tower
together (`engine.model.vision`), chunks of one prefix length are prefilled together (at most ``PREFILL_TOKENS`` prefix
tokens a forward) and each takes its first token in its row. Out of memory: the chunks not yet admitted go back to
the front of the queue, and the batch shrinks to the rows in flight."""

from __future__ import annotations

import time

import torch

from engine.batch.requests import ChunkResult
from engine.batch.rows import Row
from engine.model.vision import embed_chunks

PREFILL_TOKENS = 16384  # prefix tokens prefilled in one forward at most (chunks of one prefix length together)


def prefill_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of chunks grouped by prefix length, each group within ``budget`` tokens (at least one chunk)."""
    groups: list[list[int]] = []
    for length in sorted(set(lengths)):
        same = [i for i, n in enumerate(lengths) if n == length]
        per = max(1, budget // length)
        groups += [same[i : i + per] for i in range(0, len(same), per)]
    return groups


def admit(engine) -> list[ChunkResult]:
    """Admit what fits into ``engine`` (a `engine.batch.engine.BatchEngine`); the chunks that ended at once."""
    free = [i for i in range(engine.row_limit) if engine.rows[i] is None]
    take = [engine.pending.popleft() for _ in range(min(len(free), len(engine.pending)))]
    if not take:
        return []
    t0 = time.perf_counter()
    try:
        if engine.kv.ensure_capacity(max(len(r.inputs["input_ids"][0]) for r in take)) and engine.graphs is not None:
            engine.graphs.clear()  # captured over the old buffers
        inputs = [r.inputs.to(engine.loaded.device, dtype=engine.loaded.dtype) for r in take]
        embeds = embed_chunks(engine.loaded.model, engine.loaded.image_token_id, inputs, engine.vision_group,
                              engine.pad_vision)
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
                          engine.k_max)
                if engine.block is not None:
                    engine.block.start(rows[k], features[k])
                row.start(logits[k], prefill_s=share, eos=engine.eos)
                engine.rows[rows[k]] = row
                if row.done(engine.eos):
                    finished.append(engine._finish(row))
    except torch.OutOfMemoryError as exc:
        admitted = {id(r.request) for r in engine.rows if r is not None}
        engine.pending.extendleft(reversed([r for r in take if id(r) not in admitted]))
        if not engine.active:
            raise
        engine._shrink(engine.active, exc)
        return []
    return finished
