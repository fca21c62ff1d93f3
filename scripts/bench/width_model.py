"""The width choice on a modeled GPU: what `lossless` gains over `plain` for a given cost of wide steps, on any machine.

The real engine loop runs (`engine.batch.engine.BatchEngine`: admission in turns, each row's draft policy, the width
choice `engine.batch.step_width`, the acceptance rule) on the tiny model on the CPU, but each decode step's device
work is replaced by its outcome and its price: every row's target tokens are a fixed random text (its drafts: that
text with ``--rate`` % of the tokens wrong, the engine benchmarks' positional drafter), and a step of n rows and
width w costs ``base + kv * n + slope * n * (w - 1)`` on a virtual clock that the engine reads instead of the wall
clock (host work is free). Admission is not priced: the figures are decoding only.

Defaults model 16-page chunks on an H100 with the invariant kernels (the records of `scripts.bench.engine_scale` and
`scripts.bench.engine`): ``kv`` 97 us a row (plain's 17.5 ms step at ~160 rows of 4,374 prefix tokens, reading each
row's keys and values, less a 2 ms base), ``slope`` 14.5 us a token beyond width 1 (1-page chunks at 256 rows: 10.6 ms
at width 1, 22.6 ms at a mean width of 4.25). ``--slopes`` runs several slopes: what faster kernels for wide steps
would give. One chunk is admitted a turn (a 16-page chunk's prefix fills a turn's budget), ``--chunks`` over
``--rows`` rows (a second wave when more), each ``--tokens`` long.

Prints a table; the last line is one JSON object (also written to ``--json``).

    python -m scripts.bench.width_model --rows 160 --chunks 179 --tokens 2048 --slopes 14.5,7,3.5 \
        --json docs/results/width_model_16page_cpu.json
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

if not torch.cuda.is_available():  # the tiny model's prefills on the CPU (invariant kernels interpreted, if asked)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import engine.batch.engine as engine_module  # noqa: E402
from scripts.bench.engine import PositionalReplay, chunks_for, corrupt  # noqa: E402
from scripts.bench.random_model import build_model  # noqa: E402
from scripts.bench.record import finish  # noqa: E402


class VirtualClock:
    """Stands in for ``time`` in the engine module: the engine's step timings read the modeled cost."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


def run(loaded, mode: str, args, slope_us: float, clock: VirtualClock) -> dict:
    from engine.batch.engine import BatchEngine

    vocab = loaded.model.config.text_config.vocab_size
    reserved = {loaded.eos_token_id, loaded.bos_token_id, loaded.image_token_id}
    rng = random.Random(args.seed)
    truth = {k: [t for t in (rng.randrange(3, vocab) for _ in range(2 * args.tokens)) if t not in reserved][:args.tokens]
             for k in range(args.chunks)}
    drafts = {k: corrupt(v, args.rate / 100, vocab, seed=k) for k, v in truth.items()}
    factory = None if mode == "plain" else (lambda request: [PositionalReplay(drafts[request.key])])
    # no overlap: the clock charges a step when it is launched, and host work is free here anyway
    engine = BatchEngine(loaded, mode, max_batch=args.rows, drafter_factory=factory,
                         step_tokens=args.rows * args.step_tokens_per_row, overlap=False)
    engine.rules = {kind: (30, 1024) for kind in engine.rules}  # random texts never meet the no-repeat rule
    requests = [engine.prepare(c, args.tokens, key=i) for i, c in enumerate(chunks_for(args.chunks, 1))]
    engine.admit_tokens = len(requests[0].prompt_ids)  # one chunk a turn

    def modeled_step(n: int, w: int, prefix_bucket: int) -> torch.Tensor:
        """The step's summary as the device would give it: each row's target tokens after its staged ones."""
        rows = np.zeros((n, w, 5), dtype=np.float32)
        for row in engine.rows:
            if row is None or row.index >= n:
                continue
            target, done = truth[row.request.key], len(row.output)
            rows[row.index, :, 0] = [target[done + j] if done + j < len(target) else 3 for j in range(w)]
            rows[row.index, : w - 1, 4] = engine.kv.host_ids[row.index, 1:w]
        clock.now += (args.base_ms / 1000) + args.kv_us * 1e-6 * n + slope_us * 1e-6 * n * (w - 1)
        return torch.from_numpy(rows)

    engine._run = modeled_step
    clock.now = 0.0
    results = engine.run(requests)
    tokens = sum(len(r.output_ids) for r in results)
    rounds = sum(r.stats["verify_rounds"] for r in results)
    exact = all(r.output_ids[1:] == truth[r.request.key][1 : len(r.output_ids)] for r in results)
    return {"seconds": round(clock.now, 3), "tokens": tokens, "tok_s": round(tokens / max(clock.now, 1e-9), 1),
            "steps": engine.steps, "steps_by_width": {str(w): c for w, c in sorted(engine.width_steps.items())},
            "tau": round(sum(r.stats["accepted_tokens"] for r in results) / rounds, 3) if rounds else 0.0,
            "probes": engine.step_width.probes, "calibration": round(engine.step_width.calibration, 3),
            "width_reasons": dict(sorted(engine.step_width.reasons.items())),
            "targets_followed": exact}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rows", type=int, default=160)
    ap.add_argument("--chunks", type=int, default=179)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rate", type=float, default=10.0, help="%% of draft tokens wrong")
    ap.add_argument("--slopes", default="14.5", help="us a token beyond width 1, comma-separated")
    ap.add_argument("--kv-us", type=float, default=97.0, help="us a row of every step (its keys and values read)")
    ap.add_argument("--base-ms", type=float, default=2.0, help="ms of every step (weights, launches)")
    ap.add_argument("--step-tokens-per-row", type=int, default=8, help="as auto sizes a drafting mode's steps")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    loaded, desc = build_model(True, "cpu", torch.float32)
    clock = VirtualClock()
    real_time = engine_module.time
    engine_module.time = clock
    report = {"benchmark": "bench_width_model", "argv": sys.argv[1:] if argv is None else argv,
              "model": {"name": loaded.name}, "rows": args.rows, "chunks": args.chunks, "tokens": args.tokens,
              "rate": args.rate, "kv_us": args.kv_us, "base_ms": args.base_ms, "slopes": {}}
    try:
        plain = run(loaded, "plain", args, 0.0, clock)
        report["plain"] = plain
        print(f"plain: {plain['seconds']} s modeled, {plain['tok_s']} tok/s, {plain['steps']} steps")
        for slope in [float(s) for s in args.slopes.split(",") if s]:
            row = run(loaded, "lossless", args, slope, clock)
            row["x_plain"] = round(plain["seconds"] / row["seconds"], 3)
            report["slopes"][f"{slope:g}"] = row
            print(f"lossless-{args.rate:g}% at {slope:g} us a token beyond width 1: {row['x_plain']}x plain, "
                  f"{row['steps']} steps {row['steps_by_width']}, tau {row['tau']}, calibration {row['calibration']}")
    finally:
        engine_module.time = real_time
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    finish(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
