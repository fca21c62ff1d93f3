"""The live check of a block drafter (`scripts/train/drafter.py --eval-pages`): `lossless` with the block drafter
alone against `plain` on the same chunks of held-out pages, side by side on `engine.batch.engine.BatchEngine` (CUDA
graphs on a GPU): token-identical chunks, tau, acceptance by block position, the speed ratio and where a step's time
goes (ms per plain step, draft, verify round, single step, and the engine's measured cost per step width).

``batch=False``: each chunk alone (batch 1), plain then lossless, chunk after chunk: the figure a single document
sees. ``batch=True``: every chunk in one batch on each side (as many rows as chunks): the figure of a batch run,
where the engine's step-width chooser cuts drafts that do not pay for their width.

``warmup`` chunks (other pages) are decoded by both sides first and not timed: graph capture happens once per
process, row count, width and prefix size, so the timed chunks measure the steady state of a batch run (each
side's one-off cost is in the record as ``warmup_s``)."""

from __future__ import annotations

import time

import torch
from tqdm import tqdm


def _timed_run(engine, chunks: list[list], max_new_tokens: int) -> tuple[list, float]:
    """(results, wall seconds) of ``chunks`` decoded together by ``engine`` (the processor runs before the clock)."""
    requests = [engine.prepare(chunk, max_new_tokens * len(chunk)) for chunk in chunks]
    device = engine.loaded.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    results = engine.run(requests)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return results, time.perf_counter() - start


def evaluate(loaded, net, chunks: list[list], max_new_tokens: int, k_max: int, block_sits_out: bool = True,
             block_full_k: bool = False, warmup: list | None = None, batch: bool = False) -> dict:
    """lossless with the block drafter alone vs plain on the same chunks (lists of page images; ``max_new_tokens``
    per page), side by side. block_sits_out, block_full_k: `engine.batch.engine.BatchEngine`'s; warmup: chunks
    decoded by both sides before the timed ones; batch: every chunk in one batch (else each alone)."""
    from engine.batch.engine import BatchEngine
    from engine.loading import default_kernels

    rows_wanted = len(chunks) if batch else 1
    common = {"max_batch": max(rows_wanted, 1), "kernels": default_kernels(loaded)}
    plain = BatchEngine(loaded, "plain", **common)
    spec = BatchEngine(loaded, "lossless", k_max=k_max, drafters=("block",), block_net=net,
                       block_sits_out=block_sits_out, block_full_k=block_full_k, **common)
    warmup_s = {"plain": 0.0, "block": 0.0}
    for chunk in warmup or []:
        warmup_s["plain"] += _timed_run(plain, [chunk], max_new_tokens)[1]
        warmup_s["block"] += _timed_run(spec, [chunk], max_new_tokens)[1]
    if batch:
        a, plain_s = _timed_run(plain, chunks, max_new_tokens)
        b, block_s = _timed_run(spec, chunks, max_new_tokens)
    else:
        a, b, plain_s, block_s = [], [], 0.0, 0.0
        for chunk in tqdm(chunks, desc="live check (plain, lossless+block)", unit="chunk"):
            (pa,), ta = _timed_run(plain, [chunk], max_new_tokens)
            (pb,), tb = _timed_run(spec, [chunk], max_new_tokens)
            a.append(pa)
            b.append(pb)
            plain_s += ta
            block_s += tb
    rows = []
    for pa, pb in zip(a, b):
        s, p = pb.stats, pa.stats
        rows.append({"tau": s["tau"], "draft_share": s["draft_share"], "rounds": s["verify_rounds"],
                     "singles": s["single_steps"], "draft_s": s["draft_s"], "verify_s": s["verify_s"],
                     "single_s": s["single_s"], "round_s": s["draft_s"] + s["verify_s"],
                     "plain_steps": p["single_steps"], "plain_step_s": p["single_s"],
                     "by_position": s["drafters"].get("block", {}).get("acceptance_by_position", [])})
    n = len(rows)

    def ms(num: str, den: str) -> float:
        return round(1000 * sum(r[num] for r in rows) / max(1, sum(r[den] for r in rows)), 3)

    tokens = sum(len(r.output_ids) for r in b)
    return {"pages": sum(len(c) for c in chunks), "chunks": n, "batch": rows_wanted, "tokens": tokens,
            "identical": sum(pa.output_ids == pb.output_ids for pa, pb in zip(a, b)),
            "tau_mean": round(sum(r["tau"] for r in rows) / max(1, n), 3),
            "speedup_vs_plain": round(plain_s / block_s, 3) if block_s else None,
            "plain_s": round(plain_s, 4), "block_s": round(block_s, 4),
            "plain_tok_s": round(sum(len(r.output_ids) for r in a) / plain_s, 1) if plain_s else None,
            "block_tok_s": round(tokens / block_s, 1) if block_s else None,
            "draft_share": round(sum(r["draft_share"] for r in rows) / max(1, n), 4),
            # where a step's time goes (a row's share of each step it took part in): ms per plain step, per draft,
            # per verify round, per single step; the block draft stays on the device, so its GPU time is in verify
            "ms_plain_step": ms("plain_step_s", "plain_steps"), "ms_draft": ms("draft_s", "rounds"),
            "ms_verify_round": ms("verify_s", "rounds"), "ms_single_step": ms("single_s", "singles"),
            "ms_round": ms("round_s", "rounds"),
            "backend": "graphs" if spec.graphs is not None else "eager", "kernels": spec.forward.kernels,
            "k_max": k_max, "block_sits_out": block_sits_out, "block_full_k": block_full_k,
            "warmup_chunks": len(warmup or []), "warmup_s": {k: round(v, 2) for k, v in warmup_s.items()},
            "acceptance_by_position": mean_lists([r["by_position"] for r in rows]),
            "ms_step_by_width": step_ms_by_width(spec)}


def step_ms_by_width(engine) -> dict[str, float]:
    """The engine's own measure of a step's cost (`engine.batch.step_width`: an average per row bucket, prefix bucket,
    width and whether the block drafter drafted), keyed ``rows x width @ prefix`` (``+block`` when it drafted)."""
    return {f"{rows}x{width}@{prefix}{'+block' if block else ''}": round(1000 * seconds, 3)
            for (rows, prefix, width, block), seconds in sorted(engine.step_width.cost.items())}


def chunked(pages: list, size: int) -> list[list]:
    return [pages[i : i + max(1, size)] for i in range(0, len(pages), max(1, size))]


def mean_lists(lists):
    width = max((len(x) for x in lists), default=0)
    cols = [[x[j] for x in lists if j < len(x)] for j in range(width)]
    return [round(sum(c) / len(c), 3) for c in cols]
