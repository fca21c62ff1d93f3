"""Exactness of the fast path on a real (demo) model: fp32 token-identical to official, bf16 match rate.

Pages: held-out synthetic documents (``scripts.synth.make_document(seed, 1)``, seeds ``--seed0 + i`` below
1,000,000, never used in training), rendered with ``render_pages`` like the project's renderer.
Per page, official ``generate()`` (engine.official) then, on the same model:
- ``plain``: `FastDecoder` with no drafts;
- ``lossless``: reference drafter fed the page's PDF text layer, plus the markup and ngram drafters (the real setting);
- ``replay-10%``: replay drafter fed the official ids with 10% of them wrong.
fp32 (``--pages``): every run must be token-identical to official. bf16 (``--bf16-pages``): the token match
rate against official, per run: pages identical, and the mean share of tokens before the first difference
(batched bf16 kernels can flip near-ties; after a flip the two outputs legitimately diverge). The bf16 row
``official-vs-fp32`` is the baseline: official bf16 against official fp32 on the pages both ran.

Prints a table; the last line is one JSON object (also written to ``--json``). Exit status 1 when an fp32
run differs from official. Usage:
    python scripts/gpu_check.py --model models/demo --json $OUT/gpu_check.json
    python scripts/gpu_check.py --tiny --pages 2 --bf16-pages 2 --max-new-tokens 40   # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HELD_OUT_LIMIT = 1_000_000
RUNS = ("plain", "lossless", "replay-10%")
BASELINE = "official-vs-fp32"  # bf16 only: official bf16 against official fp32 on the same page


def held_out_pages(n: int, seed0: int) -> list[tuple[int, object, str]]:
    """(seed, page image, PDF text layer) of n single-page held-out documents."""
    import pymupdf

    from scripts.synth import make_document, render_pages

    if seed0 + n > HELD_OUT_LIMIT:
        raise ValueError(f"held-out seeds must stay below {HELD_OUT_LIMIT:,}")
    pages = []
    for seed in range(seed0, seed0 + n):
        pdf, _labels = make_document(seed, 1)
        with pymupdf.open(stream=pdf, filetype="pdf") as doc:
            text = doc[0].get_text()
        pages.append((seed, render_pages(pdf)[0], text))
    return pages


def first_difference(ids: list[int], reference: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ids, reference)) if a != b), min(len(ids), len(reference)))


def check(model_path: str, dtype: str, pages, args, deadline: float, log, fp32_ids: dict | None = None) -> dict:
    """One dtype's runs. ``fp32_ids`` (seed -> official fp32 output), given for bf16, adds the baseline row
    ``official-vs-fp32``: how far bf16 official itself follows fp32 official (the precision's own share of the
    difference). Official outputs land in ``out["official_ids"]`` (dropped from the report)."""
    from engine.fast_decoder import FastDecoder
    from engine.model import load_model
    from engine.official import official_generate

    loaded = load_model(model_path, args.device, dtype)  # fp32 on CUDA: load_model switches to eager experts
    official_experts = getattr(loaded.model.config.get_text_config(), "_experts_implementation", None)
    log(f"  {dtype}: official experts implementation {official_experts!r}")
    vocab = loaded.model.config.text_config.vocab_size
    decoders = {
        "plain": FastDecoder(loaded, mode="plain", backend=args.backend, moe=args.moe, attn=args.attn),
        "lossless": FastDecoder(loaded, mode="lossless", backend=args.backend, moe=args.moe, attn=args.attn,
                                drafters=("reference", "markup", "ngram")),
        "replay-10%": FastDecoder(loaded, mode="lossless", backend=args.backend, moe=args.moe, attn=args.attn,
                                  drafters=("replay",)),
    }
    out = {"dtype": dtype, "pages": [], "backend": {k: d.backend for k, d in decoders.items()},
           "moe": decoders["plain"].moe, "official_experts": official_experts or "model default",
           "fallback": {k: d.fallback_reason for k, d in decoders.items() if d.fallback_reason}}
    seconds = {name: 0.0 for name in ("official", *RUNS)}
    out["official_ids"] = {}
    for seed, image, text in pages:
        if time.perf_counter() > deadline:
            out.setdefault("skipped_seeds", []).append(seed)
            continue
        t0 = time.perf_counter()
        reference = official_generate(loaded, [image], "single", args.max_new_tokens).output_ids
        seconds["official"] += time.perf_counter() - t0
        out["official_ids"][seed] = reference
        rng = random.Random(seed)
        replay = [(t + 1 + rng.randrange(vocab - 1)) % vocab if rng.random() < 0.1 else t for t in reference]
        row = {"seed": seed, "tokens": len(reference)}
        if fp32_ids and seed in fp32_ids:
            base = fp32_ids[seed]
            row[BASELINE] = {"identical": reference == base, "prefix": first_difference(reference, base),
                             "tokens": len(base)}
        for name, dec in decoders.items():
            t0 = time.perf_counter()
            try:
                res = dec.generate([image], args.max_new_tokens, reference_texts=[text],
                                   replay_ids=replay if name == "replay-10%" else None)
            except Exception as exc:  # noqa: BLE001 - record, go on
                row[name] = {"error": f"{type(exc).__name__}: {exc}"}
                traceback.print_exc()
                continue
            seconds[name] += time.perf_counter() - t0
            same = first_difference(res.output_ids, reference)
            row[name] = {"identical": res.output_ids == reference, "prefix": same,
                         "tau": res.extra["speculative"]["tau"], "backend": res.extra["speculative"].get("backend")}
        out["pages"].append(row)
        log(f"  {dtype} seed {seed}: {len(reference)} tokens; "
            + ", ".join(f"{n} {'=' if row[n].get('identical') else 'DIFF'}" for n in RUNS))
    summary = {}
    base_rows = [p[BASELINE] for p in out["pages"] if BASELINE in p]
    if base_rows:
        summary[BASELINE] = {"pages": len(base_rows), "errors": 0, "identical": sum(r["identical"] for r in base_rows),
                             "token_match_rate": round(sum(r["prefix"] for r in base_rows)
                                                       / max(1, sum(r["tokens"] for r in base_rows)), 5),
                             "mean_tau": 0.0, "speedup_vs_official": None}
    for name in RUNS:
        rows = [p[name] for p in out["pages"] if "error" not in p[name]]
        summary[name] = {
            "pages": len(rows), "errors": sum("error" in p[name] for p in out["pages"]),
            "identical": sum(r["identical"] for r in rows),
            "token_match_rate": round(sum(r["prefix"] for r in rows) / max(1, sum(p["tokens"] for p in out["pages"]
                                                                                  if "error" not in p[name])), 5),
            "mean_tau": round(sum(r["tau"] for r in rows) / max(1, len(rows)), 3),
            "speedup_vs_official": round(seconds["official"] / seconds[name], 3) if seconds[name] else None}
    out["summary"] = summary
    out["seconds"] = {k: round(v, 3) for k, v in seconds.items()}
    del loaded, decoders
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="model folder (e.g. the demo model)")
    source.add_argument("--tiny", action="store_true", help="a tiny random model (window 128): smoke test")
    ap.add_argument("--pages", type=int, default=20, help="fp32 pages (token-identical required)")
    ap.add_argument("--bf16-pages", type=int, default=20, help="bf16 pages (match rate reported)")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--seed0", type=int, default=900_000, help="first held-out seed (< 1,000,000)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--backend", default=None, help="graphs (CUDA default) | static (CPU default) | auto | eager")
    ap.add_argument("--moe", default="auto",
                    help="auto (grouped in bf16, gather in fp32 on CUDA) | grouped | gather | dense")
    ap.add_argument("--attn", default="auto", help="decode attention of the static step: auto | sdpa | matmul")
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.backend = args.backend or ("graphs" if args.device.startswith("cuda") else "static")
    if args.device == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))

    def log(msg):
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    import transformers

    report = {"check": "gpu_check", "device": args.device, "backend": args.backend, "moe": args.moe, "attn": args.attn,
              "max_new_tokens": args.max_new_tokens, "seed0": args.seed0, "torch": torch.__version__,
              "cuda": torch.version.cuda, "transformers": transformers.__version__,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model
        if args.tiny:
            from engine.tiny import build_tiny_model

            model_path = str(build_tiny_model(Path(tmp) / "tiny", sliding_window=128))
        report["model"] = model_path if args.model else "tiny-random"
        pages = held_out_pages(max(args.pages, args.bf16_pages), args.seed0)
        log(f"{len(pages)} held-out pages rendered")
        fp32_ids: dict = {}
        for dtype, n in (("float32", args.pages), ("bfloat16", args.bf16_pages)):
            if n:
                try:
                    run = check(model_path, dtype, pages[:n], args, deadline, log, fp32_ids)
                    if dtype == "float32":
                        fp32_ids = run["official_ids"]
                    del run["official_ids"]
                    report["runs"][dtype] = run
                except Exception as exc:  # noqa: BLE001 - keep the other dtype's result
                    report["runs"][dtype] = {"error": f"{type(exc).__name__}: {exc}"}
                    traceback.print_exc()
    fp32 = report["runs"].get("float32", {}).get("summary", {})
    report["fp32_exact"] = bool(fp32) and all(s["identical"] == s["pages"] > 0 and not s["errors"]
                                              for s in fp32.values())
    report["wall_s"] = round(time.perf_counter() - t_start, 1)

    print(f"\n{report['model']} on {report['gpu'] or report['device']} (backend {args.backend}, moe {args.moe})")
    print(f"{'dtype':<10}{'run':<18}{'pages':>6}{'identical':>10}{'token match':>12}{'tau':>7}{'x official':>11}")
    for dtype, run in report["runs"].items():
        if "error" in run:
            print(f"{dtype:<10}ERROR {run['error'][:200]}")
            continue
        for name, s in run["summary"].items():
            speed = f"{s['speedup_vs_official']:.2f}x" if s["speedup_vs_official"] else "-"
            print(f"{dtype:<10}{name:<18}{s['pages']:>6}{s['identical']:>10}{s['token_match_rate']:>12.4f}"
                  f"{s['mean_tau']:>7.2f}{speed:>11}")
        if run.get("fallback"):
            print(f"{dtype:<10}fallback: {run['fallback']}")
    print(f"fp32 token-identical on every page and run: {report['fp32_exact']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, separators=(",", ":")))
    return 0 if report["fp32_exact"] or not args.pages else 1


if __name__ == "__main__":
    sys.exit(main())
