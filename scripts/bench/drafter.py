"""What the drafters buy on scan pages: ``lossless`` (block drafter, markup, ngram; no text layer to draft from)
against ``plain`` on a trained model, batch 1 and larger batches, 1-page and 4-page chunks, one process.

Pages: scan-like PNG files in ``--pages-dir`` (written by scripts.synth with ``--scan``: held-out seeds, image only).
For each chunk size and batch size B, one `engine.batch.engine.BatchEngine` per mode decodes every chunk with at
most B rows in flight: a warm-up pass (graph capture, compiles), then the timed pass. Columns: aggregate tok/s
(output tokens / wall time, vision and prefills included), tokens per forward (1 without drafts), the block drafter's share
of accepted tokens, and whether every chunk's tokens equal ``plain``'s (they must: lossless).
Prints a table; the last line is one JSON object (also written to ``--json``).

    python -m scripts.bench.drafter --model models/demo --pages-dir pages --batch 1,8,30 --json $OUT/drafter.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from scripts.bench.record import finish


def decode(loaded, net, chunks, mode: str, batch: int, tokens_per_page: int, kernels: str) -> dict:
    from engine.batch.engine import BatchEngine

    engine = BatchEngine(loaded, mode, max_batch=batch, kernels=kernels, block_net=net if mode != "plain" else None)

    def one_pass():
        requests = [engine.prepare(c, tokens_per_page * len(c), key=i) for i, c in enumerate(chunks)]
        if loaded.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        results = engine.run(requests)
        if loaded.device.type == "cuda":
            torch.cuda.synchronize()
        return results, time.perf_counter() - t0

    one_pass()  # warm-up: graphs captured, kernels compiled
    results, seconds = one_pass()
    tokens = sum(len(r.output_ids) for r in results)
    accepted = sum(r.stats.get("accepted_tokens", 0) for r in results)
    block = sum(r.stats["drafters"].get("block", {}).get("accepted", 0) for r in results)
    forwards = sum(r.stats["forwards"] for r in results)
    return {"ids": [r.output_ids for r in results], "tokens": tokens, "seconds": round(seconds, 3),
            "tok_s": round(tokens / seconds, 1), "tokens_per_forward": round(tokens / forwards, 3),
            "block_share": round(block / accepted, 3) if accepted else 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/demo")
    ap.add_argument("--pages-dir", type=Path, required=True)
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--pages", default="1,4", help="pages per chunk")
    ap.add_argument("--tokens", type=int, default=400, help="new tokens per page of a chunk (EOS ends sooner)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from PIL import Image

    from engine.loading import default_kernels, load_block_drafter
    from engine.model.load import load_model

    loaded = load_model(args.model, args.device, args.dtype)
    net = load_block_drafter(loaded)
    kernels = default_kernels(loaded)
    images = [Image.open(p).convert("RGB") for p in sorted(args.pages_dir.glob("*.png"))]
    rows = []
    print(f"{len(images)} pages, {loaded.device} {loaded.dtype}, kernels {kernels}, block drafter {net is not None}")
    print(f"{'pages':>5} {'batch':>5} {'mode':<9}{'tok/s':>9}{'tok/fw':>7}{'block':>7}{'x plain':>9}  same")
    for n in [int(x) for x in args.pages.split(",")]:
        chunks = [images[i:i + n] for i in range(0, len(images) - n + 1, n)]
        for b in [int(x) for x in args.batch.split(",")]:
            plain = decode(loaded, None, chunks, "plain", b, args.tokens, kernels)
            lossless = decode(loaded, net, chunks, "lossless", b, args.tokens, kernels)
            same = sum(a == p for a, p in zip(lossless.pop("ids"), plain.pop("ids")))
            for mode, r in (("plain", plain), ("lossless", lossless)):
                row = {"pages": n, "batch": b, "chunks": len(chunks), "mode": mode, **r,
                       "x_plain": round(r["tok_s"] / plain["tok_s"], 3),
                       **({"identical": same, "of": len(chunks)} if mode == "lossless" else {})}
                rows.append(row)
                print(f"{n:>5} {b:>5} {mode:<9}{r['tok_s']:>9.1f}{r['tokens_per_forward']:>7.2f}{r['block_share']:>7.2f}"
                      f"{row['x_plain']:>9.2f}  {f'{same}/{len(chunks)}' if mode == 'lossless' else ''}")
    gpu = torch.cuda.get_device_name() if loaded.device.type == "cuda" else "cpu"
    record = {"benchmark": "bench_drafter", "model": args.model, "pages": len(images), "device": gpu,
              "dtype": str(loaded.dtype), "kernels": kernels, "block_drafter": net is not None,
              "tokens_per_page": args.tokens, "results": rows}
    finish(record, args.json)
    return 0 if all(r.get("identical", r.get("of", 0)) == r.get("of", 0) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
