"""What `fast` mode costs and saves, and what a lossless re-run after it costs, through the real pipeline.

On N synthetic pages (ingest.synth.documents.make_document, held-out seeds < 1,000,000, PDFs with a text layer, or with
``--scan`` image-only scan-like PDFs: no text layer, so no reference drafts, as with an archive's scans), each
in its own ledger and folders under a temporary directory, with one model loaded once and shared:
1. ``lossless``: a first run (intake, chunks, worker, outputs), timed;
2. ``fast``: the same pages in a fresh ledger, timed; then the normalized edit distance of every page's text
   to the lossless text (mean, max, pages over 0.05);
3. ``rerun``: in the fast ledger, ``uflash rerun --mode lossless`` of every page (the fast output is the
   replay/reference draft), timed; its texts must equal the first lossless run's exactly.
Times are the worker's wall time (model loading excluded, rendering and DB included) and the decoders' own
seconds (sum over chunks). Each pass also reports its CER to the generator's labels.

``--fast-threshold 0.1,0.2,0.3`` sweeps: one lossless pass, then a fast pass and its re-run per threshold (the
record's top-level figures are the first threshold's; ``sweep`` holds every one). Besides wall times the record
counts forwards (prefill + verify rounds + single steps, summed over chunks): a speed figure that a shared
machine's timing noise does not move, and the one that carries over to a GPU, where a
verify round costs about as much as a single step.

Prints a table, then one JSON object as the last line. Usage:
    python -m scripts.bench.fast --model models/demo --pages 50 --json bench_fast.json   # chunks of <= 4 pages
    python -m scripts.bench.fast --tiny --pages 4 --max-tokens-per-page 60     # smoke test: numbers mean nothing
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

from ingest.synth.documents import HELD_OUT_LIMIT, make_document

DEFAULT_SEED = 770_001  # held out: below HELD_OUT_LIMIT, never used for training


def environment() -> dict:
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda, "host": platform.node()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, vram_gb=round(props.total_memory / 2**30, 1))
    return env


def write_documents(inbox: Path, n_pages: int, pages_per_doc: int, seed: int, scan: bool = False
                    ) -> tuple[list[Path], dict]:
    """The PDFs, and each page's label text keyed like the ledger's pages: (file name, page index from 0)."""
    inbox.mkdir(parents=True, exist_ok=True)
    paths, left, k, labels = [], n_pages, 0, {}
    while left > 0:
        n = min(pages_per_doc, left)
        if not seed + k < HELD_OUT_LIMIT:
            raise ValueError(f"seed {seed + k} is not held out (must be < {HELD_OUT_LIMIT})")
        pdf, page_labels = make_document(seed + k, n, scan=scan)
        path = inbox / f"synth-{seed + k}.pdf"
        labels.update({(path.name, i): text for i, text in enumerate(page_labels)})
        path.write_bytes(pdf)
        paths.append(path)
        left -= n
        k += 1
    return paths, labels


def cer_to_labels(texts: dict, labels: dict) -> float:
    """Character error rate of a pass's pages against the generator's labels (markup stripped, whitespace
    collapsed): how close each pass is to the truth, not to the other pass."""
    from rapidfuzz.distance import Levenshtein

    from ingest.synth.documents import strip_markup

    edits = chars = 0
    for (name, i), text in texts.items():
        ref = strip_markup(labels[(name, i - 1)])  # the ledger's page_index is 1-based
        edits += Levenshtein.distance(strip_markup(text or ""), ref)
        chars += len(ref)
    return edits / max(1, chars)


def make_settings(folder: Path, args: argparse.Namespace, mode: str, fast_threshold: float):
    from ingest.config import load_settings

    folder.mkdir(parents=True, exist_ok=True)
    engine = {"mode": mode, "fast_threshold": fast_threshold, "max_pages_per_chunk": args.max_pages_per_chunk}
    if args.max_tokens_per_page:
        engine["max_tokens_per_page"] = args.max_tokens_per_page
    cfg = folder / "config.toml"
    lines = ["[folders]", *(f'{k} = "{k}"' for k in ("inbox", "outbox", "archive", "failed", "logs")),
             "[database]", 'url = "sqlite:///uflash.db"',
             "[model]", f'path = "{args.model}"', f'device = "{args.device}"', f'dtype = "{args.dtype}"',
             "[engine]", *(f"{k} = {json.dumps(v)}" for k, v in engine.items()),
             "[worker]", "poll_seconds = 0.05", "lease_seconds = 3600.0", "heartbeat_seconds = 60.0"]
    cfg.write_text("\n".join(lines) + "\n", encoding="utf-8")
    s = load_settings(cfg)
    s.ensure_folders()
    return s


def decoder_factory(loaded, args: argparse.Namespace):
    from engine.batch.engine import BatchEngine
    from engine.chunk_decode import EngineDecoder, OfficialDecoder
    from engine.loading import default_kernels, load_block_drafter

    block_net = None if args.no_block else load_block_drafter(loaded)  # as uflash: the model folder's drafter

    def make(mode: str, fast_threshold: float = 0.3):
        if mode == "official":
            return OfficialDecoder(loaded)
        return EngineDecoder(BatchEngine(loaded, mode, fast_threshold=fast_threshold, kernels=default_kernels(loaded),
                                         block_net=block_net if mode != "plain" else None))

    make.block_drafter = block_net is not None
    return make


def texts_and_sums(db, run_id: int) -> tuple[dict, dict]:
    """The run's page texts, and its chunks' decode seconds, output tokens, forwards and relaxed tokens summed."""
    from db.runs import run_chunk_stats, run_pages

    texts = {(d.original_name, p.page_index): p.text for p, d in run_pages(db, run_id)}
    stats = run_chunk_stats(db, run_id)
    sums = {"decode_s": sum(st.get("seconds", 0.0) for st in stats),
            **{key: sum(st.get(stat, 0) for st in stats) for key, stat in
               (("tokens", "output_tokens"), ("forwards", "forwards"), ("relaxed_tokens", "relaxed_tokens"))}}
    return texts, sums


def first_pass(folder: Path, args, mode: str, pdfs: list[Path], make_decoder, fast_threshold: float = 0.3) -> dict:
    """A first run of ``pdfs`` in ``mode`` in a fresh ledger: (settings, db, run id, texts, seconds)."""
    import shutil

    from db.documents import unfinished_documents
    from db.session import Database
    from ingest.intake.enqueue import intake_file
    from ingest.worker.worker import Worker

    s = make_settings(folder, args, mode, fast_threshold)
    db = Database(s.database_url)
    for pdf in pdfs:
        intake_file(db, s, Path(shutil.copy(pdf, s.inbox / pdf.name)))
    decoder = make_decoder(mode, fast_threshold)
    worker = Worker(s, db, lambda: decoder)

    def done() -> bool:
        return not unfinished_documents(db)

    t0 = time.perf_counter()
    with worker:
        worker.serve(threading.Event(), until=done)
    wall = time.perf_counter() - t0
    run_id = worker.run_id()
    texts, sums = texts_and_sums(db, run_id)
    return {"settings": s, "db": db, "run_id": run_id, "texts": texts, "wall_s": wall, **sums}


def rerun_pass(first: dict, make_decoder) -> dict:
    from ingest.commands.rerun import rerun
    from ingest.worker.worker import Worker

    s, db = first["settings"], first["db"]
    decoder = make_decoder("lossless")
    t0 = time.perf_counter()  # every page: `uflash rerun --mode lossless --pages 1-<all>`
    res = rerun(s, db, lambda st, d, **kw: Worker(st, d, lambda: decoder, **kw), threading.Event(),
                lambda run_id: None, pages=(1, 1_000_000))  # no report for a benchmark's run
    wall = time.perf_counter() - t0
    if res.failed:
        raise RuntimeError(f"re-run failed: {res.failed}")
    texts, sums = texts_and_sums(db, res.run_id)
    return {"run_id": res.run_id, "texts": texts, "wall_s": wall, **sums}


def figures(r: dict, keys=("wall_s", "decode_s", "tokens", "forwards", "relaxed_tokens")) -> dict:
    """A pass's figures for the record (floats rounded)."""
    return {k: round(r[k], 3) if isinstance(r[k], float) else r[k] for k in keys if k in r}


