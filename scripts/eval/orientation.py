"""How well uflash turns scans that came sideways or upside down (ingest/pages/orientation.py): held-out synthetic scan
pages upright, turned a quarter each way and upside down, each through `choose_turn` with the model's probes as the
worker makes them. Prints a table (per way the page came: looked at, turned right, turned wrong, left) and ends
with one JSON line.

    python -m scripts.eval.orientation --model models/demo --pages 24 [--samples ../shared/samples/real]

--samples: also the stripe ratio and ragged edges of every page of the real sample files (no model): which ones
would be probed. The record also has the stripe ratios of 15 born-digital list pages (2-14 words a line, 8-34
lines, made with pymupdf: a register or an index) upright and turned a quarter (no model).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from engine.loading import load_decoder
from ingest.config import OrientationSettings
from ingest.errors import ExitCode
from ingest.pages.orientation import (
    choose_turn,
    decoder_probe,
    ragged_edges,
    stripe_ratio,
    turn,
)

SEED0 = 890_000  # held out: the demo model and its drafter trained on seeds >= 1,000,000


def sample_ratios(folder: Path) -> list[dict]:
    import pymupdf

    from ingest.pages.render import render_pages

    rows = []
    for f in sorted(folder.iterdir()):
        kind = {".pdf": "pdf", ".png": "png", ".tif": "tiff", ".tiff": "tiff", ".jpg": "jpeg"}.get(f.suffix.lower())
        if kind is None:
            continue
        try:
            n = pymupdf.open(f).page_count if kind == "pdf" else 1
            pages = render_pages(f, kind, 1, n)
        except Exception as e:  # noqa: BLE001 - broken samples are the point of the folder
            rows.append({"file": f.name, "error": f"{type(e).__name__}"})
            continue
        for p in pages:
            r, e = stripe_ratio(p.image), ragged_edges(p.image)
            rows.append({"file": f.name, "page": p.index, "ratio": None if r is None else round(r, 3),
                         "edges": None if e is None else round(e, 3)})
    return rows


def list_ratios() -> dict:
    """Stripe ratios of list pages (short lines down the left of the page), upright and turned a quarter."""
    import tempfile

    import pymupdf

    from ingest.pages.render import render_pages

    words = "the council met on Tuesday and agreed the budget for the year after a long debate about roads".split()
    out = {"upright": [], "quarter": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n_words in (2, 4, 7, 10, 14):
            for n_lines in (8, 20, 34):
                doc = pymupdf.open()
                page = doc.new_page(width=595, height=842)
                page.insert_textbox(pymupdf.Rect(50, 50, 545, 792), "\n".join(
                    f"{i}. " + " ".join(words[:n_words]) for i in range(n_lines)), fontsize=14)
                path = Path(tmp) / f"list_{n_words}_{n_lines}.pdf"
                doc.save(path)
                image = render_pages(path, "pdf", 1, 1)[0].image
                out["upright"].append(round(stripe_ratio(image), 3))
                out["quarter"].append(round(stripe_ratio(turn(image, 90)), 3))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/demo")
    ap.add_argument("--pages", type=int, default=24)
    ap.add_argument("--mode", default="lossless")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--probe-tokens", type=int, default=OrientationSettings().probe_tokens)
    ap.add_argument("--min-gain", type=float, default=OrientationSettings().min_gain)
    ap.add_argument("--samples", help="folder of real scans: report the stripe ratio of each page")
    ap.add_argument("--json", help="also write the record here")
    args = ap.parse_args(argv)
    from ingest.synth.documents import make_document, render_pages

    config = OrientationSettings(probe_tokens=args.probe_tokens, min_gain=args.min_gain)
    decoder = load_decoder(args.model, args.device, args.dtype, args.mode)
    probe_s = []
    read = decoder_probe(decoder, 32_768, config.probe_tokens)

    def probe(image) -> float:
        t0 = time.perf_counter()
        score = read(image)
        probe_s.append(time.perf_counter() - t0)
        return score

    # the page comes in turned `came` clockwise; the right answer turns it back
    ways = {0: 0, 90: 270, 180: 180, 270: 90}  # came -> the turn that makes it upright
    table = {came: {"pages": 0, "probed": 0, "right": 0, "wrong": 0, "left": 0, "ratios": [], "edges": []}
             for came in ways}
    t0 = time.time()
    for i in range(args.pages):
        data, _ = make_document(SEED0 + i, 1, scan=True)
        upright = render_pages(data, 1024)[0]
        for came, want in ways.items():
            choice = choose_turn(turn(upright, came), probe, config)
            row = table[came]
            row["pages"] += 1
            row["probed"] += choice.scores is not None
            row["ratios"].append(choice.ratio)
            row["edges"].append(ragged_edges(turn(upright, came)))
            if choice.turn == 0:
                row["left"] += 1
            elif choice.turn == want:
                row["right"] += 1
            else:
                row["wrong"] += 1
        print(f"page {i + 1}/{args.pages} done ({time.time() - t0:.0f} s)", flush=True)
    print(f"\n{'came turned':>11} {'pages':>6} {'probed':>7} {'turned right':>13} {'turned wrong':>13} {'left':>5} "
          f"{'stripe ratio (min-max)':>23} {'ragged edges (min-max; none)':>29}")
    for came, row in table.items():
        ratios = [r for r in row.pop("ratios") if r is not None]
        row["ratio_min"], row["ratio_max"] = round(min(ratios), 3), round(max(ratios), 3)
        edges = row.pop("edges")
        known = [e for e in edges if e is not None]
        row["edges_min"], row["edges_max"] = round(min(known), 3), round(max(known), 3)
        row["edges_none"] = len(edges) - len(known)  # too few lines to measure
        print(f"{came:>11} {row['pages']:>6} {row['probed']:>7} {row['right']:>13} {row['wrong']:>13} "
              f"{row['left']:>5} {row['ratio_min']:>11.2f} - {row['ratio_max']:.2f} "
              f"{row['edges_min']:>13.2f} - {row['edges_max']:.2f}; {row['edges_none']}")
    record = {"model": args.model, "mode": args.mode, "pages": args.pages, "seeds": f"{SEED0}..",
              "probe_tokens": config.probe_tokens, "min_gain": config.min_gain, "min_logprob": config.min_logprob,
              "sideways_below": config.sideways_below, "upside_down_below": config.upside_down_below,
              "by_way_it_came": {str(k): v for k, v in table.items()}, "probes": len(probe_s),
              "probe_s_mean": round(statistics.fmean(probe_s), 3) if probe_s else None,
              "seconds": round(time.time() - t0, 1)}
    record["lists"] = list_ratios()
    print(f"\nlist pages: stripe ratio upright {min(record['lists']['upright'])} - {max(record['lists']['upright'])}, "
          f"turned a quarter {min(record['lists']['quarter'])} - {max(record['lists']['quarter'])}")
    if args.samples:
        record["samples"] = sample_ratios(Path(args.samples))
        sideways = [r for r in record["samples"] if r.get("ratio") is not None and r["ratio"] < config.sideways_below]
        upside_down = [r for r in record["samples"] if r not in sideways and r.get("ratio") is not None
                       and r.get("edges") is not None and r["edges"] < config.upside_down_below]
        print(f"\nreal samples: {len(record['samples'])} pages, looked at as sideways: "
              f"{[(r['file'], r['page'], r['ratio']) for r in sideways]}, as upside down: "
              f"{[(r['file'], r['page'], r['edges']) for r in upside_down]}")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    print(json.dumps(record))
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
