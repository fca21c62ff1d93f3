"""CPU benchmark of the decode paths, side by side on the same pages, in one run.

Pages: a synthetic PDF (pymupdf, with a text layer) rendered by `ingest.pages.render.render_pages`; one chunk of
``--pages`` pages (1 page: single prompt, else multi). With ``--synth N``: N held-out documents of the demo
model's generator (ingest/synth, seeds 860,000+, never trained on), each a PDF with a text layer decoded as
``--pages``-page chunks; figures are summed over the N (the demo model's CPU benchmark: ``--synth 20``).
Runs, each checked token for token against official:
- official         transformers generate() (engine.official)
- plain            engine.batch.engine at batch 1, no drafts (one token per forward)
- lossless         reference drafter fed the PDF text layer, plus the markup and ngram drafters (the default set)
- lossless-replay  replay drafter fed the official output ids (a re-run of the same pages)
- always-wrong     replay drafter fed the official ids shifted by one (every draft token rejected)
- lossless+block   the default set plus the model folder's block drafter (`<model>/drafter`) asked beside them,
                   fed the same text layer (uflash by default leaves the block drafter out of chunks whose every
                   page has a text layer, i.e. runs the `lossless` row here: this row says why)
- block            the block drafter alone: the same pages as if scanned (no text layer to copy)
The last two run only when the model folder has a drafter (``--no-block`` leaves them out).
Wall time of each run includes the processor, the vision encoder and the prefill (best of ``--repeat``).

Prints a table, then one JSON line. Usage:
    python -m scripts.bench.cpu --model models/demo --pages 2 --max-new-tokens 512 --json bench.json
    python -m scripts.bench.cpu --tiny --pages 3 --max-new-tokens 400
    python -m scripts.bench.cpu --model models/demo --synth 20 --max-new-tokens 1500 --json bench.json
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import pymupdf
import torch
from tqdm import tqdm

from ingest.errors import ExitCode
from scripts.bench.record import finish

WORDS = ("archive register record volume folio entry parish county deed survey estate witness clerk index "
         "census ledger account total balance payment year month date name place office number page").split()


def synthetic_pdf(path: Path, n_pages: int, seed: int = 0) -> Path:
    """An A4 PDF with a title, paragraphs and a small table per page, all in the text layer."""
    rng = random.Random(seed)
    doc = pymupdf.open()
    for p in range(n_pages):
        page = doc.new_page(width=595, height=842)
        lines = [f"Register of records, part {p + 1}"]
        lines += [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 12))).capitalize() + "."
                  for _ in range(14)]
        lines += ["No.  Name        Year   Amount"]
        lines += [f"{i + 1:<4} {rng.choice(WORDS):<11} {rng.randint(1850, 1950)}   "
                  f"{rng.randint(1, 999)}.{rng.randint(0, 99):02d}" for i in range(8)]
        for i, line in enumerate(lines):
            page.insert_text((56, 72 + 26 * i), line, fontsize=14 if i == 0 else 11, fontname="helv")
    doc.save(path)
    doc.close()
    return path


def first_difference(ids: list[int], reference: list[int]) -> int:
    """Tokens equal before the first difference (len when identical)."""
    return next((i for i, (a, b) in enumerate(zip(ids, reference)) if a != b), min(len(ids), len(reference)))


def best_of(repeat: int, run):
    """(result, seconds) of the fastest of ``repeat`` calls of ``run()`` (the CPU is shared and noisy)."""
    timed = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = run()
        timed.append((time.perf_counter() - start, result))
    seconds, result = min(timed, key=lambda pair: pair[0])
    return result, seconds


SYNTH_SEED0 = 860_000  # held out (< ingest.synth.documents.HELD_OUT_LIMIT); eval uses 800,000+, the drafter 850,000+


def synth_jobs(n_docs: int, n_pages: int, tmp: Path) -> list[tuple[list, list[str]]]:
    """(images, text layers) of ``n_docs`` held-out demo-generator documents of ``n_pages`` pages each."""
    from ingest.pages.render import render_pages
    from ingest.synth.documents import make_document

    jobs = []
    for k in range(n_docs):
        pdf = tmp / f"synth{k}.pdf"
        pdf.write_bytes(make_document(SYNTH_SEED0 + k, n_pages)[0])
        rendered = render_pages(pdf, "pdf", 1, n_pages)
        jobs.append(([page.image for page in rendered], [page.text_layer or "" for page in rendered]))
    return jobs


def run_benchmark(model_path: str, n_pages: int, max_new_tokens: int, device: str, dtype: str, k_max: int,
                  repeat: int = 1, synth: int = 0, block: bool = True) -> dict:
    from engine.batch.engine import BatchEngine
    from engine.loading import default_kernels, load_block_drafter
    from engine.model.load import load_model
    from engine.official import official_generate
    from ingest.pages.render import render_pages

    loaded = load_model(model_path, device, dtype)
    block_net = load_block_drafter(loaded) if block else None  # as uflash: the model folder's drafter
    vocab = loaded.model.config.text_config.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        if synth:
            jobs = synth_jobs(synth, n_pages, Path(tmp))
        else:
            rendered = render_pages(synthetic_pdf(Path(tmp) / "bench.pdf", n_pages), "pdf", 1, n_pages)
            jobs = [([page.image for page in rendered], [page.text_layer or "" for page in rendered])]
    kind = "single" if n_pages == 1 else "multi"

    def engine(mode: str, drafters: tuple[str, ...] = ()):
        return BatchEngine(loaded, mode, k_max=k_max, drafters=drafters, kernels=default_kernels(loaded),
                           block_net=block_net if "block" in drafters else None, block_beside_copies=True)

    def decode(eng, images, **hints):
        return eng.run([eng.prepare(images, max_new_tokens, **hints)])[0]  # the processor is timed too

    images = jobs[0][0]
    official_generate(loaded, images, kind, 8)  # warm-up of both paths (allocator, thread pools, kernels)
    warm = engine("lossless", ("replay",))
    warm.run([warm.prepare(images, 32, replay_ids=[0] * 32)])
    engines = {}
    names = ("official", "plain", "lossless", "lossless-replay", "always-wrong")
    names += ("lossless+block", "block") if block_net is not None else ()
    totals = {name: {"tokens": 0, "seconds": 0.0, "forwards": 0, "verify_rounds": 0, "accepted_tokens": 0,
                     "exact_jobs": 0, "match_prefix": 0, "time_split": {}, "drafters": {}} for name in names}
    prompt_tokens = 0
    for images, texts in tqdm(jobs, desc="documents", unit="doc", disable=len(jobs) == 1):
        official, official_seconds = best_of(repeat, partial(official_generate, loaded, images, kind,
                                                             max_new_tokens))
        reference = official.output_ids
        prompt_tokens += len(official.prompt_ids)
        _add(totals["official"], len(reference), official_seconds, len(reference), {}, True, len(reference))
        runs = {
            "plain": ("plain", (), {}),
            "lossless": ("lossless", ("reference", "markup", "ngram"), {"reference_texts": texts}),
            "lossless-replay": ("lossless", ("replay",), {"replay_ids": reference}),
            "always-wrong": ("lossless", ("replay",), {"replay_ids": [(t + 1) % vocab for t in reference]}),
        }
        if block_net is not None:
            runs["lossless+block"] = ("lossless", ("reference", "markup", "ngram", "block"), {"reference_texts": texts})
            runs["block"] = ("lossless", ("block",), {})
        for name, (mode, drafters, hints) in runs.items():
            eng = engines.setdefault(name, engine(mode, drafters))  # one engine a run, as one worker keeps one
            res, seconds = best_of(repeat, partial(decode, eng, images, **hints))
            _add(totals[name], len(res.output_ids), seconds, res.stats["forwards"], res.stats,
                 res.output_ids == reference, first_difference(res.output_ids, reference))
    official_seconds = totals["official"]["seconds"]
    results = {}
    for name, t in totals.items():
        results[name] = {
            "tokens": t["tokens"], "seconds": round(t["seconds"], 4), "forwards": t["forwards"],
            "tau": round(t["accepted_tokens"] / t["verify_rounds"], 4) if t["verify_rounds"] else 0.0,
            "exact": t["exact_jobs"] == len(jobs), "exact_jobs": t["exact_jobs"], "match_prefix": t["match_prefix"],
            "tokens_per_s": round(t["tokens"] / t["seconds"], 2),
            "ms_per_forward": round(1000 * t["seconds"] / t["forwards"], 3),
            "speedup": round(official_seconds / t["seconds"], 3)}
        if name != "official":
            results[name].update(time_split={k: round(v, 4) for k, v in t["time_split"].items()},
                                 drafters=t["drafters"])
    return {"model": loaded.name, "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch."),
            "pages": n_pages, "documents": len(jobs), "source": "synth" if synth else "register",
            "prompt_tokens": prompt_tokens, "max_new_tokens": max_new_tokens,
            "k_max": k_max, "sliding_window": loaded.sliding_window, "threads": torch.get_num_threads(),
            "repeat": repeat, "results": results}


def _add(total: dict, tokens: int, seconds: float, forwards: int, stats: dict, exact: bool, match_prefix: int) -> None:
    """Add one document's run to the run's totals (time split and per-drafter counts summed)."""
    total["tokens"] += tokens
    total["seconds"] += seconds
    total["forwards"] += forwards
    total["verify_rounds"] += stats.get("verify_rounds", 0)
    total["accepted_tokens"] += stats.get("accepted_tokens", 0)
    total["exact_jobs"] += int(exact)
    total["match_prefix"] += match_prefix
    for key in ("prefill_s", "draft_s", "verify_s", "single_s"):
        if key in stats:
            total["time_split"][key] = total["time_split"].get(key, 0.0) + stats[key]
    for drafter, counts in stats.get("drafters", {}).items():
        mine = total["drafters"].setdefault(drafter, {})
        for key, value in counts.items():
            if isinstance(value, (int, float)) and key != "acceptance":
                mine[key] = mine.get(key, 0) + value
        mine["acceptance"] = round(mine.get("accepted", 0) / mine["proposed"], 4) if mine.get("proposed") else 0.0


def print_table(report: dict) -> None:
    print(f"{report['model']} on {report['device']} ({report['dtype']}, {report['threads']} threads): "
          f"{report['documents']} {report['source']} document(s) of {report['pages']} page(s), "
          f"prompt {report['prompt_tokens']} tokens, window {report['sliding_window']}, "
          f"k_max {report['k_max']}")
    header = (f"{'run':<16}{'tokens':>7}{'seconds':>9}{'tok/s':>9}{'ms/fwd':>9}{'forwards':>9}{'tau':>7}"
              f"{'speedup':>9}  exact")
    print(header)
    print("-" * len(header))
    for name, r in report["results"].items():
        exact = "yes" if r["exact"] else f"NO ({r['exact_jobs']}/{report['documents']} docs; {r['match_prefix']} equal)"
        print(f"{name:<16}{r['tokens']:>7}{r['seconds']:>9.2f}{r['tokens_per_s']:>9.1f}{r['ms_per_forward']:>9.2f}"
              f"{r['forwards']:>9}{r['tau']:>7.2f}{r['speedup']:>8.2f}x  {exact}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="model folder (or cached hub id)")
    source.add_argument("--tiny", action="store_true", help="build a tiny random model on the fly (window 128)")
    parser.add_argument("--pages", type=int, default=1)
    parser.add_argument("--synth", type=int, default=0,
                        help="N held-out demo-generator documents (with text layers) instead of the register page")
    parser.add_argument("--max-new-tokens", type=int, default=400)
    parser.add_argument("--k-max", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeat", type=int, default=1, help="time each run this many times, keep the fastest")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--no-block", action="store_true", help="leave out the runs with the model's block drafter")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model
        if args.tiny:
            from engine.model.tiny import build_tiny_model

            model_path = str(build_tiny_model(Path(tmp) / "tiny", sliding_window=128))
        report = run_benchmark(model_path, args.pages, args.max_new_tokens, args.device, args.dtype, args.k_max,
                               args.repeat, args.synth, block=not args.no_block)
    print_table(report)
    finish(report, args.json)
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
