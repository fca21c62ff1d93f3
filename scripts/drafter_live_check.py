"""The live check of a block drafter (`scripts/train_drafter.py --eval-pages`): `lossless` with the block drafter
alone against `plain` on the same chunks of held-out pages, side by side on the engine's fast path (CUDA graphs on
a GPU): token-identical chunks, tau, acceptance by block position, the speed ratio and where a round's time goes
(ms per plain step, draft, verify round, single step, and per bare step by verify width).

``warmup`` chunks (other pages) are decoded by both sides first and not timed: graph capture, and compiling when
asked for, happen once per process and prefix size, so the timed chunks measure the steady state of a batch run
(each side's one-off cost is in the record as ``warmup_s``)."""

from __future__ import annotations

import time

from tqdm import tqdm


def evaluate(loaded, net, chunks, max_new_tokens: int, k_max: int, moe: str = "auto", linear: str = "auto",
             attn: str = "auto", draft_linear: str = "torch", block_sits_out: bool = True,
             compile_draft: bool = False, warmup: list | None = None, block_full_k: bool = False,
             device_drafts: bool = True) -> dict:
    """lossless with the block drafter alone vs plain on the same chunks (lists of page images), side by side
    (moe, linear, attn: the static step's, `engine.static_runner`; draft_linear: the drafter's static forward;
    block_sits_out, block_full_k: see `engine.speculative.SpeculativeDecoder`;
    compile_draft, device_drafts: `engine.drafters.block_static`;
    warmup: chunks decoded by both sides before the timed ones)."""
    from engine.fast_decoder import FastDecoder

    plain = FastDecoder(loaded, mode="plain", moe=moe, linear=linear, attn=attn)
    spec = FastDecoder(loaded, mode="lossless", k_max=k_max, drafters=("block",), block_net=net, moe=moe,
                       linear=linear, attn=attn, draft_linear=draft_linear, block_sits_out=block_sits_out,
                       compile_draft=compile_draft, block_full_k=block_full_k, device_drafts=device_drafts)
    warmup_s = {"plain": 0.0, "block": 0.0}
    for chunk in warmup or []:
        warmup_s["plain"] += plain.generate(chunk, max_new_tokens * len(chunk)).seconds
        warmup_s["block"] += spec.generate(chunk, max_new_tokens * len(chunk)).seconds
    rows, identical = [], 0
    for chunk in tqdm(chunks, desc="live check (plain, lossless+block)", unit="chunk"):
        a = plain.generate(chunk, max_new_tokens * len(chunk))
        b = spec.generate(chunk, max_new_tokens * len(chunk))
        identical += a.output_ids == b.output_ids
        s = b.extra["speculative"]
        p = a.extra["speculative"]
        rows.append({"tokens": len(b.output_ids), "plain_s": a.seconds, "block_s": b.seconds, "tau": s["tau"],
                     "draft_share": s["draft_share"], "rounds": s["verify_rounds"], "singles": s["single_steps"],
                     "draft_s": s["draft_s"], "verify_s": s["verify_s"], "single_s": s["single_s"],
                     "round_s": s["draft_s"] + s["verify_s"],
                     "plain_steps": p["single_steps"], "plain_step_s": p["single_s"],
                     "by_position": s["drafters"].get("block", {}).get("acceptance_by_position", [])})
    n = len(rows)

    def ms(num: str, den: str) -> float:
        return round(1000 * sum(r[num] for r in rows) / max(1, sum(r[den] for r in rows)), 3)

    return {"pages": sum(len(c) for c in chunks), "chunks": n, "identical": identical,
            "tau_mean": round(sum(r["tau"] for r in rows) / n, 3),
            "speedup_vs_plain": round(sum(r["plain_s"] for r in rows) / sum(r["block_s"] for r in rows), 3),
            "plain_s": round(sum(r["plain_s"] for r in rows), 2), "block_s": round(sum(r["block_s"] for r in rows), 2),
            "draft_share": round(sum(r["draft_share"] for r in rows) / n, 4),
            # where a round's time goes: ms per plain step, per draft, per verify round, per single step
            "ms_plain_step": ms("plain_step_s", "plain_steps"), "ms_draft": ms("draft_s", "rounds"),
            "ms_verify_round": ms("verify_s", "rounds"), "ms_single_step": ms("single_s", "singles"),
            "ms_round": ms("round_s", "rounds"),  # draft + verify: with device drafts the draft's GPU time is in verify
            "backend": b.extra["speculative"].get("backend", "eager"), "moe": b.extra["speculative"].get("moe"),
            "linear": b.extra["speculative"].get("linear"), "attn": b.extra["speculative"].get("attn"),
            "draft_linear": b.extra["speculative"].get("draft_linear"), "block_sits_out": block_sits_out,
            "block_full_k": block_full_k,
            "draft_compiled": b.extra["speculative"].get("draft_compiled"),
            "device_drafts": b.extra["speculative"].get("device_drafts"),
            "warmup_chunks": len(warmup or []), "warmup_s": {k: round(v, 2) for k, v in warmup_s.items()},
            "acceptance_by_position": mean_lists([r["by_position"] for r in rows]),
            "ms_step_by_width": step_ms_by_width(spec.static)}


def step_ms_by_width(runner, repeats: int = 50) -> dict[str, float]:
    """ms per bare ``runner.step`` (stage + forward + the one host sync, nothing committed) at each verify width
    the runner keeps, on the chunk it holds last: what a verify round costs before the loop's own work."""
    if runner is None or not runner.prefix_len:
        return {}
    out = {}
    for width in runner.widths:
        ids = [0] * width
        runner.step(ids)  # warm (a graph is captured already, or the eager body runs once)
        t = time.perf_counter()
        for _ in range(repeats):
            runner.step(ids)
        out[str(width)] = round(1000 * (time.perf_counter() - t) / repeats, 3)
    return out


def chunked(pages: list, size: int) -> list[list]:
    return [pages[i : i + max(1, size)] for i in range(0, len(pages), max(1, size))]


def mean_lists(lists):
    width = max((len(x) for x in lists), default=0)
    cols = [[x[j] for x in lists if j < len(x)] for j in range(width)]
    return [round(sum(c) / len(c), 3) for c in cols]
