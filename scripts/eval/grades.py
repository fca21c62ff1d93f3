"""The page grades against the truth on the difficulty ladder of labelled documents (ingest/synth/ladder.py), in
more detail than `uflash calibrate` gives (which runs the same decode and fit, ingest/calibration/): per ladder axis,
the print measured against the truth, and a model graded with another model's calibration.

    # 1. decode the ladder as the pipeline does (one document = one chunk of 1-4 pages, the batched engine, `plain`
    #    mode: the lossless mode's tokens), and read alone the pages the repair checks catch; JSON lines appended as
    #    each item ends, so a stop loses only what is in flight and a restart goes on (ingest/calibration/decode.py)
    python -m scripts.eval.grades decode --dir var/ladder --docs 360 --device cuda --max-batch 128 --budget-s 330
    # 2. the table, from the folder's files alone (a CPU): graded with the model's calibration (or --calibration
    #    FILE: another model's; --fit: thresholds chosen on the labelled half), per half
    python -m scripts.eval.grades table --dir var/ladder --fit
    python -m scripts.eval.grades table --dir var/ladder --json docs/results/grades_ladder_demo.json
    # a model's calibration.json from such a record (how the demo model's was made)
    python -m scripts.eval.grades adopt --json docs/results/grades_ladder_demo.json --model models/demo

Seeds start at 600,000 (below ingest.synth.documents.HELD_OUT_LIMIT: never used in training). CER: Levenshtein
distance of the page's plain text (markup, boxes and table tags removed, white space collapsed) to the label's, over
the label's length.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ingest.calibration.decode import SEED0, TOKENS_PER_PAGE, decode_ladder, read_lines
from ingest.calibration.fit import fit, graded_pages, regrade, summary
from ingest.errors import ExitCode

ROOT = Path(__file__).resolve().parents[2]


def decode(args) -> None:
    batch = int(args.max_batch) if str(args.max_batch).isdigit() else args.max_batch
    decode_ladder(Path(args.dir), args.model, args.docs, args.seed0, args.device, args.dtype, args.mode, batch,
                  args.procs, args.budget_s, args.tokens_per_page, args.context_limit)


def _docs(path: Path) -> list[dict]:
    docs = {d["seed"]: d for d in read_lines(path) if "seed" in d}
    return [docs[k] for k in sorted(docs)]


def table(args) -> None:
    from dataclasses import asdict, replace

    from engine.model.load import load_model
    from ingest.config import Thresholds, load_settings
    from ingest.quality.calibration import FITTED, grading_thresholds

    settings = load_settings(args.config or ROOT / "config.toml")
    if args.calibration:  # another model's calibration (its thresholds), the config's own settings above them
        chosen = json.loads(Path(args.calibration).read_text(encoding="utf-8"))["thresholds"]
        t = replace(grading_thresholds(settings, args.model).thresholds, **{k: chosen[k] for k in FITTED})
        source = f"of {args.calibration}"
    else:
        grading = grading_thresholds(settings, args.model)
        t = grading.thresholds
        source = "of the model's calibration" if grading.calibrated else "conservative (the model is not calibrated)"
    assert isinstance(t, Thresholds)
    tokenizer = load_model(args.model, "cpu", "auto").tokenizer
    folder = Path(args.dir)
    docs = _docs(folder / "decoded.jsonl")
    if not docs:
        raise SystemExit(f"no decoded documents in {folder / 'decoded.jsonl'}: run the decode command first")
    alone = {r["key"]: r for r in read_lines(folder / "repaired.jsonl") if "key" in r}
    runs = read_lines(folder / "runs.jsonl")
    rows = graded_pages(docs, alone, t, tokenizer)
    if args.fit:
        t = fit([r for r in rows if r["half"] == "labelled"], t)
        rows = regrade(rows, t)
        source = "chosen on the labelled half"
        print("thresholds chosen on the labelled half:", json.dumps({k: getattr(t, k) for k in FITTED}))
    halves = {h: summary([r for r in rows if r["half"] == h]) for h in ("labelled", "held_out")}
    kept = [r["repair"].get("kept") for r in rows if r.get("repair")]
    record = {"command": " ".join(["python -m scripts.eval.grades", *args.argv]),
              "model": args.model, "decoded_mode": docs[0].get("mode"),
              "decoded_on": runs[-1]["environment"] if runs else None,
              "documents": len(docs), "thresholds_from": source, "thresholds": asdict(t), "halves": halves,
              "repairs": {"pages": sum(k in ("alone", "chunk") for k in kept), "kept_alone": kept.count("alone"),
                          "caught_without_reading_alone": kept.count("no reading alone")},
              "by_axis": _by_axis([r for r in rows if r["half"] == "held_out"]),
              "ink_vs_truth": _ink_vs_truth(rows)}
    if args.rows:
        Path(args.rows).write_text("\n".join(json.dumps({k: v for k, v in r.items() if k != "word_confidence"})
                                             for r in rows) + "\n", encoding="utf-8")
    print(_format(record))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def _ink_vs_truth(rows: list[dict]) -> dict:
    """How well ingest.pages.ink measures the print: its characters over the truth's, percentiles over the pages with at
    least 40 characters of truth."""
    ratios = sorted(r["quality"]["ink_chars"] / r["truth_chars"] for r in rows
                    if r.get("truth_chars", 0) >= 40 and r["quality"].get("ink_chars") is not None)
    if not ratios:
        return {}
    return {"pages": len(ratios), **{f"p{int(f * 100)}": round(ratios[min(len(ratios) - 1, int(f * len(ratios)))], 3)
                                     for f in (0.05, 0.25, 0.5, 0.75, 0.95)}}


def _by_axis(rows: list[dict]) -> dict:
    """Per value of each ladder axis: pages, mean CER, share graded poor (held-out half)."""
    out = {}
    for axis in ("size", "family", "density", "scan", "pages", "tables", "open_words"):
        groups: dict = {}
        for r in rows:
            groups.setdefault(str(r["rung"][axis]), []).append(r)
        out[axis] = {k: {"pages": len(v), "cer_mean": round(sum(r["cer"] for r in v) / len(v), 4),
                         "poor": round(sum(r["grade"] == "poor" for r in v) / len(v), 3)}
                     for k, v in sorted(groups.items())}
    return out


def _format(rec: dict) -> str:
    lines = [f"{rec['documents']} documents; thresholds {rec['thresholds_from']}"]
    for h, s in rec["halves"].items():
        lines.append(f"\n{h}: {s['pages']} pages, {s['bad_pages']} with CER > 0.10; recall of poor "
                     f"{s['recall_poor']}, precision {s['precision_poor']}, good median CER {s['good_cer_median']}, "
                     f"CER > 0.10 graded good: {s['bad_graded_good']}")
        lines.append(f"  {'grade':<7}{'pages':>6}{'median':>9}{'p90':>8}{'mean':>8}{'>0.10':>8}")
        for g, v in s["grades"].items():
            lines.append(f"  {g:<7}{v['pages']:>6}{v['cer_median']:>9}{v['cer_p90']:>8}{v['cer_mean']:>8}"
                         f"{v['share_cer_over_0.1']:>8}")
    lines.append(f"\nrepairs: {rec['repairs']}; print measured / truth characters: {rec['ink_vs_truth']}")
    return "\n".join(lines)


def adopt(args) -> None:
    """A calibration file for ``--model`` from a table record of its ladder (``table --json``): the record's thresholds
    and figures, for a model calibrated with these commands before `uflash calibrate` existed."""
    from datetime import datetime, timezone

    from ingest.config import load_settings
    from ingest.quality.calibration import FITTED, model_identity, write_calibration

    rec = json.loads(Path(args.json).read_text(encoding="utf-8"))
    halves = rec["halves"]
    record = {"identity": model_identity(args.model), "model": Path(args.model).name,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "thresholds": {k: rec["thresholds"][k] for k in FITTED},
              "held_out": halves["held_out"], "labelled": halves["labelled"], "documents": rec["documents"],
              "pages": halves["held_out"]["pages"] + halves["labelled"]["pages"], "complete": True,
              "decoded": {**(rec.get("decoded_on") or {}), "mode": rec.get("decoded_mode")},
              "how": f"python -m scripts.eval.grades {' '.join(args.argv)} (from {args.json}: {rec['command']})"}
    print(write_calibration(load_settings(ROOT / "config.toml"), args.model, record))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("decode", help="decode the ladder and read the caught pages alone (JSON lines, resumable)")
    d.add_argument("--dir", default=str(ROOT / "var" / "ladder"), help="folder of decoded.jsonl, repaired.jsonl, "
                   "runs.jsonl (created; a restart goes on where the last one stopped)")
    d.add_argument("--model", default=str(ROOT / "models" / "demo"))
    d.add_argument("--device", default="auto", help="auto, cpu or cuda")
    d.add_argument("--dtype", default="auto", help="auto (bf16 on a GPU, fp32 on a CPU, as the pipeline), fp32, ...")
    d.add_argument("--mode", default="plain", help="plain (the fastest; the lossless mode's tokens), lossless or fast")
    d.add_argument("--docs", type=int, default=340, help="documents (seeds from --seed0; odd ones are held out)")
    d.add_argument("--seed0", type=int, default=SEED0)
    d.add_argument("--max-batch", default="64", help="chunks in flight at once, or auto (as many as memory holds)")
    d.add_argument("--procs", type=int, default=0, help="processes that render the documents (0: CPUs - 1, up "
                   "to 15)")
    d.add_argument("--budget-s", type=float, default=0.0, help="stop this many seconds after the start, keeping "
                   "what is done (0: no limit)")
    d.add_argument("--tokens-per-page", type=int, default=TOKENS_PER_PAGE)
    d.add_argument("--context-limit", type=int, default=32768)
    tb = sub.add_parser("table", help="figures, repairs and grades against the truth, per half (CPU)")
    tb.add_argument("--dir", default=str(ROOT / "var" / "ladder"), help="the decode command's folder")
    tb.add_argument("--model", default=str(ROOT / "models" / "demo"), help="its tokenizer")
    tb.add_argument("--config", help="the config whose [quality] thresholds set by the user grade above the model's "
                    "calibration (default: the repo's config.toml)")
    tb.add_argument("--calibration", help="grade with this calibration file's thresholds (another model's) instead "
                    "of the model's own")
    tb.add_argument("--json", help="write the record here")
    tb.add_argument("--rows", help="write every page's grade, figures and CER here (JSON lines)")
    tb.add_argument("--fit", action="store_true", help="choose the grading thresholds on the labelled half first")
    ad = sub.add_parser("adopt", help="write a model's calibration.json from a table record of its ladder")
    ad.add_argument("--json", required=True, help="the record (table --json)")
    ad.add_argument("--model", default=str(ROOT / "models" / "demo"))
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    {"decode": decode, "table": table, "adopt": adopt}[args.cmd](args)
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
