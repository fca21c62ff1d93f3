#!/usr/bin/env python3
"""Train the block drafter (`engine/drafters/block.py`) for an Unlimited-OCR checkpoint, on one GPU (or the CPU).

    python3 scripts/train_drafter.py --model models/demo --minutes 12                 # synthetic scan-like pages
    python3 scripts/train_drafter.py --model models/Unlimited-OCR --images my_scans/ --minutes 30
    python3 scripts/train_drafter.py --tiny --steps 40 --pages 3 --max-new-tokens 80   # CPU smoke run

1. Pages: your own (`--images DIR`: PDFs, TIFFs, PNGs, JPEGs, rendered as uflash renders them) or synthetic
   image-only pages (`scripts.synth`, scan effects, training seeds >= 1,000,000).
2. The target decodes each page (the engine's `plain` mode: token-identical to the official path).
3. Teacher features: one forward of prompt + output under the R-SWA mask (`engine.drafters.block_teacher`),
   refused unless it reproduces every greedy token.
4. Training: random anchors t; from the features of the C inputs before o_t and the embedding of o_t, predict
   o_{t+1} .. o_{t+k}; cross-entropy weighted towards early block positions; AdamW, cosine schedule.
5. Saved to `<model>/drafter` (or `--out`): uflash's lossless and fast modes use it from then on.
6. Held-out check (`--eval-pages`): `lossless` with the block drafter alone against `plain` on pages never trained
   on: token-identical, tau, acceptance by position, speed ratio.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.drafters.block import BlockDrafterConfig, BlockDrafterNet, block_loss, drafter_folder  # noqa: E402
from engine.drafters.block_teacher import make_examples, teacher_features, training_windows  # noqa: E402

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".tif", ".tiff"}


def synthetic_pages(n: int, seed0: int) -> list:
    from scripts.synth import make_document, render_pages

    return [render_pages(make_document(seed0 + k, 1, scan=True)[0], 1024)[0] for k in range(n)]


def folder_pages(folder: Path, limit: int) -> list:
    """Up to `limit` pages of the PDFs and images under `folder`, rendered as uflash renders them."""
    import pymupdf
    from PIL import Image

    from ingest.render import render_pages

    pages = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        suffix = path.suffix.lower()
        if suffix == ".pdf":
            with pymupdf.open(path) as doc:
                n, kind = doc.page_count, "pdf"
        elif suffix in IMAGE_SUFFIXES:
            with Image.open(path) as img:
                n, kind = getattr(img, "n_frames", 1), "image"
        else:
            continue
        pages += [p.image for p in render_pages(path, kind, 1, min(n, limit - len(pages)))]
        if len(pages) >= limit:
            break
    if not pages:
        raise SystemExit(f"no PDF or image pages under {folder}")
    return pages


def decode_plain(loaded, pages: list, max_new_tokens: int, desc: str) -> list[list[int]]:
    from tqdm import tqdm

    from engine.speculative import SpeculativeDecoder

    plain = SpeculativeDecoder(loaded, mode="plain")
    return [plain.generate([page], max_new_tokens).output_ids for page in tqdm(pages, desc=desc, unit="page")]


def build_teacher(loaded, pages, outputs, layers):
    seqs = [teacher_features(loaded, [page], ids, layers) for page, ids in zip(pages, outputs)]
    return [s for s in seqs if len(s.output_ids) > 1]


def train(net: BlockDrafterNet, loaded, seqs, steps: int | None, seconds: float | None, batch: int, lr: float,
          seed: int, log_every: int = 20) -> dict:
    c = net.config
    windows = training_windows(seqs, c.context)
    if not windows:
        raise SystemExit(f"no training windows: outputs too short for a context of {c.context}")
    rng = random.Random(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    embed, head = loaded.model.get_input_embeddings(), loaded.model.lm_head
    losses, t0, step = [], time.time(), 0
    total = steps if steps else None
    net.train()
    while True:
        elapsed = time.time() - t0
        if (total is not None and step >= total) or (total is None and elapsed >= seconds):
            break
        frac = step / total if total else elapsed / seconds
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
        feats, last, targets = make_examples(seqs, [rng.choice(windows) for _ in range(batch)], c.context, c.block,
                                             embed)
        dtype = next(net.parameters()).dtype
        logits = net(feats.to(dtype), last.to(dtype), head)
        loss = block_loss(logits, targets, c.loss_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % log_every == 0:
            acc0 = (logits[:, 0].argmax(-1) == targets[:, 0]).float().mean().item()
            print(f"step {step:5d}  loss {sum(losses[-log_every:]) / log_every:.4f}  first-token acc {acc0:.3f}  "
                  f"{step / (time.time() - t0):.1f} steps/s", flush=True)
    net.eval()
    k = max(1, len(losses) // 10)
    return {"steps": step, "seconds": round(time.time() - t0, 1), "windows": len(windows),
            "loss_first": sum(losses[:k]) / k, "loss_last": sum(losses[-k:]) / k}


def evaluate(loaded, net, pages, max_new_tokens: int, k_max: int) -> dict:
    """lossless with the block drafter alone vs plain on the same pages, side by side."""
    from engine.speculative import SpeculativeDecoder

    plain = SpeculativeDecoder(loaded, mode="plain")
    spec = SpeculativeDecoder(loaded, mode="lossless", k_max=k_max, drafters=("block",), block_net=net)
    rows, identical = [], 0
    for page in pages:
        a = plain.generate([page], max_new_tokens)
        b = spec.generate([page], max_new_tokens)
        identical += a.output_ids == b.output_ids
        s = b.extra["speculative"]
        rows.append({"tokens": len(b.output_ids), "plain_s": a.seconds, "block_s": b.seconds, "tau": s["tau"],
                     "draft_share": s["draft_share"],
                     "by_position": s["drafters"].get("block", {}).get("acceptance_by_position", [])})
    n = len(rows)
    return {"pages": n, "identical": identical, "tau_mean": round(sum(r["tau"] for r in rows) / n, 3),
            "speedup_vs_plain": round(sum(r["plain_s"] for r in rows) / sum(r["block_s"] for r in rows), 3),
            "draft_share": round(sum(r["draft_share"] for r in rows) / n, 4),
            "acceptance_by_position": _mean_lists([r["by_position"] for r in rows])}


def _mean_lists(lists):
    width = max((len(x) for x in lists), default=0)
    cols = [[x[j] for x in lists if j < len(x)] for j in range(width)]
    return [round(sum(c) / len(c), 3) for c in cols]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder (e.g. models/demo, or a downloaded baidu/Unlimited-OCR)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random target (CPU smoke run)")
    ap.add_argument("--out", help="drafter folder (default: <model>/drafter)")
    ap.add_argument("--images", help="train on the pages of the PDFs/images in this folder instead of synthetic ones")
    ap.add_argument("--pages", type=int, default=200, help="training pages")
    ap.add_argument("--eval-pages", type=int, default=0, help="held-out pages for the lossless-vs-plain check")
    ap.add_argument("--max-new-tokens", type=int, default=1500)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", help="target layers, e.g. 1,6,11 (default: an early, a middle and the last one)")
    ap.add_argument("--drafter-layers", type=int, default=2)
    ap.add_argument("--steps", type=int, help="optimizer steps (default: train for --minutes)")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the record here")
    args = ap.parse_args(argv)
    if not args.model and not args.tiny:
        ap.error("--model PATH or --tiny")

    from engine.model import load_model

    torch.manual_seed(args.seed)
    tmp = None
    if args.tiny:
        from engine.tiny import build_tiny_model

        tmp = tempfile.TemporaryDirectory()
        args.model = str(build_tiny_model(Path(tmp.name) / "tiny", sliding_window=8, seed=args.seed, text_init=0.02))
        args.device, args.dtype = "cpu", "float32"
    loaded = load_model(args.model, args.device, args.dtype)
    text_cfg = loaded.model.config.text_config
    layers = [int(x) for x in args.layers.split(",")] if args.layers else \
        BlockDrafterConfig.default_layers(text_cfg.num_hidden_layers)
    t0 = time.time()
    pages = folder_pages(Path(args.images), args.pages) if args.images else synthetic_pages(args.pages, 1_000_000)
    outputs = decode_plain(loaded, pages, args.max_new_tokens, "decoding (plain)")
    decode_s = time.time() - t0
    seqs = build_teacher(loaded, pages, outputs, layers)
    teacher_s = time.time() - t0 - decode_s
    context = min(args.context, min(s.prompt_len for s in seqs))
    config = BlockDrafterConfig(target_hidden=text_cfg.hidden_size, layers=layers, block=args.block, context=context,
                                dim=args.dim, num_layers=args.drafter_layers,
                                meta={"model": str(args.model), "pages": len(pages),
                                      "source": args.images or "synthetic scan-like pages"})
    net = BlockDrafterNet(config).to(loaded.device)
    if loaded.dtype != torch.float32:
        net = net.to(loaded.dtype)
    fit = train(net, loaded, seqs, args.steps, args.minutes * 60 if not args.steps else None, args.batch, args.lr,
                args.seed)
    out = Path(args.out) if args.out else drafter_folder(args.model)
    net.requires_grad_(False)
    net.save(out)
    record = {"model": str(args.model), "out": str(out), "pages": len(pages), "layers": layers,
              "block": args.block, "context": context, "params": sum(p.numel() for p in net.parameters()),
              "tokens": sum(len(s.output_ids) for s in seqs), "decode_s": round(decode_s, 1),
              "teacher_s": round(teacher_s, 1), **fit}
    if args.eval_pages:
        held = synthetic_pages(args.eval_pages, 850_000)  # held-out seeds (< 1,000,000)
        record["eval"] = evaluate(loaded, net, held, args.max_new_tokens, k_max=args.block)
    print(f"{'pages':>6} {'tokens':>7} {'steps':>6} {'loss first':>10} {'loss last':>9} {'tau':>6} {'speedup':>8}")
    ev = record.get("eval", {})
    print(f"{record['pages']:>6} {record['tokens']:>7} {fit['steps']:>6} {fit['loss_first']:>10.4f} "
          f"{fit['loss_last']:>9.4f} {ev.get('tau_mean', float('nan')):>6.2f} {ev.get('speedup_vs_plain', float('nan')):>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    print(json.dumps(record))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
