"""The batched engine at scale: multi-page chunks at the batch ``auto`` picks, and a forced out-of-memory run.

Same model as `scripts.bench.engine` (full-size architecture, random planted weights in bf16 on the GPU; ``--tiny``
on the CPU as a smoke test), chunks of ``--pages`` pages (16 by default, the real model's setting):
1. ``auto``: the rows `engine.batch.memory.auto_batch` picks for chunks of that prefix on this GPU (k_max drafts),
   as many chunks as rows, each decoding ``--tokens``; ``plain`` then ``lossless-R%`` for R in ``--rates`` (drafts:
   each chunk's plain output with R% of its tokens wrong), every run cold (no warm-up: it pays its own graph captures
   and kernel compilations, as a worker's first batch does). Figures: tokens/s end to end and decoding only,
   admission (vision, prefill), time to the first finished chunk, capture time, steps by width, peak memory.
2. ``forced``: ``--oom-factor`` times the auto rows (at least one more row than fits), as many chunks, each decoding
   ``--oom-tokens``: the cache, the admission or a step runs out of memory and the engine shrinks. Figures: chunks
   ended, chunks ended more than once (must be 0), chunks whose tokens equal the first tokens of the same chunk's
   ``auto`` plain run (must be all of those it ran), the rows it settled on, the error if it failed.

The last line is one JSON object (also written to ``--json``, after each part).

    python -m scripts.bench.engine_scale --pages 16 --tokens 1024 --rates 10 --json $OUT/bench_engine_scale.json
    python -m scripts.bench.engine_scale --tiny --pages 2 --tokens 16 --oom-tokens 8 --max-rows 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from engine.batch.memory import STEP_TOKENS_PER_ROW
from engine.kernels.tiles import TILES
from scripts.bench.engine import (
    ENGINE_OPTIONS,
    add_engine_options,
    build_model,
    chunks_for,
    corrupt,
    environment,
    free_gb,
    run_engine,
)


def auto_rows(loaded, pages: int, k_max: int, cap: int | None, drafting: bool = True) -> tuple[int, int]:
    """(rows auto picks for chunks of ``pages`` pages in a mode that drafts or not, their prefix length)."""
    from engine.batch.memory import auto_batch
    from engine.official import chunk_inputs

    prefix = len(chunk_inputs(loaded, chunks_for(1, pages)[0], "single" if pages == 1 else "multi")["input_ids"][0])
    rows = auto_batch(loaded, prefix, k_max, drafting)
    return (min(rows, cap) if cap else rows), prefix


def run_auto(loaded, args, log) -> tuple[dict, dict]:
    """Each mode at its own ``auto`` rows, from the free memory it starts with (the run before gave its own back);
    the chunks of a lossless run are the first of the plain run's (drafts are that run's outputs)."""
    vocab = loaded.model.config.text_config.vocab_size
    out, plain_ids = {"runs": {}, "errors": {}}, None
    for name, rate in [("plain", None)] + [(f"lossless-{r}%", r) for r in args.rates]:
        try:
            if rate is not None and plain_ids is None:
                raise RuntimeError("no plain run to draw the drafts from (it failed above)")
            rows, prefix = auto_rows(loaded, args.pages, args.k_max, args.max_rows, drafting=rate is not None)
            if rate is not None:
                rows = min(rows, len(plain_ids))
            out.setdefault("rows", rows)  # plain's
            out["prefix_tokens"] = prefix
            free = free_gb() if args.device == "cuda" else None
            log(f"{name}: auto {rows} rows of {args.pages}-page chunks ({prefix} prefix tokens), {free} GiB free")
            chunks = chunks_for(rows, args.pages)
            drafts = None if rate is None else {k: corrupt(plain_ids[k], rate / 100, vocab, seed=rate + 17 * k)
                                                for k in range(rows)}
            row, ids, _, ends = run_engine(loaded, chunks, args.tokens, args.device, "plain" if rate is None else
                                           "lossless", args.kernels, drafts, k_max=args.k_max, warm=False,
                                           step_tokens=None if rate is None else rows * STEP_TOKENS_PER_ROW)
            row["auto_rows"] = rows
            row["chunks_ended"], row["ended_twice"] = len(ends), sum(c > 1 for c in ends.values())
            if rate is None:
                plain_ids = ids
            else:
                row["equal_to_plain"] = ids == {k: plain_ids[k] for k in ids}
                row["x_plain"] = round(row["tok_s"] / out["runs"]["plain"]["tok_s"], 3)
                row["x_plain_decoding"] = round(row["decode_tok_s"] / out["runs"]["plain"]["decode_tok_s"], 3)
            out["runs"][name] = row
            log(f"  {name}: {row['tok_s']} tok/s ({row['decode_tok_s']} decoding), {row['ms_per_step']} ms/step, "
                f"admission {row['admit_s']} s, first chunk {row['first_chunk_done_s']} s, capture "
                f"{row['capture_s']} s, widths {row['steps_by_width']} ({row['width_reasons']}), peak {row['peak_gb']} GB")
        except Exception as exc:  # noqa: BLE001 - record, go on
            out["errors"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
    return out, plain_ids or {}


def run_forced(loaded, args, rows: int, plain_ids: dict, log) -> dict:
    forced = max(rows + 1, int(rows * args.oom_factor))
    log(f"forced: {forced} rows and chunks ({rows} fit by the estimate)")
    out = {"rows_asked": forced, "chunks": forced}
    try:
        row, ids, _, ends = run_engine(loaded, chunks_for(forced, args.pages), args.oom_tokens, args.device, "plain",
                                       args.kernels, k_max=args.k_max, warm=False)
        checked = [k for k in ids if k in plain_ids]
        out.update(row, chunks_ended=len(ends), ended_twice=sum(c > 1 for c in ends.values()),
                   lost=forced - len(ends), checked_against_auto=len(checked),
                   equal_to_auto_prefix=sum(ids[k] == plain_ids[k][: len(ids[k])] for k in checked))
        log(f"  ended {out['chunks_ended']} of {forced}, twice {out['ended_twice']}, equal "
            f"{out['equal_to_auto_prefix']}/{len(checked)}; settled at {row['row_limit']} rows (cache "
            f"{row['cache_rows']}), {row['admit_pages']} pages an admission group")
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        traceback.print_exc()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tiny", action="store_true", help="tiny config on the CPU (smoke test)")
    ap.add_argument("--pages", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rates", default="10", help="draft error rates in %%")
    ap.add_argument("--k-max", type=int, default=16)
    ap.add_argument("--kernels", default=None)
    ap.add_argument("--max-rows", type=int, default=None, help="cap the auto rows (a shorter run)")
    ap.add_argument("--oom-factor", type=float, default=2.0, help="forced run: this many times the auto rows (0: none)")
    ap.add_argument("--oom-tokens", type=int, default=32)
    ap.add_argument("--plant", type=float, default=100.0)
    add_engine_options(ap)
    args = ap.parse_args(argv)
    ENGINE_OPTIONS.update(attention=args.vision_attention, ahead=args.vision_ahead, overlap=args.overlap == "on")
    t_start = time.perf_counter()
    args.device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    args.kernels = args.kernels or ("invariant" if args.device == "cuda" else "torch")
    args.rates = [int(r) for r in args.rates.split(",") if r]
    if args.tiny:
        torch.set_num_threads(2)

    def log(msg):
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    def save(report):
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1))

    loaded, desc = build_model(args.tiny, args.device, dtype, plant=args.plant)
    log(f"model built: {desc}")
    report = {"benchmark": "bench_engine_scale", "argv": sys.argv[1:] if argv is None else argv,
              "environment": environment(args.device), "model": {"name": loaded.name, **desc},
              "dtype": str(dtype).removeprefix("torch."), "pages": args.pages, "tokens": args.tokens,
              "k_max": args.k_max, "kernels": args.kernels}
    report["auto"], plain_ids = run_auto(loaded, args, log)
    save(report)
    if args.oom_factor > 0:
        report["forced"] = run_forced(loaded, args, report["auto"]["rows"], plain_ids, log)
    report["tiles"] = TILES.summary()  # the invariant kernels' tiles the runs used (engine.kernels.tiles)
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    save(report)
    print(json.dumps(report, separators=(",", ":")))
    failed = report["auto"]["errors"] or "error" in report.get("forced", {})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
