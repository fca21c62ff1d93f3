"""What one decode step costs, by rows and width, and where its time goes: the engine's step alone (no vision, no
admission, no drafting), on the benchmarks' random full-size model in bf16 (`scripts.bench.random_model`).

1. ``steps``: for each prefix (``--pages``: the prefix of a chunk of that many pages), rows (``--rows``) and width
   (``--widths``), the step graph `engine.model.forward.BatchForward.step_body` replayed ``--repeat`` times: ms a
   step, ms a token, and the cost against width 1 at the same rows (what a verify of that width must win back); with
   the kernels' default tiles, then with the tiles `engine.kernels.tiles` measures (``--tiles``; the choice and its
   measures under ``tiles``).
2. ``profile``: the step's device time by kernel for each ``--profile ROWSxWIDTH`` pair at the first prefix (one
   eager step under ``torch.profiler``; kernel times do not depend on how the step was launched).
3. ``matmul``: the invariant linear kernel (`engine.kernels.invariant.matmul`) at each of the model's weight shapes and
   ``--matmul-rows`` rows, with each tile configuration of ``--configs``: ms and TFLOP/s, and whether its outputs are
   bitwise those of the default configuration (row by row, at every row count: what lets a configuration be chosen
   by row count without changing one token); ``grouped``: the same for the routed experts' grouped kernel at as many
   tokens, random routing.

Prints tables; the last line is one JSON object (also written to ``--json``).

    python -m scripts.bench.step_cost --pages 1,16 --rows 1,64,160,256 --widths 1,2,4,8,16 --profile 256x1,256x4 \
        --json $OUT/step_cost.json
    python -m scripts.bench.step_cost --tiny --pages 1 --rows 1,2 --widths 1,2 --profile 2x2 --matmul-rows 1,8
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the invariant kernels under Triton's interpreter (--tiny), set before any import
    os.environ.setdefault("TRITON_INTERPRET", "1")  # of triton.language

from engine.kernels.tiles import TILES, time_ms  # noqa: E402
from scripts.bench.engine import environment  # noqa: E402
from scripts.bench.random_model import build_model  # noqa: E402
from scripts.bench.record import finish, save  # noqa: E402

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); the first is the kernels' own
CONFIGS = "64-64-64-4-3,64-128-64-4-3,64-128-64-4-4,128-64-64-4-3,128-128-64-8-3,128-128-64-4-4,64-256-64-8-3," \
          "128-256-64-8-3"


def prefix_tokens(loaded, pages: int) -> int:
    from engine.official import chunk_inputs
    from scripts.bench.engine import chunks_for

    kind = "single" if pages == 1 else "multi"
    return len(chunk_inputs(loaded, chunks_for(1, pages)[0], kind)["input_ids"][0])


@torch.inference_mode()
def make_forward(loaded, rows: int, max_width: int, prefix: int):
    """A cache of ``rows`` rows each holding a ``prefix``-token prefix (contents zero: cost does not depend on them),
    the staged ids random, and the step forward over it with the invariant kernels."""
    from engine.model.forward import BatchForward
    from engine.model.kv_slots import PREFIX_BUCKETS, KVSlots, bucket

    config = loaded.model.config.text_config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = KVSlots(num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
                 window=config.sliding_window, max_batch=rows, max_width=max_width,
                 prefix_capacity=bucket(prefix, PREFIX_BUCKETS), dtype=loaded.dtype, device=loaded.device)
    if kv.rows < rows:
        raise torch.OutOfMemoryError(f"the cache holds {kv.rows} rows of {prefix} prefix tokens, not {rows}")
    for row in range(rows):
        kv.open_row(row, prefix)
    gen = torch.Generator().manual_seed(0)
    kv.host_ids[:] = torch.randint(2, config.vocab_size, kv.host_ids.shape, generator=gen).numpy()
    kv.host_pos[:] = (prefix + torch.arange(max_width))[None].numpy()
    kv.stage()
    forward = BatchForward(loaded.model, kv, kernels="invariant", step_tokens=rows * max_width)
    return kv, forward, bucket(prefix, PREFIX_BUCKETS)


def bench_steps(loaded, prefix: int, rows_list: list[int], widths: list[int], repeat: int, device: str, log) -> dict:
    out = {}
    kv, forward, prefix_bucket = make_forward(loaded, max(rows_list), max(widths), prefix)
    graphs = None
    if device.startswith("cuda"):
        from engine.kernels.step_graphs import StepGraphs

        graphs = StepGraphs(forward.step_key, loaded.device, max_groups=1, capture_after=1)
    with torch.inference_mode():
        for rows in rows_list:
            base = None
            for w in widths:
                key = (rows, w, prefix_bucket)
                run = partial(graphs.replay if graphs is not None else forward.step_key, key)
                ms = time_ms(run, repeat, warmup=1)
                base = ms if w == 1 else base
                cell = {"ms": round(ms, 3), "ms_per_token": round(ms / (rows * w), 4),
                        "x_width1": round(ms / base, 3) if base else None}
                out[f"{rows}x{w}"] = cell
                log(f"  prefix {prefix:5d}  rows {rows:4d}  width {w:2d}: {ms:8.3f} ms a step, "
                    f"{cell['ms_per_token']:.4f} ms a token, {cell['x_width1']}x width 1")
            if graphs is not None:
                graphs.clear()
    del graphs, forward, kv
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def kernel_name(name: str) -> str:
    for short in ("_matmul_kernel", "_grouped_kernel", "_step_attention_kernel", "_rms_norm_kernel",
                  "_logsumexp_kernel"):
        if short in name:
            return short
    return name[:80]


def bench_profile(loaded, prefix: int, pairs: list[tuple[int, int]], device: str, log) -> dict:
    """Device time of one step by kernel, per (rows, width) pair."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    kv, forward, prefix_bucket = make_forward(loaded, max(r for r, _ in pairs), max(w for _, w in pairs), prefix)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if device.startswith("cuda") else [ProfilerActivity.CPU]
    with torch.inference_mode():
        for rows, w in pairs:
            key = (rows, w, prefix_bucket)
            forward.step_key(key)  # compile and warm
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            with profile(activities=activities) as prof:
                forward.step_key(key)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
            totals: dict[str, float] = defaultdict(float)
            counts: dict[str, int] = defaultdict(int)
            for event in prof.events():
                if device.startswith("cuda") and event.device_type != torch.autograd.DeviceType.CUDA:
                    continue
                totals[kernel_name(event.name)] += event.time_range.elapsed_us() / 1000
                counts[kernel_name(event.name)] += 1
            total = sum(totals.values())
            top = sorted(totals.items(), key=lambda kv_: -kv_[1])[:14]
            out[f"{rows}x{w}"] = {"device_ms": round(total, 3), "kernels": {
                name: {"ms": round(ms, 3), "share": round(ms / total, 3) if total else 0.0, "calls": counts[name]}
                for name, ms in top}}
            log(f"  profile rows {rows} width {w}: {total:.3f} ms of device time in {sum(counts.values())} kernels")
            for name, ms in top:
                log(f"    {ms:8.3f} ms  {ms / total if total else 0:6.1%}  x{counts[name]:<4d} {name}")
    del forward, kv
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def weight_shapes(loaded) -> dict[str, tuple[int, int]]:
    """(N, K) of each distinct linear the step runs (the first decoder layers hold one of each)."""
    text = loaded.model.model.language_model
    shapes = {"lm_head": tuple(loaded.model.lm_head.weight.shape)}
    for name, module in text.named_modules():
        if isinstance(module, torch.nn.Linear):
            shapes.setdefault(name.split(".", 2)[-1], tuple(module.weight.shape))
    return {name: shape for name, shape in shapes.items() if "gate" != name.rsplit(".", 1)[-1]}


