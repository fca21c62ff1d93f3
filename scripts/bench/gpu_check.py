"""Exactness of the batched engine on a trained model, on the GPU: fp32 token-identical to official, bf16 invariant.

Pages: PNG files (and their PDF text layers as .txt beside them, the reference drafter's input) in ``--pages-dir``,
e.g. held-out synthetic pages rendered as uflash renders them. Chunks: 1-page and 4-page.
- fp32: official ``generate()`` of each chunk alone, then the engine with every chunk in one batch, ``plain``,
  ``lossless`` (reference, markup, ngram) and ``lossless-scan`` (text layers withheld: markup, ngram and the
  checkpoint's block drafter): every chunk must be token-identical;
- bf16: ``--bf16-chunks`` chunks in one batch (``lossless``, block drafter), and the first ``--alone`` of them decoded alone at
  batch 1 (``plain``): with the invariant kernels a chunk's tokens and log-probabilities must be bitwise the
  same; the torch kernels are run the same way for comparison (they are not batch-invariant).
Prints a table; the last line is one JSON object (also written to ``--json``). Exit status 1 when an fp32 chunk
differs from official or an invariant bf16 chunk differs from its decode alone.

    python -m scripts.bench.gpu_check --model models/demo --pages-dir pages --json $OUT/gpu_check.json
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

from scripts.bench.record import finish


def load_pages(folder: Path) -> list[tuple[object, str]]:
    from PIL import Image

    pages = []
    for png in sorted(folder.glob("*.png")):
        text = png.with_suffix(".txt")
        pages.append((Image.open(png).convert("RGB"), text.read_text(encoding="utf-8") if text.exists() else ""))
    return pages


def make_chunks(pages, singles: int, fours: int) -> list[list[tuple[object, str]]]:
    chunks = [[pages[i % len(pages)]] for i in range(singles)]
    chunks += [[pages[(singles + 4 * j + i) % len(pages)] for i in range(4)] for j in range(fours)]
    return chunks


def decode_batch(loaded, chunks, tokens_per_page: int, mode: str, kernels: str, max_batch: int, block_net=None,
                 references: bool = True):
    """references False: the pages' text layers are withheld (as for scans), so the block drafter drafts."""
    from engine.batch.engine import BatchEngine

    engine = BatchEngine(loaded, mode, max_batch=max_batch, kernels=kernels, block_net=block_net)
    requests = [engine.prepare([p for p, _ in c], tokens_per_page * len(c), key=i,
                               reference_texts=[t for _, t in c] if mode != "plain" and references else None)
                for i, c in enumerate(chunks)]
    t0 = time.perf_counter()
    results = engine.run(requests)
    if loaded.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return results, seconds


def check_fp32(args, pages, log) -> dict:
    from engine.loading import load_block_drafter
    from engine.model.load import load_model
    from engine.official import official_generate

    loaded = load_model(args.model, args.device, "float32")
    net = load_block_drafter(loaded)
    chunks = make_chunks(pages, args.singles, args.fours)
    out = {"chunks": len(chunks), "block_drafter": net is not None, "runs": {}}
    t0 = time.perf_counter()
    expected = [official_generate(loaded, [p for p, _ in c], "single" if len(c) == 1 else "multi",
                                  args.tokens * len(c)).output_ids for c in chunks]
    out["official_s"] = round(time.perf_counter() - t0, 2)
    log(f"fp32 official: {[len(e) for e in expected]} tokens in {out['official_s']} s")
    for mode, refs in (("plain", False), ("lossless", True), ("lossless-scan", False)):
        results, seconds = decode_batch(loaded, chunks, args.tokens, mode.split("-")[0], "torch", len(chunks), net,
                                        refs)
        same = [r.output_ids == e for r, e in zip(results, expected)]
        out["runs"][mode] = {"identical": sum(same), "of": len(same), "seconds": round(seconds, 2),
                             "tau": [r.stats["tau"] for r in results],
                             "block_accepted": [r.stats["drafters"].get("block", {}).get("accepted", 0)
                                                for r in results]}
        log(f"fp32 {mode}: {sum(same)}/{len(same)} identical, {seconds:.2f} s, tau {out['runs'][mode]['tau']}")
    return out


def check_bf16(args, pages, log) -> dict:
    from engine.loading import load_block_drafter
    from engine.model.load import load_model

    loaded = load_model(args.model, args.device, "bfloat16")
    net = load_block_drafter(loaded)
    chunks = make_chunks(pages, args.bf16_chunks - args.bf16_chunks // 4, args.bf16_chunks // 4)
    out = {"chunks": len(chunks)}
    for kernels in ("invariant", "torch"):
        batch, seconds = decode_batch(loaded, chunks, args.tokens, "lossless", kernels, len(chunks), net,
                                      references=False)
        plain, plain_s = decode_batch(loaded, chunks, args.tokens, "plain", kernels, len(chunks))
        same_tokens = same_lps = 0
        for i in range(args.alone):
            alone, _ = decode_batch(loaded, [chunks[i]], args.tokens, "plain", kernels, 1)
            same_tokens += alone[0].output_ids == batch[i].output_ids
            same_lps += alone[0].logprobs == batch[i].logprobs
        lossless_vs_plain = sum(a.output_ids == b.output_ids for a, b in zip(batch, plain))
        tokens = sum(len(r.output_ids) for r in plain)
        out[kernels] = {"alone_vs_batch_tokens": same_tokens, "alone_vs_batch_logprobs": same_lps, "of": args.alone,
                        "lossless_equal_plain": lossless_vs_plain, "plain_tok_s": round(tokens / plain_s, 1),
                        "lossless_tok_s": round(sum(len(r.output_ids) for r in batch) / seconds, 1),
                        "tau": round(sum(r.stats["tau"] for r in batch) / len(batch), 3)}
        log(f"bf16 {kernels}: {out[kernels]}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/demo")
    ap.add_argument("--pages-dir", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=300, help="new tokens per page of a chunk")
    ap.add_argument("--singles", type=int, default=3)
    ap.add_argument("--fours", type=int, default=2)
    ap.add_argument("--bf16-chunks", type=int, default=64)
    ap.add_argument("--alone", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--skip-bf16", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    pages = load_pages(args.pages_dir)
    report = {"benchmark": "gpu_check", "model": args.model, "pages": len(pages), "tokens_per_page": args.tokens,
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__}
    failed = False
    for name, fn in (("fp32", check_fp32), ("bf16", check_bf16))[: 1 if args.skip_bf16 else 2]:
        try:
            report[name] = fn(args, pages, log)
        except Exception as exc:  # noqa: BLE001 - keep what was measured
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
            failed = True
    fp32 = report.get("fp32", {}).get("runs", {})
    failed |= any(r["identical"] != r["of"] for r in fp32.values())
    inv = report.get("bf16", {}).get("invariant", {})
    failed |= bool(inv) and inv["alone_vs_batch_logprobs"] != inv["of"]
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    finish(report, args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
