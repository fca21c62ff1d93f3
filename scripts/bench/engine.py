"""GPU cost of the batched engine against transformers ``generate()`` at the same batch, side by side, one process.

Model: the full-size architecture (``UnlimitedOcrConfig()``: 12-layer MoE decoder, 64 experts top-6, vocab 129,280,
window 128, DeepEncoder) with random weights in ``--dtype`` (bf16), built on the device. Random weights measure
cost, never acceptance: the SAM tower gets a normal init (its default 1e-10 leaves it dead); EOS's lm_head row is
zeroed (never the argmax: every run goes to ``--tokens``); ``--plant`` (100 at full size) plants a wide-margin
successor chain so that bf16 near-ties do not send runs of different widths apart (`plant_successor_chain`).
Every chunk of a batch has its own random pages (the per-page seed), so rows take different paths and routes.

Per chunk size (``--pages``) and batch size B (``--batch``), B different chunks, each timed end to end (vision,
prefills, decode; the device synchronised):
- ``generate``: transformers ``generate()`` of the B chunks as one batch, official config (the anchor): ``--tokens``
  new tokens a chunk, as the engine decodes, timed after an untimed warm-up call (``--generate-warm-tokens``);
- ``plain``: `engine.batch.engine.BatchEngine`, no drafts, B rows, kernels ``--kernels`` (invariant by default);
- ``plain-torch``: the same with the torch kernels (what batch invariance costs);
- ``lossless-R%``: drafts of controlled quality: each row's own plain output with R% of the tokens replaced by wrong
  ones (a positional replay drafter), R in ``--rates``; checked token for token against plain.
Each engine run follows an untimed warm-up run of the same chunks (kernels compiled, and the step graph of every
width at B rows captured: a worker captures each shape once in its life, so a short timed run does not pay for them).
Columns: aggregate tok/s (all rows' output tokens / wall time), decode tok/s (output tokens / the steps' wall time:
admissions, i.e. vision and prefills, left out), ms per step,
the x factors against generate and plain. ``invariant`` checks, per batch, that row 0's tokens and log-probabilities
are bitwise those of the same chunk decoded alone (plain, batch 1), for both kernel sets. Then peak memory of
``plain`` at batch ``--mem-batch`` for each ``--mem-tokens`` output length (R-SWA keeps it flat).

Prints a table; the last line is one JSON object (also written to ``--json``). ``--tiny`` runs the tiny config on
the CPU (a smoke test of this script). ``--model DIR --pages-dir PNGS`` measures a trained model on real pages
instead (its drafts still come from ``--rates``; EOS ends a chunk where the model says so).

    python -m scripts.bench.engine --batch 1,8,32,64,128,256 --pages 1,4 --invariance 64 --json $OUT/bench_engine.json
    python -m scripts.bench.engine --tiny --batch 1,2 --pages 1 --tokens 24 --rates 10 --mem-tokens ""
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
import traceback
from pathlib import Path

import torch

from engine.kernels.tiles import TILES
from scripts.bench.random_model import (  # noqa: F401 - build_model and the chain are used from here too
    PROMPT_IDS,
    NullTokenizer,
    Page,
    SyntheticProcessor,
    build_model,
    plant_successor_chain,
)
from scripts.bench.record import finish, save


def environment(device: str) -> dict:
    import transformers

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
           "python": platform.python_version(), "cpu_threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, vram_gb=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count)
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        env.update(gpu=None, cpu=platform.processor() or platform.machine())
    return env


class PositionalReplay:
    """Proposes the next tokens of ``source`` at the current output length: with ``source`` = the row's own output
    with R% wrong tokens, a draft is wrong exactly there."""

    name = "replay"

    def __init__(self, source: list[int]):
        self.source = source

    def propose(self, committed_ids: list[int], k: int) -> list[int]:
        n = len(committed_ids)
        return self.source[n:n + k]


def corrupt(ids: list[int], rate: float, vocab: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [(t + 1 + rng.randrange(vocab - 1)) % vocab if rng.random() < rate else t for t in ids]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


PAGE_IMAGES: list = []  # --pages-dir: real page images, used in turn instead of random pages


def chunks_for(batch: int, pages: int) -> list[list]:
    if PAGE_IMAGES:
        return [[PAGE_IMAGES[(b * pages + p) % len(PAGE_IMAGES)] for p in range(pages)] for b in range(batch)]
    return [[Page(1000 * b + p) for p in range(pages)] for b in range(batch)]


def run_generate(loaded, chunks, tokens: int, device: str, warm_tokens: int = 8) -> dict:
    """transformers ``generate()`` of ``chunks`` as one batch, ``tokens`` new tokens each (the engine's count),
    timed after a warm-up call of ``warm_tokens`` on the same inputs (kernels, allocator, cuBLAS handles)."""
    from transformers import BatchFeature

    from engine.official import chunk_inputs, official_generation_config

    kind = "single" if len(chunks[0]) == 1 else "multi"
    parts = [chunk_inputs(loaded, c, kind) for c in chunks]
    inputs = BatchFeature({"input_ids": torch.cat([p["input_ids"] for p in parts]),
                           "attention_mask": torch.cat([p["attention_mask"] for p in parts]),
                           "pixel_values": torch.cat([p["pixel_values"] for p in parts]),
                           "num_local_patches": sum((p["num_local_patches"] for p in parts), []),
                           "patches_grid": sum((p["patches_grid"] for p in parts), [])})
    inputs = inputs.to(loaded.device, dtype=loaded.dtype)
    if warm_tokens:
        with torch.inference_mode():
            loaded.model.generate(**inputs, generation_config=official_generation_config(loaded, kind, warm_tokens))
    config = official_generation_config(loaded, kind, tokens)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = loaded.model.generate(**inputs, generation_config=config)
    sync(device)
    seconds = time.perf_counter() - t0
    per_chunk = out.shape[1] - inputs["input_ids"].shape[1]
    n = per_chunk * len(chunks)
    return {"seconds": round(seconds, 4), "tokens": n, "tokens_per_chunk": per_chunk, "tok_s": round(n / seconds, 1),
            "warm_tokens": warm_tokens}


WARM_TOKENS = 64  # the untimed run before a timed one: the shapes the width choice explores first are captured there


ENGINE_OPTIONS = {"attention": "auto", "ahead": "auto", "overlap": True}  # --vision-attention, --vision-ahead, --overlap


def add_engine_options(ap) -> None:
    ap.add_argument("--vision-attention", default="auto", help="SAM's attention: auto, model, sdpa or flex")
    ap.add_argument("--vision-ahead", choices=("auto", "on", "off"), default="auto",
                    help="waiting chunks' pages through the vision tower while rows decode (auto: on CUDA)")
    ap.add_argument("--overlap", choices=("on", "off"), default="on",
                    help="the next plain step launched before the host commits this one (engine.batch.overlap)")


@torch.inference_mode()
def capture_widths(engine, rows: int, prefix_len: int) -> None:
    """The step graph of every width the engine may run at ``rows`` rows of this prefix, captured now: a worker
    captures each shape once in its life, and a short timed run must not pay for the widths that only its probes
    visit (a probe of a new width at batch 1 costs its capture, ~40 ms, against a 4.5 ms step)."""
    from engine.model.kv_slots import PREFIX_BUCKETS, bucket

    if engine.graphs is None:
        return
    n = bucket(min(rows, engine.row_limit), engine.row_buckets)
    prefix_bucket = min(bucket(prefix_len, PREFIX_BUCKETS), engine.kv.capacity)
    for w in engine.widths:
        if w <= engine.widest_at(n):
            engine.graphs.replay((n, w, prefix_bucket))


def run_engine(loaded, chunks, tokens: int, device: str, mode: str, kernels: str, drafts=None, k_max: int = 16,
               vision_group: int = 8, warm: bool = True, max_batch: int | None = None, step_tokens: int | None = None):
    """One engine run over ``chunks`` (``max_batch`` rows, default one a chunk); ``warm``: an untimed run of the same
    chunks first, ``WARM_TOKENS`` tokens each (kernels, the vision and prefill shapes), and the step graph of every width
    at the batch's rows captured (`capture_widths`), else the timed run pays its own captures and compilations.
    Returns (its row of figures, output ids by chunk, log-probabilities by chunk, ends by chunk)."""
    from engine.batch.engine import BatchEngine

    factory = None if drafts is None else (lambda request: [PositionalReplay(drafts[request.key])])
    free_at_start = round(free_gb(), 2) if device.startswith("cuda") else None
    engine = BatchEngine(loaded, mode, max_batch=max_batch or len(chunks), kernels=kernels, k_max=k_max,
                         drafter_factory=factory, vision_group=vision_group, step_tokens=step_tokens,
                         vision_attention=ENGINE_OPTIONS["attention"],
                         vision_ahead={"on": True, "off": False}.get(ENGINE_OPTIONS["ahead"], "auto"),
                         overlap=ENGINE_OPTIONS["overlap"])
    requests = [engine.prepare(c, tokens, key=i) for i, c in enumerate(chunks)]
    if warm:
        engine.run([engine.prepare(c, min(WARM_TOKENS, tokens), key=i) for i, c in enumerate(chunks)])
        capture_widths(engine, len(chunks), len(requests[0].prompt_ids))
    capture_before = engine.graphs.capture_s if engine.graphs is not None else 0.0
    width_before, ahead_before = dict(engine.width_steps), engine.steps_ahead
    reasons_before = dict(engine.step_width.reasons)
    engine.timing = dict.fromkeys(engine.timing, 0.0)
    steps_before = engine.steps
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    sync(device)
    t0 = time.perf_counter()
    for r in requests:
        engine.submit(r)
    results, ends, first_done = {}, {}, None
    while engine.busy:
        for res in engine.step():
            results[res.request.key] = res
            ends[res.request.key] = ends.get(res.request.key, 0) + 1
            first_done = first_done or time.perf_counter() - t0
    sync(device)
    seconds = time.perf_counter() - t0
    n = sum(len(r.output_ids) for r in results.values())
    steps, decode_s = engine.steps - steps_before, max(1e-9, engine.timing["steps_s"])
    rounds = sum(r.stats["verify_rounds"] for r in results.values())
    row = {"seconds": round(seconds, 4), "tokens": n, "tokens_per_chunk": round(n / len(chunks), 1),
           "tok_s": round(n / seconds, 1),
           "decode_tok_s": round(n / decode_s, 1), "steps": steps,
           "ms_per_step": round(1000 * decode_s / max(steps, 1), 3),
           "tau": round(sum(r.stats["accepted_tokens"] for r in results.values()) / rounds, 3) if rounds else 0.0,
           "peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 3) if device.startswith("cuda") else None,
           "admit_s": round(engine.timing["vision_s"] + engine.timing["prefill_s"], 3),
           "vision_s": round(engine.timing["vision_s"], 3), "prefill_s": round(engine.timing["prefill_s"], 3),
           "vision_ms_per_page": round(1000 * engine.timing["vision_s"] / max(1, sum(map(len, chunks))), 3),
           "vision_attention": engine.vision_attention, "vision_ahead_pages": engine.ahead.pages,
           "first_chunk_done_s": round(first_done or 0.0, 3),
           "capture_s": round(engine.graphs.capture_s - capture_before, 3) if engine.graphs is not None else 0.0,
           "steps_by_width": {str(w): c - width_before.get(w, 0) for w, c in sorted(engine.width_steps.items())
                              if c - width_before.get(w, 0)},
           "probes": engine.step_width.probes, "calibration": round(engine.step_width.calibration, 3),
           "width_reasons": {k: c - reasons_before.get(k, 0) for k, c in sorted(engine.step_width.reasons.items())
                             if c - reasons_before.get(k, 0)},
           "width_costs_ms": width_costs(engine.step_width.cost),
           "rows": engine.max_batch, "row_limit": engine.row_limit, "cache_rows": engine.kv.rows,
           "step_tokens": engine.step_tokens, "steps_ahead": engine.steps_ahead - ahead_before,
           "admit_pages": engine.admit_pages, "admission_peak_gb": round(engine.admission_peak / 2**30, 3),
           "memory_events": engine.memory_events, "free_gb_at_start": free_at_start,
           "backend": "graphs" if engine.graphs is not None else "eager", "kernels": kernels}
    ids = {k: r.output_ids for k, r in results.items()}
    logprobs = {k: r.logprobs for k, r in results.items()}
    engine.close()  # its memory back at once, whoever holds it
    if device.startswith("cuda"):
        row["free_gb_after"] = round(free_gb(), 2)
    return row, ids, logprobs, ends


def width_costs(cost: dict) -> dict:
    """The width choice's measured step costs (ms) at the most rows it ran, by width (``rows x width``)."""
    top = max((rows for rows, *_ in cost), default=None)
    return {f"{r}x{w}": round(1000 * c, 3) for (r, _, w, b), c in sorted(cost.items()) if r == top and not b}


def free_gb() -> float:
    """GiB a new allocation can take on the GPU now (`engine.batch.memory.free_bytes`)."""
    from engine.batch.memory import free_bytes

    return free_bytes(torch.device("cuda")) / 2**30


def bench(loaded, pages: int, batch: int, args, log) -> dict:
    vocab = loaded.model.config.text_config.vocab_size
    chunks = chunks_for(batch, pages)
    out = {"pages": pages, "batch": batch, "runs": {}, "errors": {}}
    runs = out["runs"]
    try:
        if not args.no_generate:
            runs["generate"] = run_generate(loaded, chunks, args.tokens, args.device, args.generate_warm_tokens)
            log(f"  generate: {runs['generate']['tok_s']} tok/s ({runs['generate']['tokens_per_chunk']} tokens a chunk, "
                f"warmed)")
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory at this batch: record, go on
        out["errors"]["generate"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        torch.cuda.empty_cache() if args.device.startswith("cuda") else None
    plain_ids = None
    variants = [("plain", "plain", args.kernels, None)]
    if args.kernels != "torch" and not args.no_torch:
        variants.append(("plain-torch", "plain", "torch", None))
    variants += [(f"lossless-{r}%", "lossless", args.kernels, r) for r in args.rates]
    for name, mode, kernels, rate in variants:
        try:
            drafts = None if rate is None else {k: corrupt(v, rate / 100, vocab, seed=rate + 17 * k)
                                                for k, v in plain_ids.items()}
            if rate is not None and plain_ids is None:
                raise RuntimeError("no plain run to draw the drafts from (it failed above)")
            row, ids, lps, _ = run_engine(loaded, chunks, args.tokens, args.device, mode, kernels, drafts,
                                          k_max=args.k_max, vision_group=args.vision_group)
            if name == "plain":
                plain_ids, plain_lps = ids, lps
            else:
                row["equal_to_plain"] = ids == plain_ids
            runs[name] = row
            log(f"  {name}: {row['tok_s']} tok/s ({row['decode_tok_s']} decoding), {row['ms_per_step']} ms/step, "
                f"tau {row['tau']}, admission {row['admit_s']} s")
        except Exception as exc:  # noqa: BLE001
            out["errors"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    if "generate" in runs and "plain" in runs:  # the anchor is honest only at equal tokens
        out["generate_equal_tokens"] = runs["generate"]["tokens"] == runs["plain"]["tokens"]
    base = runs.get("plain", {}).get("tok_s")
    anchor = runs.get("generate", {}).get("tok_s")
    for row in runs.values():
        row["x_generate"] = round(row["tok_s"] / anchor, 3) if anchor else None
        row["x_plain"] = round(row["tok_s"] / base, 3) if base else None
    if batch in args.invariance and plain_ids is not None and batch > 1:
        out["invariant"] = {}
        for kernels in [args.kernels] + (["torch"] if args.kernels != "torch" else []):
            _, alone_ids, alone_lps, _ = run_engine(loaded, chunks[:1], args.tokens, args.device, "plain", kernels)
            if kernels == args.kernels:
                batch_ids, batch_lps = plain_ids, plain_lps
            else:
                _, batch_ids, batch_lps, _ = run_engine(loaded, chunks, args.tokens, args.device, "plain", kernels)
            out["invariant"][kernels] = {"tokens_equal": alone_ids[0] == batch_ids[0],
                                         "logprobs_bitwise_equal": alone_lps[0] == batch_lps[0]}
        log(f"  invariance (row 0 alone vs in the batch): {out['invariant']}")
    return out


def bench_memory(loaded, args, log) -> dict:
    out = {}
    chunks = chunks_for(args.mem_batch, 1)
    for tokens in args.mem_tokens:
        row, _, _, _ = run_engine(loaded, chunks, tokens, args.device, "plain", args.kernels, k_max=args.k_max)
        out[str(tokens)] = {"peak_gb": row["peak_gb"], "ms_per_step": row["ms_per_step"], "tok_s": row["tok_s"]}
        log(f"  plain, batch {args.mem_batch}, {tokens} tokens: peak {row['peak_gb']} GB")
    peaks = [v["peak_gb"] for v in out.values() if v.get("peak_gb")]
    if len(peaks) >= 2:
        out["ratio_last_to_first"] = round(peaks[-1] / peaks[0], 4)
    return out


def print_table(report: dict) -> None:
    env = report["environment"]
    print(f"\n{report['model']['name']} ({report['model']['params'] / 1e9:.2f}B params, {report['dtype']}) on "
          f"{env.get('gpu') or env.get('cpu')}; torch {env['torch']}, transformers {env['transformers']}; "
          f"{report['tokens']} tokens a chunk, k_max {report['k_max']}, kernels {report['kernels']}")
    header = f"{'pages':>5} {'batch':>5} {'run':<14}{'tok/s':>10}{'decode':>10}{'ms/step':>9}{'tau':>6}" \
             f"{'x gen':>8}{'x plain':>8}{'peak GB':>8}  same as plain"
    print(header)
    print("-" * len(header))
    for res in report["results"]:
        for name, r in res["runs"].items():
            same = "" if "equal_to_plain" not in r else ("yes" if r["equal_to_plain"] else "NO")
            print(f"{res['pages']:>5} {res['batch']:>5} {name:<14}{r['tok_s']:>10.1f}{r.get('decode_tok_s', 0):>10.1f}"
                  f"{r.get('ms_per_step', 0):>9.2f}{r.get('tau', 0):>6.2f}{(r['x_generate'] or 0):>7.2f}x"
                  f"{(r['x_plain'] or 0):>7.2f}x{(r.get('peak_gb') or 0):>8.2f}  {same}")
        for name, err in res["errors"].items():
            print(f"{res['pages']:>5} {res['batch']:>5} {name:<14}ERROR {err[:160]}")
        if "invariant" in res:
            print(f"{res['pages']:>5} {res['batch']:>5} invariance: {res['invariant']}")
    for tokens, m in report.get("memory", {}).items():
        if isinstance(m, dict):
            print(f"memory: plain, batch {report['mem_batch']}, {tokens} tokens: peak {m['peak_gb']} GB")
    if "ratio_last_to_first" in report.get("memory", {}):
        print(f"memory: peak ratio {report['memory']['ratio_last_to_first']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tiny", action="store_true", help="tiny config on the CPU (smoke test)")
    ap.add_argument("--model", help="a trained model folder instead of the random full-size one (e.g. models/demo)")
    ap.add_argument("--pages-dir", type=Path, help="PNG pages for --model (real pages; chunks take them in turn)")
    ap.add_argument("--batch", default="1,8,32,64,128,256")
    ap.add_argument("--pages", default="1,4")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rates", default="10,100", help="draft error rates in %%")
    ap.add_argument("--kernels", default=None, help="invariant (GPU default) or torch")
    ap.add_argument("--no-torch", action="store_true", help="skip the plain-torch rows")
    ap.add_argument("--no-generate", action="store_true", help="skip the generate() anchor")
    ap.add_argument("--invariance", default="", help="comma-separated batch sizes at which row 0 is checked alone vs in "
                    "the batch (bitwise tokens and log-probabilities, both kernel sets)")
    ap.add_argument("--generate-warm-tokens", type=int, default=8,
                    help="new tokens of generate()'s untimed warm-up call (0: none); the timed call decodes --tokens")
    ap.add_argument("--mem-tokens", default="1024,8192")
    ap.add_argument("--mem-batch", type=int, default=64)
    ap.add_argument("--k-max", type=int, default=16)
    ap.add_argument("--vision-group", type=int, default=8)
    add_engine_options(ap)
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (a loaded CPU: 1)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--plant", type=float, default=100.0)
    args = ap.parse_args(argv)
    ENGINE_OPTIONS.update(attention=args.vision_attention, ahead=args.vision_ahead, overlap=args.overlap == "on")
    t_start = time.perf_counter()
    args.device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("fp32" if args.device == "cpu" else "bf16")]
    args.kernels = args.kernels or ("invariant" if args.device.startswith("cuda") else "torch")
    args.rates = [int(r) for r in args.rates.split(",") if r]
    args.mem_tokens = [int(t) for t in args.mem_tokens.split(",") if t]
    args.invariance = [int(b) for b in args.invariance.split(",") if b]
    if args.threads or args.tiny:
        torch.set_num_threads(args.threads or 2)

    def log(msg):
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    if args.model:
        from PIL import Image

        from engine.model.load import load_model

        loaded = load_model(args.model, args.device, "bf16" if dtype == torch.bfloat16 else "fp32")
        desc = {"params": sum(p.numel() for p in loaded.model.parameters()), "path": args.model}
        PAGE_IMAGES.extend(Image.open(p).convert("RGB") for p in sorted(args.pages_dir.glob("*.png")))
    else:
        loaded, desc = build_model(args.tiny, args.device, dtype, plant=args.plant)
    log(f"model built: {desc}")
    report = {"benchmark": "bench_engine", "argv": sys.argv[1:] if argv is None else argv,
              "environment": environment(args.device), "model": {"name": loaded.name, **desc},
              "dtype": str(dtype).removeprefix("torch."), "tokens": args.tokens, "k_max": args.k_max,
              "kernels": args.kernels, "mem_batch": args.mem_batch, "results": [], "memory": {}}
    try:
        for pages in [int(p) for p in args.pages.split(",")]:
            for batch in [int(b) for b in args.batch.split(",")]:
                log(f"{pages} page(s), batch {batch}")
                report["results"].append(bench(loaded, pages, batch, args, log))
                save(report, args.json)  # what is measured so far survives a cut-off run
        if args.mem_tokens:
            log("memory")
            report["memory"] = bench_memory(loaded, args, log)
    except Exception as exc:  # noqa: BLE001 - keep what was measured
        report["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    report["tiles"] = TILES.summary()  # the invariant kernels' tiles the runs used (engine.kernels.tiles)
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    print_table(report)
    finish(report, args.json)
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