def bench_matmul(loaded, rows_list: list[int], configs: list[tuple[int, ...]], repeat: int, device: str, log) -> dict:
    """The invariant linear kernel per weight shape, rows and tile configuration (see the module docstring)."""
    from engine.kernels import invariant

    out = {}
    seen = set()
    for name, (n_out, k_in) in weight_shapes(loaded).items():
        if (n_out, k_in) in seen:
            continue
        seen.add((n_out, k_in))
        weight = torch.randn(n_out, k_in, device=loaded.device, dtype=loaded.dtype) / k_in**0.5
        x_all = torch.randn(max(rows_list), k_in, device=loaded.device, dtype=loaded.dtype)
        reference = {}
        for bm, bn, bk, warps, stages in configs:
            cfg = f"{bm}-{bn}-{bk}-{warps}-{stages}"
            for m in rows_list:
                x = x_all[:m]
                y = torch.empty(m, n_out, device=loaded.device, dtype=loaded.dtype)
                call = partial(invariant.matmul, x, weight, out=y, config=(bm, bn, bk, warps, stages))
                try:
                    ms = time_ms(call, repeat, warmup=1)
                except Exception as exc:  # noqa: BLE001 - a configuration this card cannot run (shared memory)
                    out.setdefault(f"{n_out}x{k_in}", {})[f"{cfg}@{m}"] = {"error": str(exc)[:120]}
                    continue
                if m not in reference:
                    reference[m] = y.clone()
                same = bool(torch.equal(y, reference[m]))
                alone_same = bool(torch.equal(y[:1], reference[min(rows_list)][:1]))  # row 0 whatever the rows
                tflops = 2 * m * n_out * k_in / (ms / 1000) / 1e12
                out.setdefault(f"{n_out}x{k_in}", {})[f"{cfg}@{m}"] = {
                    "ms": round(ms, 4), "tflops": round(tflops, 1), "bitwise_default": same,
                    "row0_as_alone": alone_same}
                log(f"  {name:28s} {n_out:6d}x{k_in:5d} rows {m:5d} {cfg:16s}: {ms:8.4f} ms {tflops:6.1f} TFLOP/s"
                    f"{'' if same else '  DIFFERS from the default'}{'' if alone_same else '  row 0 differs alone'}")
    return out


