"""A planted repetition loop at full size: the engine stops it while it happens (`engine.batch.loop_watch`).

The full-size random model of `scripts.bench.engine` (bf16 on the GPU; ``--tiny`` on the CPU as a smoke test) with
its successor chain planted as a cycle of ``--period`` tokens entered from the prompts: every chunk repeats the same
tokens for ever, as a page caught in a loop does. ``--rows`` chunks of each ``--pages`` size decode up to
``--tokens`` new tokens, in ``plain`` and in ``lossless`` (the n-gram drafter drafts the loop), with the pipeline's
repetition rule (`ingest.quality.measures.loop_stopper`). Reported per chunk size and mode: where each chunk stopped,
its finish reason, the tokens past the start of the repetition (the first token that repeats the one ``--period``
before it), seconds, and whether both modes stopped at the same token with the same tokens. The last line is one
JSON object (also written to ``--json``).

    python -m scripts.bench.loop_stop --pages 1,16 --rows 8 --json $OUT/loop_stop.json
    python -m scripts.bench.loop_stop --tiny --pages 1 --rows 2 --tokens 700
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from scripts.bench.engine import build_model, chunks_for, environment, sync
from scripts.bench.record import finish


def loop_start(ids: list[int], period: int) -> int | None:
    """The first token that repeats the one ``period`` tokens before it."""
    return next((i for i in range(period, len(ids)) if ids[i] == ids[i - period]), None)


def run_mode(loaded, chunks, mode: str, args) -> tuple[dict, dict]:
    from engine.batch.engine import BatchEngine
    from ingest.quality.measures import loop_stopper

    engine = BatchEngine(loaded, mode, max_batch=len(chunks), kernels=args.kernels, drafters=("ngram",),
                         loop_check=loop_stopper())
    sync(args.device)
    t0 = time.perf_counter()
    results = engine.run([engine.prepare(c, args.tokens, key=i) for i, c in enumerate(chunks)])
    sync(args.device)
    seconds = time.perf_counter() - t0
    engine.close()
    stops = [len(r.output_ids) for r in results]
    starts = [loop_start(r.output_ids, args.period) for r in results]
    row = {"seconds": round(seconds, 3), "stopped_at": stops, "finish": sorted({r.finish_reason for r in results}),
           "tokens_past_loop_start": [s - (b if b is not None else s) for s, b in zip(stops, starts)],
           "tau": round(sum(r.stats["tau"] for r in results) / len(results), 3)}
    return row, {i: r.output_ids for i, r in enumerate(results)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tiny", action="store_true", help="tiny config on the CPU (smoke test)")
    ap.add_argument("--pages", default="1,16")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096, help="each chunk's token limit (where it would end unstopped)")
    ap.add_argument("--period", type=int, default=150, help="tokens in the planted loop's unit")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    args.device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    args.kernels = "invariant" if args.device == "cuda" else "torch"
    if args.tiny:
        torch.set_num_threads(2)
    loaded, desc = build_model(args.tiny, args.device, dtype, plant=100.0, loop=args.period)
    report = {"benchmark": "bench_loop_stop", "argv": sys.argv[1:] if argv is None else argv,
              "environment": environment(args.device), "model": {"name": loaded.name, **desc},
              "dtype": str(dtype).removeprefix("torch."), "tokens": args.tokens, "period": args.period, "results": []}
    print(f"{'pages':>5} {'mode':<9}{'seconds':>9} {'stopped at':<22}{'past start':<22}{'tau':>6}  finish")
    ok = True
    for pages in [int(p) for p in args.pages.split(",")]:
        chunks = chunks_for(args.rows, pages)
        res = {"pages": pages, "rows": args.rows, "runs": {}}
        ids = {}
        for mode in ("plain", "lossless"):
            res["runs"][mode], ids[mode] = run_mode(loaded, chunks, mode, args)
            r = res["runs"][mode]
            print(f"{pages:>5} {mode:<9}{r['seconds']:>9.2f} {min(r['stopped_at'])}-{max(r['stopped_at']):<17}"
                  f"{min(r['tokens_past_loop_start'])}-{max(r['tokens_past_loop_start']):<17}{r['tau']:>6.2f}  "
                  f"{','.join(r['finish'])}")
        res["lossless_equal_to_plain"] = ids["plain"] == ids["lossless"]
        res["max_tokens_past_loop_start"] = max(max(r["tokens_past_loop_start"]) for r in res["runs"].values())
        ok &= res["lossless_equal_to_plain"] and all(r["finish"] == ["repetition"] for r in res["runs"].values())
        report["results"].append(res)
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    finish(report, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
