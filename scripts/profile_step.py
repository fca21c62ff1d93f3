"""Where a decode step's time goes on the GPU (issue 6): full-size random bf16 model, a chunk of ``--pages``.

Times, per step: (a) graph replays back to back, one sync at the end (GPU time of the step body);
(b) ``runner.step`` (stage ids + replay + the one host sync); (c) a whole plain decode (b + the decode loop:
no-repeat rule, drafter policy, bookkeeping). a vs b is the launch/sync gap, b vs c the Python loop.
Then the top CUDA kernels of 20 replays at width 1 and at the widest verify (torch.profiler). One record per
(moe, attn) pair; ``--pages 16`` puts ~4.4K prefix keys under every query, where the decode attention's kernel
choice shows. Ends with one JSON line.

    python scripts/profile_step.py --moe auto,mixed --json OUT.json
    python scripts/profile_step.py --pages 16 --moe mixed --attn sdpa,matmul --json OUT.json
    python scripts/profile_step.py --model models/demo --dtype float32 --k-max 8 --moe gather,dense --json OUT.json

``--model FOLDER`` profiles a checkpoint (a blank white page per chunk page) instead of the random full-size one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_engine import Clock, Page, build_model, run_engine  # noqa: E402


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe", default="auto")
    ap.add_argument("--attn", default="auto", help="comma-separated decode attention: auto,sdpa,matmul,matmul_t")
    ap.add_argument("--pages", type=int, default=1, help="pages in the chunk (prefix = 273 tokens per page + prompt)")
    ap.add_argument("--compile", action="store_true", help="compile the step body (slow to start: ~25 s per width)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model", help="a checkpoint folder (default: the random full-size model)")
    ap.add_argument("--dtype", default="bfloat16", help="with --model: float32 or bfloat16")
    ap.add_argument("--linear", default="auto", help="the step's projections: auto, torch, bmv")
    ap.add_argument("--ops", action="store_true", help="also profile the eager step body per op, with shapes")
    ap.add_argument("--k-max", type=int, default=16, help="drafts per verify (widest step = k_max + 1)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    from engine.fast_decoder import FastDecoder
    from engine.static_runner import bucket

    if args.model:
        from PIL import Image

        from engine.model import load_model

        loaded = load_model(args.model, "cuda", args.dtype)
        desc = {"folder": args.model, "dtype": args.dtype}
        pages = [Image.new("RGB", (1024, 1024), "white") for _ in range(args.pages)]
    else:
        loaded, desc = build_model(False, "cuda", torch.bfloat16)
        pages = [Page() for _ in range(args.pages)]
    clock = Clock("cuda")
    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "model": desc, "pages": args.pages,
              "compile": args.compile, "k_max": args.k_max, "runs": {}}
    for moe, attn in [(m, a) for m in args.moe.split(",") for a in args.attn.split(",")]:
        dec = FastDecoder(loaded, mode="plain", k_max=args.k_max, backend="graphs", moe=moe, attn=attn,
                          compile_step=args.compile, drafter_factory=lambda *_: [], linear=args.linear)
        _, row = run_engine(dec, pages, 512, clock)  # warm-up, captures graphs
        _, row = run_engine(dec, pages, 512, clock)
        runner = dec.static
        rec = {"prefix_len": runner.prefix_len, "prefix_bucket": runner.prefix_bucket,
               "decode_ms_per_token": round(1000 * (row["seconds"] - row["time_split"]["prefill_s"]) / row["tokens"], 3)}
        for width in sorted({1, 2, 4, 8, runner.max_width} & set(range(1, runner.max_width + 1))):
            w = bucket(width, runner.widths)
            runner.step([5] * width)  # stages ids/positions in the static inputs; replays below reuse them
            runner.commit(0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                runner.graphs.replay(w, runner.prefix_bucket)
            torch.cuda.synchronize()
            rec[f"replay_ms_w{width}"] = round(1000 * (time.perf_counter() - t0) / args.steps, 3)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            runner.step([5])
            runner.commit(0)
        rec["runner_step_ms_w1"] = round(1000 * (time.perf_counter() - t0) / args.steps, 3)
        for width in sorted({1, 4, runner.max_width}):
            runner.step([5] * width)
            runner.commit(0)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    runner.graphs.replay(width, runner.prefix_bucket)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
            print(f"--- moe {moe}, attn {attn}: top kernels of 20 width-{width} replays\n{table}")
            if args.ops:  # the same step run eagerly: which op (and shapes) each kernel belongs to
                activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
                    for _ in range(5):
                        runner.step_body(width, runner.prefix_bucket)
                    torch.cuda.synchronize()
                table = prof.key_averages(group_by_input_shape=True).table(sort_by="cuda_time_total", row_limit=14,
                                                                           max_name_column_width=40,
                                                                           max_shapes_column_width=70)
                print(f"--- moe {moe}, attn {attn}: top ops of 5 eager width-{width} steps\n{table}")
        record["runs"][f"{moe}/{attn}"] = rec
        print(moe, attn, rec, flush=True)
    line = json.dumps(record)
    if args.json:
        Path(args.json).write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