def bench_grouped(loaded, tokens_list: list[int], configs: list[tuple[int, ...]], repeat: int, device: str,
                  log) -> dict:
    """The invariant grouped (MoE experts) kernel at each token count, random top-k routing, each configuration of
    the routed experts' two projections: ms and whether each pair's output is bitwise the default's."""
    from engine.kernels import invariant

    text = loaded.model.model.language_model
    experts = next(m.mlp.experts for m in text.layers if hasattr(m.mlp, "experts"))
    top_k = text.config.num_experts_per_tok
    out = {}
    gen = torch.Generator(device=loaded.device).manual_seed(0)
    for name, weights in (("gate_up", experts.gate_up_proj), ("down", experts.down_proj)):
        E, n_out, k_in = weights.shape
        reference = {}
        for tokens in tokens_list:
            scores = torch.rand(tokens, E, device=loaded.device, generator=gen)
            pairs = torch.sort(scores.topk(top_k, dim=-1).indices, dim=-1).values.reshape(-1)
            x = torch.randn(tokens * top_k, k_in, device=loaded.device, dtype=loaded.dtype)
            for bm, bn, bk, warps, stages in configs:
                cfg = f"{bm}-{bn}-{bk}-{warps}-{stages}"
                rows, block_expert, slot = invariant.expert_blocks(pairs, E, bm)
                call = partial(invariant.grouped_matmul, x, weights, rows, block_expert, rows.shape[0],
                               (bm, bn, bk, warps, stages))
                try:
                    ms = time_ms(call, repeat, warmup=1)
                except Exception as exc:  # noqa: BLE001 - a configuration this card cannot run
                    out.setdefault(name, {})[f"{cfg}@{tokens}"] = {"error": str(exc)[:120]}
                    continue
                per_pair = call()[slot]
                if tokens not in reference:
                    reference[tokens] = per_pair.clone()
                same = bool(torch.equal(per_pair, reference[tokens]))
                tflops = 2 * tokens * top_k * n_out * k_in / (ms / 1000) / 1e12
                out.setdefault(name, {})[f"{cfg}@{tokens}"] = {"ms": round(ms, 4), "tflops": round(tflops, 1),
                                                              "bitwise_default": same}
                log(f"  experts {name:8s} {E}x{n_out}x{k_in} tokens {tokens:5d} {cfg:16s}: {ms:8.4f} ms "
                    f"{tflops:6.1f} TFLOP/s{'' if same else '  DIFFERS from the default'}")
    return out


