"""Where a plain decode step's time goes on the GPU (issue 6): full-size random bf16 model, 1 page.

Times, per step: (a) graph replays back to back, one sync at the end (GPU time of the step body);
(b) ``runner.step`` (stage ids + replay + the one host sync); (c) a whole plain decode (b + the decode loop:
no-repeat rule, drafter policy, bookkeeping). a vs b is the launch/sync gap, b vs c the Python loop.
Then the top CUDA kernels of 20 replays (torch.profiler). Ends with one JSON line.

    python scripts/profile_step.py --moe auto,mixed --json OUT.json
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
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    from engine.fast_decoder import FastDecoder
    from engine.static_runner import bucket

    loaded, desc = build_model(False, "cuda", torch.bfloat16)
    clock = Clock("cuda")
    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "model": desc, "runs": {}}
    for moe in args.moe.split(","):
        dec = FastDecoder(loaded, mode="plain", k_max=16, backend="graphs", moe=moe, drafter_factory=lambda *_: [])
        _, row = run_engine(dec, [Page()], 512, clock)  # warm-up, captures graphs
        _, row = run_engine(dec, [Page()], 512, clock)
        runner = dec.static
        rec = {"decode_ms_per_token": round(1000 * row["seconds"] / row["tokens"], 3)}
        for width in (1, 2, 4, 8, 17):
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
        w = bucket(1, runner.widths)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                runner.graphs.replay(w, runner.prefix_bucket)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
        print(f"--- moe {moe}: top kernels of 20 width-1 replays\n{table}")
        record["runs"][moe] = rec
        print(moe, rec, flush=True)
    line = json.dumps(record)
    if args.json:
        Path(args.json).write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
