"""Train the block drafter (`engine/drafters/block.py`) for an Unlimited-OCR checkpoint, on one GPU (or the CPU).

    python -m scripts.train.drafter --model models/demo --minutes 12                 # synthetic scan-like pages
    python -m scripts.train.drafter --model models/Unlimited-OCR --images my_scans/ --minutes 30
    python -m scripts.train.drafter --tiny --steps 40 --pages 3 --max-new-tokens 80   # CPU smoke run
    python -m scripts.train.drafter --model models/demo --init models/demo/drafter --page-seed 1100000 --lr 5e-4
    python -m scripts.train.drafter --model models/demo --eval-only --eval-pages 30   # live check of <model>/drafter

How models/demo/drafter was made, and its figures: docs/drafter_training.md.

1. Pages: your own (`--images DIR`: PDFs, TIFFs, PNGs, JPEGs, rendered as uflash renders them) or synthetic
   image-only pages (`ingest.synth`, scan effects, training seeds >= 1,000,000; `--workers` render them).
2. Teacher data, one forward per page under the R-SWA mask (`engine.drafters.block_teacher`):
   `--data decode` (the default for your own pages): the target decodes the pages, up to 64 chunks in one batch
   (`plain`, or `lossless` with the `--init` drafter: the same tokens), and the forward over each output must
   reproduce every greedy token;
   `--data labels` (the default for synthetic pages): the forward runs over the page's label tokens and keeps the
   target's greedy choice at each position; blocks are cut where the label leaves the greedy path. No decode:
   many times more pages a minute. `--multi-frac F` makes a share F of the sequences (either kind of data)
   chunks of 2 to `--multi-pages` consecutive pages (the multi-page prompt uflash decodes; a drafter trained on
   single pages only drafts far worse there).
3. Training: random anchors t; from the features of the C inputs before o_t, the embedding of o_t and (with
   `--memory`, the default) the prompt's features, predict o_{t+1} .. o_{t+k}; cross-entropy weighted towards early
   block positions; AdamW, cosine schedule. Each batch takes `--anchors` anchors from each of its pages.
4. Held-out pages (`--heldout-pages`, label data, seeds < 1,000,000): teacher-forced acceptance by block
   position and the tau it implies (leading drafts that match the target's greedy chain), logged while training.
5. Saved to `<model>/drafter` (or `--out`): uflash's lossless and fast modes use it from then on. `--init FOLDER`
   continues training a saved drafter (its shape and target layers), e.g. on new pages (`--page-seed`).
6. Live check (`--eval-pages`, `scripts/train/drafter_live_check.py`): `lossless` with the block drafter alone against
   `plain` on pages never trained on, each chunk alone (or all in one batch, `--eval-batch`): token-identical,
   tau, acceptance by position, speed ratio.
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

import torch
from tqdm import tqdm

from engine.drafters.block import BlockDrafterConfig, BlockDrafterNet, block_loss, drafter_folder
from engine.drafters.block_teacher import label_features, make_examples, teacher_features, training_windows
from ingest.errors import ExitCode
from scripts.train.drafter_live_check import chunked, evaluate

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".tif", ".tiff"}
DECODE_BATCH = 64  # chunks in flight while decoding teacher pages


def _synthetic_page(seed: int):
    from ingest.synth.documents import make_document, render_pages

    data, labels = make_document(seed, 1, scan=True)
    return render_pages(data, 1024)[0], labels[0]


def synthetic_pages(n: int, seed0: int, workers: int = 0) -> tuple[list, list[str]]:
    """n image-only synthetic pages (seeds seed0 ..) and their labels, rendered by `workers` processes."""
    seeds = range(seed0, seed0 + n)
    if workers > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(workers) as pool:
            items = list(tqdm(pool.imap(_synthetic_page, seeds, chunksize=4), total=n, desc="rendering", unit="page"))
    else:
        items = [_synthetic_page(seed) for seed in tqdm(seeds, desc="rendering", unit="page")]
    return [i[0] for i in items], [i[1] for i in items]


def folder_pages(folder: Path, limit: int) -> list:
    """Up to `limit` pages of the PDFs and images under `folder`, rendered as uflash renders them."""
    import pymupdf
    from PIL import Image

    from ingest.pages.render import render_pages

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


def decode_plain(loaded, chunks: list[list], max_new_tokens: int, desc: str,
                 drafter: BlockDrafterNet | None = None) -> list[list[int]]:
    """The target's own greedy outputs of each chunk (a list of page images; ``max_new_tokens`` per page), in one
    batched engine run (`engine.batch.engine`: up to DECODE_BATCH chunks in flight, CUDA graphs on a GPU; each
    chunk's tokens are those of official generate() of it alone). With ``drafter``: `lossless` with that block
    drafter alone, the same tokens. The processor runs on a chunk only when a row is free for it."""
    from engine.batch.engine import BatchEngine
    from engine.loading import default_kernels

    options = {"max_batch": max(1, min(len(chunks), DECODE_BATCH)), "kernels": default_kernels(loaded)}
    if drafter is None:
        engine = BatchEngine(loaded, "plain", **options)
    else:
        engine = BatchEngine(loaded, "lossless", k_max=drafter.config.block, drafters=("block",),
                             block_net=drafter.to(device=loaded.device, dtype=loaded.dtype), **options)
    waiting = list(enumerate(chunks))[::-1]
    outputs: dict[int, list[int]] = {}
    with tqdm(total=len(chunks), desc=desc, unit="chunk") as bar:
        while waiting or engine.busy:
            while waiting and len(engine.pending) < engine.row_limit - engine.active:
                i, chunk = waiting.pop()
                engine.submit(engine.prepare(chunk, max_new_tokens * len(chunk), key=i))
            for res in engine.step():
                outputs[res.request.key] = res.output_ids
                bar.update()
    return [outputs[i] for i in range(len(chunks))]


def label_ids(loaded, label: str) -> list[int]:
    return loaded.tokenizer(label, add_special_tokens=False)["input_ids"] + [loaded.eos_token_id]


def chunk_label_ids(loaded, labels: list[str]) -> list[int]:
    """A chunk's target as the model writes it: one page is its label; in a chunk of several, each page's label
    follows the page separator; then EOS."""
    if len(labels) == 1:
        return label_ids(loaded, labels[0])
    if loaded.page_sep_id is None:
        raise SystemExit("multi-page label data needs a model whose page separator is one token")
    ids: list[int] = []
    for label in labels:
        ids += [loaded.page_sep_id] + loaded.tokenizer(label, add_special_tokens=False)["input_ids"]
    return ids + [loaded.eos_token_id]


def chunk_groups(n: int, multi_frac: float, max_pages: int, seed: int) -> list[list[int]]:
    """Pages 0..n-1 grouped into chunks, in order: a chunk starts as one of 2..max_pages pages with probability
    multi_frac, else as a single page (uflash decodes documents in chunks of up to 4 pages by default)."""
    rng = random.Random(seed)
    groups, i = [], 0
    while i < n:
        size = rng.randint(2, max_pages) if max_pages > 1 and rng.random() < multi_frac else 1
        groups.append(list(range(i, min(n, i + size))))
        i += size
    return groups


def build_teacher(loaded, chunks, outputs, layers, store_dtype=None):
    """Decode data: one sequence per chunk (a list of page images) and its decoded output ids."""
    seqs = []
    for chunk, ids in tqdm(list(zip(chunks, outputs)), desc="teacher features", unit="chunk"):
        seq = teacher_features(loaded, chunk, ids, layers)
        if len(seq.output_ids) > 1:
            seq.features = seq.features.to(store_dtype or seq.features.dtype)
            seqs.append(seq)
    return seqs


def build_label_teacher(loaded, pages, labels, layers, store_dtype=None, groups=None):
    """Label data (block_teacher.label_features) for synthetic pages, one sequence per chunk of `groups` (page
    indices; default: every page alone)."""
    seqs = []
    groups = groups if groups is not None else [[i] for i in range(len(pages))]
    for group in tqdm(groups, desc="teacher features (labels)", unit="chunk"):
        ids = chunk_label_ids(loaded, [labels[i] for i in group])
        seq = label_features(loaded, [pages[i] for i in group], ids, layers)
        seq.features = seq.features.to(store_dtype or seq.features.dtype)
        seqs.append(seq)
    return seqs


def label_agreement(seqs) -> float:
    """Share of label tokens that are the target's own greedy choice after the label before them."""
    same = sum(sum(a == b for a, b in zip(s.output_ids[1:], s.next_ids)) for s in seqs)
    return same / max(1, sum(len(s.output_ids) - 1 for s in seqs))


def sample_batch(windows_by_seq, rng, batch: int, anchors: int):
    """batch // anchors pages, `anchors` anchors (windows) from each -> (picks [(sequence, t)], the sequence of
    each batch page, the batch page of each pick)."""
    chosen = [windows_by_seq[rng.randrange(len(windows_by_seq))] for _ in range(max(1, batch // anchors))]
    picks = [windows[rng.randrange(len(windows))] for windows in chosen for _ in range(anchors)]
    index = [j for j in range(len(chosen)) for _ in range(anchors)]
    return picks, [windows[0][0] for windows in chosen], index


def forward_batch(net, seqs, picks, pages, index, embed, head):
    """Logits and targets of a batch from `sample_batch`; the page memory is projected once per batch page."""
    c = net.config
    feats, last, targets = make_examples(seqs, picks, c.context, c.block, embed)
    dtype = next(net.parameters()).dtype
    memory = None
    if c.memory:
        prompts = [seqs[s].features[: seqs[s].prompt_len] for s in pages]
        lengths = [p.shape[0] for p in prompts]
        mem = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True)
        memory = net.encode_memory(mem.to(dtype), lengths, torch.tensor(index, device=mem.device))
    return net(feats.to(dtype), last.to(dtype), head, memory), targets


@torch.no_grad()
def proxy_eval(net, loaded, seqs, max_examples: int = 4096, seed: int = 1) -> dict:
    """Teacher-forced acceptance on held-out label pages: by block position (the draft matches the target's
    greedy chain and every earlier one did), and the tau that implies (mean leading matches per draft)."""
    c = net.config
    rng = random.Random(seed)
    by_seq = [[(i, t) for _, t in training_windows([s], c.context)] for i, s in enumerate(seqs)]
    by_seq = [ws for ws in by_seq if ws]
    embed, head = loaded.model.get_input_embeddings(), loaded.model.lm_head
    was_training = net.training
    net.eval()
    hits = torch.zeros(c.block)
    n = 0
    while n < max_examples:
        picks, pages, index = sample_batch(by_seq, rng, 256, 16)
        logits, targets = forward_batch(net, seqs, picks, pages, index, embed, head)
        ok = (logits.argmax(-1) == targets) & (targets != -100)
        lead = torch.cumprod(ok.int(), dim=1).bool()
        hits += lead.sum(0).float().cpu()
        n += len(picks)
    net.train(was_training)
    by_position = (hits / n).tolist()
    return {"tau": round(sum(by_position), 3), "acceptance_by_position": [round(x, 3) for x in by_position],
            "examples": n}


def train(net: BlockDrafterNet, loaded, seqs, steps: int | None, seconds: float | None, batch: int, lr: float,
          seed: int, anchors: int = 16, heldout=None, eval_every: float = 60.0, log_every: int = 20) -> dict:
    c = net.config
    windows = training_windows(seqs, c.context)
    if not windows:
        raise SystemExit(f"no training windows: outputs too short for a context of {c.context}")
    by_seq: dict[int, list] = {}
    for w in windows:
        by_seq.setdefault(w[0], []).append(w)
    by_seq = list(by_seq.values())
    rng = random.Random(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    embed, head = loaded.model.get_input_embeddings(), loaded.model.lm_head
    losses, t0, step, last_eval, evals = [], time.time(), 0, 0.0, []  # first held-out check after step 1
    total = steps if steps else None
    net.train()
    while True:
        elapsed = time.time() - t0
        if (total is not None and step >= total) or (total is None and elapsed >= seconds):
            break
        frac = step / total if total else elapsed / seconds
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
        picks, pages, index = sample_batch(by_seq, rng, batch, anchors)
        logits, targets = forward_batch(net, seqs, picks, pages, index, embed, head)
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
        if heldout and time.time() - last_eval >= eval_every:
            ev = proxy_eval(net, loaded, heldout)
            evals.append({"step": step, "seconds": round(time.time() - t0, 1), **ev})
            print(f"step {step:5d}  held-out tau {ev['tau']:.3f}  by position {ev['acceptance_by_position']}",
                  flush=True)
            last_eval = time.time()
    net.eval()
    k = max(1, len(losses) // 10)
    out = {"steps": step, "seconds": round(time.time() - t0, 1), "windows": len(windows),
           "loss_first": sum(losses[:k]) / k, "loss_last": sum(losses[-k:]) / k}
    if heldout:
        out["heldout"] = proxy_eval(net, loaded, heldout)
        out["heldout_curve"] = evals
    return out


def live_check(loaded, net: BlockDrafterNet, args) -> dict:
    """`drafter_live_check.evaluate` on ``--eval-pages`` held-out pages (seeds 850,000 ..; the warm-up chunk's
    from 849,000), as the command line asks."""
    size = args.eval_chunk_pages
    held, _ = synthetic_pages(args.eval_pages, 850_000, args.workers)  # held-out seeds (< 1,000,000)
    warmup = [synthetic_pages(size, 849_000, args.workers)[0]] if args.eval_warmup else []
    return evaluate(loaded, net, chunked(held, size), args.max_new_tokens, k_max=args.eval_k_max or net.config.block,
                    block_sits_out=not args.no_sit_out, block_full_k=args.block_full_k, warmup=warmup,
                    batch=args.eval_batch)


def decoded_heldout(loaded, net: BlockDrafterNet, args) -> dict:
    """`proxy_eval` on ``--decoded-heldout-pages`` held-out pages (seeds 820,000 ..) as the target decodes them
    (`lossless` with ``net``: the target's own tokens), not on their labels: label data never shows the drafter
    the target's own mistakes in its context."""
    n = args.decoded_heldout_pages
    seqs, chunks = decoded_heldout_seqs(loaded, net, n, args.multi_frac, args.multi_pages, args.seed,
                                        args.max_new_tokens, args.workers)
    return {"pages": n, "chunks": len(chunks), "tokens": sum(len(s.output_ids) for s in seqs),
            **proxy_eval(net, loaded, seqs, max_examples=8192)}


def decoded_heldout_seqs(loaded, net: BlockDrafterNet, n: int, multi_frac: float, multi_pages: int, seed: int,
                         max_new_tokens: int, workers: int = 0) -> tuple[list, list]:
    """(teacher sequences, chunks) of n held-out pages (seeds 820,000 ..) chunked as ``chunk_groups`` says and
    decoded by the target (`lossless` with ``net``: its own greedy tokens)."""
    pages, _ = synthetic_pages(n, 820_000, workers)
    chunks = [[pages[i] for i in g] for g in chunk_groups(n, multi_frac, multi_pages, seed)]
    outputs = decode_plain(loaded, chunks, max_new_tokens, "decoding held-out pages (lossless)", net)
    return build_teacher(loaded, chunks, outputs, list(net.config.layers)), chunks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder (e.g. models/demo, or a downloaded baidu/Unlimited-OCR)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random target (CPU smoke run)")
    ap.add_argument("--out", help="drafter folder (default: <model>/drafter)")
    ap.add_argument("--images", help="train on the pages of the PDFs/images in this folder instead of synthetic ones")
    ap.add_argument("--pairs", help="train on pages people corrected, their texts as labels (the folder `uflash "
                                    "export-corrections --out DIR` wrote)")
    ap.add_argument("--pages", type=int, default=200, help="training pages")
    ap.add_argument("--page-seed", type=int, default=1_000_000,
                    help="seed of the first synthetic training page (>= 1,000,000; a fresh range to continue on "
                         "new pages)")
    ap.add_argument("--init", help="start from this drafter folder (its shape; --block, --dim .. are ignored)")
    ap.add_argument("--eval-only", action="store_true",
                    help="no training: the live check (--eval-pages) of --init (default: <model>/drafter)")
    ap.add_argument("--data", choices=("auto", "labels", "decode"), default="auto",
                    help="teacher data: the target's decode, or the synthetic pages' labels (auto: labels for "
                         "synthetic pages, decode for --images)")
    ap.add_argument("--workers", type=int, default=0, help="processes rendering synthetic pages")
    ap.add_argument("--heldout-pages", type=int, default=0, help="held-out label pages for the teacher-forced tau")
    ap.add_argument("--eval-pages", type=int, default=0, help="held-out pages for the lossless-vs-plain check")
    ap.add_argument("--decoded-heldout-pages", type=int, default=0,
                    help="teacher-forced tau on N held-out pages as the target decodes them (seeds 820,000 ..; "
                         "chunked as --multi-frac says), not on their labels")
    ap.add_argument("--eval-chunk-pages", type=int, default=1, help="live check: pages per decoded chunk")
    ap.add_argument("--eval-k-max", type=int, help="live check: longest draft verified (default: the block size)")
    ap.add_argument("--multi-frac", type=float, default=0.0,
                    help="share of training chunks of 2..--multi-pages consecutive pages (multi-page prompts, as "
                         "uflash's chunks); also for the held-out label pages")
    ap.add_argument("--multi-pages", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=1500)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                    help="the drafter also attends to the prompt's (the pages') features")
    ap.add_argument("--layers", help="target layers, e.g. 1,6,11 (default: an early, a middle and the last one)")
    ap.add_argument("--drafter-layers", type=int, default=2)
    ap.add_argument("--steps", type=int, help="optimizer steps (default: train for --minutes)")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--anchors", type=int, default=16, help="anchors per page in a batch")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-batch", action="store_true",
                    help="live check: every chunk in one batch on each side (default: each chunk alone, batch 1)")
    ap.add_argument("--eval-warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="live check: both sides decode one chunk of other pages first, untimed (graph capture)")
    ap.add_argument("--block-full-k", action="store_true",
                    help="live check: the block drafter always drafts its whole block (no K cut after a miss)")
    ap.add_argument("--no-sit-out", action="store_true",
                    help="live check: the block drafter drafts every round, even after a wholly rejected draft")
    ap.add_argument("--json", help="also write the record here")
    args = ap.parse_args(argv)
    if not args.model and not args.tiny:
        ap.error("--model PATH or --tiny")
    data = args.data if args.data != "auto" else ("decode" if args.images and not args.pairs else "labels")
    if data == "labels" and args.images:
        ap.error("--data labels needs synthetic pages (your own pages have no labels): leave out --images")
    if args.page_seed < 1_000_000:
        ap.error("--page-seed must be >= 1,000,000 (lower seeds are the held-out pages)")
    if args.eval_only and not (args.eval_pages or args.decoded_heldout_pages):
        ap.error("--eval-only needs --eval-pages N (or --decoded-heldout-pages N)")

    from engine.model.load import load_model

    torch.manual_seed(args.seed)
    tmp = None
    if args.tiny:
        from engine.model.tiny import build_tiny_model

        tmp = tempfile.TemporaryDirectory()
        args.model = str(build_tiny_model(Path(tmp.name) / "tiny", sliding_window=8, seed=args.seed, text_init=0.02))
        args.device, args.dtype = "cpu", "float32"
    loaded = load_model(args.model, args.device, args.dtype)
    text_cfg = loaded.model.config.text_config
    layers = [int(x) for x in args.layers.split(",")] if args.layers else \
        BlockDrafterConfig.default_layers(text_cfg.num_hidden_layers)
    init = None
    if args.init and not args.eval_only:
        init = BlockDrafterNet.load(args.init)
        layers = list(init.config.layers)  # the teacher features it was made for
    store = torch.bfloat16 if loaded.device.type == "cuda" else None  # teacher features kept on the GPU
    if args.eval_only:
        folder = Path(args.init) if args.init else drafter_folder(args.model)
        net = BlockDrafterNet.load(folder, loaded.device, loaded.dtype)
        record = {"model": str(args.model), "drafter": str(folder)}
        if args.decoded_heldout_pages:
            record["decoded_heldout"] = decoded_heldout(loaded, net, args)
            print(f"teacher-forced tau on {args.decoded_heldout_pages} decoded held-out pages: "
                  f"{record['decoded_heldout']['tau']:.3f} {record['decoded_heldout']['acceptance_by_position']}")
        if args.eval_pages:
            ev = record["eval"] = live_check(loaded, net, args)
            print(f"{'pages':>6} {'identical':>9} {'tau':>6} {'speedup':>8} {'ms plain':>9} {'ms draft':>9} "
                  f"{'ms verify':>10}")
            print(f"{ev['pages']:>6} {ev['identical']:>9} {ev['tau_mean']:>6.2f} {ev['speedup_vs_plain']:>8.2f} "
                  f"{ev['ms_plain_step']:>9.3f} {ev['ms_draft']:>9.3f} {ev['ms_verify_round']:>10.3f}")
        if args.json:
            Path(args.json).write_text(json.dumps(record, indent=1))
        print(json.dumps(record))
        return ExitCode.OK
    t0 = time.time()
    labels = None
    if args.pairs:
        from ingest.review.export import read_pairs

        pages, labels = read_pairs(Path(args.pairs), args.pages)
    elif args.images:
        pages = folder_pages(Path(args.images), args.pages)
    else:
        pages, labels = synthetic_pages(args.pages, args.page_seed, args.workers)
    render_s = time.time() - t0
    groups = chunk_groups(len(pages), args.multi_frac, args.multi_pages, args.seed)
    if data == "decode":
        chunks = [[pages[i] for i in group] for group in groups]
        helper = None if init is None else BlockDrafterNet.load(args.init, loaded.device, loaded.dtype)
        outputs = decode_plain(loaded, chunks, args.max_new_tokens,
                               "decoding (plain)" if helper is None else "decoding (lossless, --init drafter)", helper)
        decode_s = time.time() - t0 - render_s
        seqs = build_teacher(loaded, chunks, outputs, layers, store)
    else:
        decode_s = 0.0
        seqs = build_label_teacher(loaded, pages, labels, layers, store, groups)
    teacher_s = time.time() - t0 - render_s - decode_s
    heldout = None
    if args.heldout_pages:
        h_pages, h_labels = synthetic_pages(args.heldout_pages, 800_000, args.workers)  # held-out seeds
        heldout = build_label_teacher(loaded, h_pages, h_labels, layers, store,
                                      chunk_groups(len(h_pages), args.multi_frac, args.multi_pages, args.seed + 1))
    context = min(args.context, min(s.prompt_len for s in seqs))
    if init is not None:
        net = init.to(loaded.device).requires_grad_(True)
        net.config.meta = {**net.config.meta, "pages": net.config.meta.get("pages", 0) + len(pages),
                           "continued_from": str(args.init)}
    else:
        config = BlockDrafterConfig(target_hidden=text_cfg.hidden_size, layers=layers, block=args.block,
                                    context=context, dim=args.dim, num_layers=args.drafter_layers, memory=args.memory,
                                    meta={"model": str(args.model), "pages": len(pages), "data": data,
                                          "source": args.pairs or args.images or "synthetic scan-like pages"})
        net = BlockDrafterNet(config).to(loaded.device)
    if loaded.dtype != torch.float32:
        net = net.to(loaded.dtype)
    fit = train(net, loaded, seqs, args.steps, args.minutes * 60 if not args.steps else None, args.batch, args.lr,
                args.seed, anchors=min(args.anchors, args.batch), heldout=heldout)
    out = Path(args.out) if args.out else drafter_folder(args.model)
    net.requires_grad_(False)
    net.save(out)
    c = net.config
    record = {"model": str(args.model), "out": str(out), "pages": len(pages), "data": data, "layers": layers,
              "block": c.block, "context": c.context, "memory": c.memory, "init": args.init, "sequences": len(seqs),
              "multi_frac": args.multi_frac,
              "params": sum(p.numel() for p in net.parameters()),
              "tokens": sum(len(s.output_ids) for s in seqs), "render_s": round(render_s, 1),
              "decode_s": round(decode_s, 1), "teacher_s": round(teacher_s, 1), **fit}
    if data == "labels":
        record["label_agreement"] = round(label_agreement(seqs), 4)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))  # kept if the live check is cut short
    if args.eval_pages:
        record["eval"] = live_check(loaded, net, args)
    print(f"{'pages':>6} {'tokens':>7} {'steps':>6} {'loss first':>10} {'loss last':>9} {'tf tau':>7} {'tau':>6} "
          f"{'speedup':>8}")
    ev = record.get("eval", {})
    print(f"{record['pages']:>6} {record['tokens']:>7} {fit['steps']:>6} {fit['loss_first']:>10.4f} "
          f"{fit['loss_last']:>9.4f} {fit.get('heldout', {}).get('tau', float('nan')):>7.2f} "
          f"{ev.get('tau_mean', float('nan')):>6.2f} {ev.get('speedup_vs_plain', float('nan')):>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    print(json.dumps(record))
    if tmp is not None:
        tmp.cleanup()
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