def parse_pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in p.split("x")) for p in text.split(",") if p]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tiny", action="store_true", help="tiny config on the CPU (smoke test)")
    ap.add_argument("--pages", default="1,16")
    ap.add_argument("--rows", default="1,64,256")
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--profile", default="", help="ROWSxWIDTH pairs profiled at the first prefix, e.g. 256x1,256x4")
    ap.add_argument("--matmul-rows", default="1,64,256,1024,2048,4096", help="'' skips the matmul part")
    ap.add_argument("--configs", default=CONFIGS, help="BLOCK_M-BLOCK_N-BLOCK_K-warps-stages, comma-separated")
    ap.add_argument("--tiles", default="default,tuned", help="the steps with the default tiles, then tuned ones "
                    "(engine.kernels.tiles; the profile runs the last)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--max-rows-16", type=int, default=160, help="rows at most for prefixes over 2,048 tokens")
    args = ap.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if not args.tiny and not torch.cuda.is_available():
        print("no CUDA device: run with --tiny for a smoke test on the CPU", file=sys.stderr)
        return 2
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    t0 = time.perf_counter()
    loaded, desc = build_model(args.tiny, device, dtype)
    report = {"benchmark": "bench_step_cost", "argv": sys.argv[1:] if argv is None else argv,
              "environment": environment(device), "model": {"name": loaded.name, **desc}, "dtype": str(dtype),
              "kernels": "invariant", "steps": {}, "profile": {}, "matmul": {}}
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    for tiles in args.tiles.split(","):
        if tiles == "tuned":
            from engine.kernels.invariant import tune_tiles

            t1 = time.perf_counter()
            tune_tiles(loaded.model)
            report["tiles"] = {"tune_s": round(time.perf_counter() - t1, 1), "chosen": TILES.summary(),
                               "ms": {f"{kind} {n}x{k} @{m}": {"-".join(map(str, c)): round(t, 4) for c, t in ms.items()}
                                      for (kind, n, k, m), ms in TILES.timings.items()}}
            log(f"tiles tuned in {report['tiles']['tune_s']} s: {report['tiles']['chosen']}")
        report["steps"][tiles] = {}
        for pages in ints(args.pages):
            prefix = prefix_tokens(loaded, pages)
            rows = [r for r in ints(args.rows) if prefix <= 2048 or r <= args.max_rows_16]
            log(f"steps, {pages}-page chunks ({prefix} prefix tokens), {tiles} tiles:")
            try:
                report["steps"][tiles][str(pages)] = {"prefix": prefix, "cells": bench_steps(
                    loaded, prefix, rows, ints(args.widths), args.repeat, device, log)}
            except torch.OutOfMemoryError as exc:
                report["steps"][tiles][str(pages)] = {"prefix": prefix, "error": str(exc)[:300]}
            save(report, args.json)
    if args.profile:
        prefix = prefix_tokens(loaded, ints(args.pages)[0])
        report["profile"] = bench_profile(loaded, prefix, parse_pairs(args.profile), device, log)
        save(report, args.json)
    if args.matmul_rows:
        configs = [tuple(int(v) for v in c.split("-")) for c in args.configs.split(",") if c]
        report["matmul"] = bench_matmul(loaded, ints(args.matmul_rows), configs, args.repeat, device, log)
        save(report, args.json)
        report["grouped"] = bench_grouped(loaded, ints(args.matmul_rows), configs, args.repeat, device, log)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    finish(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