def compare(threshold: float, lossless: dict, fast: dict, again: dict, keys: list, labels: dict) -> dict:
    """One fast pass and its lossless re-run against the first lossless pass."""
    from ingest.quality.measures import normalized_edit_distance

    neds = [normalized_edit_distance(fast["texts"][k], lossless["texts"][k]) for k in keys]
    same = [again["texts"].get(k) == lossless["texts"][k] for k in keys]
    return {
        "fast_threshold": threshold, "fast": figures(fast), "rerun": figures(again),
        "speedup_fast_vs_lossless": round(lossless["wall_s"] / fast["wall_s"], 3) if fast["wall_s"] else None,
        "forwards_ratio_fast": round(lossless["forwards"] / fast["forwards"], 3) if fast["forwards"] else None,
        "rerun_share_of_lossless": round(again["wall_s"] / lossless["wall_s"], 3) if lossless["wall_s"] else None,
        "forwards_share_rerun": round(again["forwards"] / lossless["forwards"], 3) if lossless["forwards"] else None,
        "fast_edit_distance_mean": round(sum(neds) / len(neds), 6) if neds else None,
        "fast_edit_distance_max": round(max(neds), 6) if neds else None,
        "fast_pages_over_0.05": sum(d > 0.05 for d in neds),
        "fast_cer_to_labels": round(cer_to_labels(fast["texts"], labels), 5),
        "rerun_equals_lossless": all(same), "rerun_pages_equal": sum(same),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model folder (the demo model or real weights)")
    p.add_argument("--tiny", action="store_true", help="build a tiny random model (smoke test only)")
    p.add_argument("--pages", type=int, default=50)
    p.add_argument("--pages-per-doc", type=int, default=10)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--scan", action="store_true", help="image-only scan-like PDFs (no text layer)")
    p.add_argument("--fast-threshold", default="0.3", help="one threshold, or several to sweep: 0.1,0.2,0.3")
    p.add_argument("--no-block", action="store_true", help="leave out the model folder's block drafter")
    p.add_argument("--max-pages-per-chunk", type=int, default=4,
                   help="engine.max_pages_per_chunk (4: the demo model was trained on 1-4 pages; 16 for the real one)")
    p.add_argument("--max-tokens-per-page", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--workdir", help="keep the ledgers and outputs here (default: a temporary folder)")
    p.add_argument("--json", metavar="PATH", help="also write the JSON record here")
    args = p.parse_args(argv)
    if not args.model and not args.tiny:
        p.error("--model PATH or --tiny")

    import torch
    from loguru import logger

    from engine.model.load import load_model

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    tmp = tempfile.TemporaryDirectory(prefix="bench_fast-") if not args.workdir else None
    work = Path(args.workdir or tmp.name).resolve()
    if args.tiny:
        from engine.model.tiny import build_tiny_model

        args.model = str(build_tiny_model(work / "tiny-model", sliding_window=8))
    args.model = str(Path(args.model).resolve())
    loaded = load_model(args.model, args.device, args.dtype)
    if args.tiny:
        torch.set_num_threads(1)
    make_decoder = decoder_factory(loaded, args)
    pdfs, labels = write_documents(work / "synthetic", args.pages, args.pages_per_doc, args.seed, args.scan)

    thresholds = [float(t) for t in str(args.fast_threshold).split(",")]
    lossless = first_pass(work / "lossless", args, "lossless", pdfs, make_decoder)
    keys = sorted(lossless["texts"])
    passes, dbs = [], [lossless["db"]]
    for threshold in thresholds:
        fast = first_pass(work / f"fast-{threshold:g}", args, "fast", pdfs, make_decoder, threshold)
        again = rerun_pass(fast, make_decoder)
        dbs.append(fast["db"])
        passes.append(compare(threshold, lossless, fast, again, keys, labels))

    record = {
        "bench": "fast", "model": args.model, "mode_settings": {"fast_threshold": thresholds[0],
                                                                 "max_pages_per_chunk": args.max_pages_per_chunk,
                                                                 "max_tokens_per_page": args.max_tokens_per_page},
        "env": environment(), "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch."),
        "block_drafter": make_decoder.block_drafter, "pages": len(keys), "scan": args.scan, "seeds": [args.seed, args.seed + len(pdfs) - 1],
        "lossless": figures(lossless, ("wall_s", "decode_s", "tokens", "forwards")), **passes[0],
        "cer_to_labels": {"lossless": round(cer_to_labels(lossless["texts"], labels), 5),
                          "fast": passes[0]["fast_cer_to_labels"]},
        "sweep": passes,
    }
    print(f"lossless (first run): {lossless['wall_s']:.2f} s wall, {lossless['decode_s']:.2f} s decoding, "
          f"{lossless['tokens']} tokens, {lossless['forwards']} forwards; CER to the labels "
          f"{record['cer_to_labels']['lossless']}")
    print(f"{'threshold':>9} {'fast s':>8} {'x wall':>7} {'x fwd':>6} {'relaxed':>7} {'ned mean':>9} {'ned max':>8} "
          f"{'>0.05':>5} {'CER':>7} {'rerun s':>8} {'share':>6} {'x fwd':>6} {'equal':>6}")
    for r in passes:
        print(f"{r['fast_threshold']:>9g} {r['fast']['wall_s']:>8.2f} {r['speedup_fast_vs_lossless']:>7} "
              f"{r['forwards_ratio_fast']:>6} {r['fast']['relaxed_tokens']:>7} {r['fast_edit_distance_mean']:>9} "
              f"{r['fast_edit_distance_max']:>8} {r['fast_pages_over_0.05']:>5} {r['fast_cer_to_labels']:>7} "
              f"{r['rerun']['wall_s']:>8.2f} {r['rerun_share_of_lossless']:>6} {r['forwards_share_rerun']:>6} "
              f"{r['rerun_pages_equal']:>3}/{len(keys)}")
    line = json.dumps(record)
    if args.json:
        Path(args.json).write_text(line + "\n", encoding="utf-8")
    print(line)
    for db in dbs:
        db.dispose()
    if tmp is not None:
        tmp.cleanup()
    return record


if __name__ == "__main__":
    main()
