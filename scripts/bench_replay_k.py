"""What a lossless re-run costs by replay draft length (issue 8's "re-run <= 1/4 of a first lossless run").

For chunks of held-out image-only synthetic pages (seeds 850,000+): a first ``lossless`` decode as uflash runs it
(the model folder's block drafter included), then re-runs with the first output as the replay draft at each
``--k`` (most draft tokens per verify round), each checked token-identical to the first. Prints a table (seconds,
share of the first run, forwards) and ends with one JSON line.

    python scripts/bench_replay_k.py --model models/demo --dtype float32 --chunks 2 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.chunk_decode import load_decoder  # noqa: E402
from engine.fast_decoder import FastDecoder  # noqa: E402
from scripts.train_drafter import synthetic_pages  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--pages-per-chunk", type=int, default=4)
    ap.add_argument("--k", default="16,32,64", help="replay draft lengths to compare")
    ap.add_argument("--max-new-tokens", type=int, default=1500, help="per page")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    first_decoder = load_decoder(args.model, args.device, args.dtype, mode="lossless")
    loaded = first_decoder.loaded
    ks = [int(k) for k in args.k.split(",")]
    pages, _ = synthetic_pages(args.chunks * args.pages_per_chunk, 850_000)
    rows = []
    print(f"{'chunk':>5} {'tokens':>6} {'first s':>8} " + " ".join(f"{'k' + str(k) + ' s':>8} {'share':>6} {'fwd':>5}"
                                                           for k in ks))
    for c in range(args.chunks):
        chunk = pages[c * args.pages_per_chunk:(c + 1) * args.pages_per_chunk]
        limit = args.max_new_tokens * len(chunk)
        t = time.perf_counter()
        first = first_decoder.generate(chunk, limit)
        row = {"tokens": len(first.output_ids), "first_s": round(time.perf_counter() - t, 3), "rerun": {}}
        for k in ks:
            rerun_decoder = FastDecoder(loaded, mode="lossless", k_max=k, replay_k_max=k)  # graphs on a GPU
            t = time.perf_counter()
            res = rerun_decoder.generate(chunk, limit, replay_ids=first.output_ids)
            seconds = time.perf_counter() - t
            if res.output_ids != first.output_ids:
                raise SystemExit(f"chunk {c}: the k={k} re-run differs from the first run")
            row["rerun"][str(k)] = {"s": round(seconds, 3), "share": round(seconds / row["first_s"], 3),
                                    "forwards": res.extra["speculative"]["forwards"]}
        rows.append(row)
        cells = [row["rerun"][str(k)] for k in ks]
        print(f"{c:>5} {row['tokens']:>6} {row['first_s']:>8.2f} "
              + " ".join(f"{x['s']:>8.2f} {x['share']:>6.2f} {x['forwards']:>5}" for x in cells), flush=True)
    first_total = sum(r["first_s"] for r in rows)
    record = {"bench": "replay_k", "model": args.model, "device": str(loaded.device), "dtype": str(loaded.dtype),
              "torch_threads": torch.get_num_threads(), "pages_per_chunk": args.pages_per_chunk, "chunks": rows,
              "first_s": round(first_total, 3),
              "share_by_k": {str(k): round(sum(r["rerun"][str(k)]["s"] for r in rows) / first_total, 3) for k in ks}}
    line = json.dumps(record)
    if args.json:
        Path(args.json).write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
