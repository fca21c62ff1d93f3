#!/usr/bin/env python3
"""Calibrate the page grades against the truth on a difficulty ladder of labelled documents (scripts/synth/ladder.py).

    # 1. decode the ladder as the pipeline does (one document = one chunk of 1-4 pages, the batched engine; plain
    #    mode gives the lossless mode's tokens), one JSON line per document, appended as each ends: a crash loses
    #    nothing, a restart goes on
    python scripts/calibrate_grades.py decode --docs 260 --out var/ladder/decoded.jsonl
    # 2. the pipeline's repair on those chunks: a page caught by the checks is decoded again alone
    python scripts/calibrate_grades.py repair --decoded var/ladder/decoded.jsonl --out var/ladder/repaired.jsonl
    # 3. figures, grades and the table: rules chosen on the labelled half (even documents), reported on the held-out
    #    half (odd documents)
    python scripts/calibrate_grades.py table --decoded var/ladder/decoded.jsonl --repaired var/ladder/repaired.jsonl \
        --json docs/results/grades.json

Seeds start at 600,000 (below scripts.synth.HELD_OUT_LIMIT: never used in training). CER: Levenshtein distance of
the page's plain text (markup, boxes and table tags removed, white space collapsed) to the label's, over the label's
length.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.synth import HELD_OUT_LIMIT  # noqa: E402

SEED0 = 600_000
TOKENS_PER_PAGE = 2500  # the demo model writes ~1 token per character; the ladder's densest page has ~1,400


def _done_seeds(path: Path) -> set[int]:
    if not path.exists():
        return set()
    out = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.add(json.loads(line)["seed"])
        except (ValueError, KeyError):
            pass  # a line cut by a crash: that document is decoded again
    return out


def _page_record(po) -> dict:
    return {"text": po.text, "ids": po.ids, "logprobs": [round(x, 5) for x in po.logprobs],
            "stats": {k: po.stats.get(k) for k in ("finish_reason", "tokens", "seconds", "tau", "note")}}


def _new_chunks(first: int, last: int, kept: int, finish: str) -> list[tuple[int, int]]:
    """The chunks the worker queues after a chunk that kept ``kept`` of its pages (ingest/worker.py's rule)."""
    first_left = first + kept
    if finish in ("context_limit", "length") and first_left < last:
        return [(first_left, first_left), (first_left + 1, last)]
    if kept == 0:
        mid = first + (last - first + 1) // 2 - 1
        return [(first, mid), (mid + 1, last)]
    return [(first_left, last)]


def decode(args) -> None:
    from engine.chunk_decode import load_decoder
    from ingest.render import render_pages
    from scripts.synth.ladder import ladder_document

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = _done_seeds(out_path)
    seeds = [s for s in range(args.seed0, args.seed0 + args.docs) if s not in done]
    if seeds and seeds[-1] >= HELD_OUT_LIMIT:
        raise SystemExit("ladder seeds must stay below the held-out limit")
    decoder = load_decoder(args.model, "cpu" if args.device == "cpu" else args.device, "auto", mode=args.mode,
                           max_batch=args.max_batch, max_pages_per_chunk=4)
    work = Path(tempfile.mkdtemp(prefix="ladder-"))
    docs: dict[int, dict] = {}
    images: dict[int, list] = {}
    waiting: deque[tuple[int, int, int]] = deque()  # (seed, first, last) chunks to submit
    todo = deque(seeds)
    t0, pages_done = time.time(), 0

    def open_doc() -> None:
        seed = todo.popleft()
        pdf, labels, rung = ladder_document(seed)
        path = work / f"{seed}.pdf"
        path.write_bytes(pdf)
        rendered = render_pages(path, "pdf", 1, rung.pages)
        path.unlink()
        images[seed] = [p.image for p in rendered]
        docs[seed] = {"seed": seed, "half": "held_out" if (seed - args.seed0) % 2 else "labelled", "mode": args.mode,
                      "rung": rung.dict(), "labels": labels, "text_layer": [p.text_layer for p in rendered],
                      "image_size": [list(p.image.size) for p in rendered], "chunks": [], "open": 1}
        waiting.append((seed, 1, rung.pages))

    with out_path.open("a", encoding="utf-8") as sink:
        while todo or waiting or decoder.busy:
            while todo and len(waiting) + decoder.engine.active + len(decoder.engine.pending) < args.max_batch:
                open_doc()
            while waiting and decoder.free_rows > 0:
                seed, a, b = waiting.popleft()
                early = decoder.submit((seed, a, b), images[seed][a - 1 : b], args.context_limit,
                                       args.tokens_per_page * (b - a + 1))
                if early is not None:
                    raise RuntimeError(f"seed {seed}: {early.note}")
            for (seed, a, b), out in decoder.poll():
                if isinstance(out, BaseException):
                    raise out
                doc = docs[seed]
                kept = len(out.pages)
                doc["chunks"].append({"first": a, "last": b, "finish_reason": out.finish_reason, "note": out.note,
                                      "requeue": out.requeue, "seconds": out.chunk_stats.get("seconds"),
                                      "pages": [_page_record(p) for p in out.pages]})
                doc["open"] -= 1
                if out.requeue:
                    for na, nb in _new_chunks(a, b, kept, out.finish_reason):
                        waiting.append((seed, na, nb))
                        doc["open"] += 1
                if doc["open"] == 0:
                    del doc["open"]
                    sink.write(json.dumps(doc, ensure_ascii=False) + "\n")
                    sink.flush()
                    pages_done += doc["rung"]["pages"]
                    del docs[seed], images[seed]
                    print(f"seed {seed}: {doc['rung']['pages']} pages, {pages_done} pages in "
                          f"{time.time() - t0:.0f} s", flush=True)


# -- repair and table ------------------------------------------------------------------------------------------

def _docs(path: Path) -> list[dict]:
    docs = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        docs[d["seed"]] = d
    return [docs[k] for k in sorted(docs)]


def _images(doc: dict) -> list:
    from ingest.render import render_pages
    from scripts.synth.ladder import ladder_document

    pdf, _, rung = ladder_document(doc["seed"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "doc.pdf"
        path.write_bytes(pdf)
        return [p.image for p in render_pages(path, "pdf", 1, rung.pages)]


def _outputs(doc: dict):
    """The document's chunks as engine.chunk_decode.ChunkOutput objects (first page, output)."""
    from engine.chunk_decode import ChunkOutput, PageOutput

    for ch in doc["chunks"]:
        pages = [PageOutput(text=p["text"], boxes=[], stats={k: v for k, v in p["stats"].items() if v is not None},
                            ids=p["ids"], logprobs=p["logprobs"]) for p in ch["pages"]]
        yield ch["first"], ChunkOutput(pages=pages, n_input_pages=ch["last"] - ch["first"] + 1,
                                       finish_reason=ch["finish_reason"], requeue=ch["requeue"], note=ch["note"])


def _alone_key(seed: int, page: int) -> str:
    return f"{seed}:{page}"


def graded_pages(docs: list[dict], alone: dict[str, dict], t, tokenizer, repair: bool = True,
                 figures_cache: dict | None = None) -> list[dict]:
    """Every page of the ladder as the pipeline grades it: its figures (ingest.repair.chunk_page_stats), the repair
    of caught pages with their single-page readings (``alone``; a page without one is left as it was), the
    document's grade (ingest.grading.grade_document); with its CER to the truth."""
    from engine.chunk_decode import PageOutput
    from ingest.grading import grade_document, plain_text
    from ingest.quality import edit_distance
    from ingest.repair import chunk_page_stats, repair_chunk
    from scripts.synth import strip_markup

    rows = []
    for doc in docs:
        images = _images(doc)
        layers = [None] * len(images)  # graded without the text layer (a grade never depends on it)
        pages: dict[int, tuple] = {}
        for first, out in _outputs(doc):
            imgs = images[first - 1 : first - 1 + out.n_input_pages]
            stats = chunk_page_stats(out, imgs, layers, tokenizer, t, first)

            def decode_alone(i: int, first=first, out=out):
                from engine.chunk_decode import ChunkOutput

                rec = alone.get(_alone_key(doc["seed"], first + i))
                if rec is None:
                    return ChunkOutput(pages=[], n_input_pages=1, finish_reason="eos")
                po = PageOutput(text=rec["text"], boxes=[], stats=rec["stats"], ids=rec["ids"],
                                logprobs=rec["logprobs"])
                return ChunkOutput(pages=[po], n_input_pages=1, finish_reason=rec["stats"]["finish_reason"])

            if repair:
                repair_chunk(out, stats, imgs, layers, decode_alone, tokenizer, t, first)
            for i, (po, st) in enumerate(zip(out.pages, stats)):
                pages[first + i] = (po, st, first)
        order = sorted(pages)
        graded = grade_document([{**pages[k][1]["quality"], "plain": plain_text(pages[k][0].text),
                                  "chunk_id": pages[k][2]} for k in order], t)
        for k, q in zip(order, graded):
            po, st, _ = pages[k]
            truth = strip_markup(doc["labels"][k - 1])
            read = strip_markup(po.text)
            rows.append({"seed": doc["seed"], "page": k, "half": doc["half"], "rung": doc["rung"],
                         "cer": round(edit_distance(read, truth) / max(1, len(truth)), 4), "truth_chars": len(truth),
                         "grade": q["grade"], "reasons": q["reasons"], "quality": q,
                         "word_confidence": st.get("word_confidence"),
                         "repair": {k2: v for k2, v in (st.get("repair") or {}).items() if k2 in ("checks", "kept")}})
        missing = [k for k in range(1, doc["rung"]["pages"] + 1) if k not in pages]
        for k in missing:  # a page no chunk returned (cannot happen with the worker's rules; counted if it does)
            rows.append({"seed": doc["seed"], "page": k, "half": doc["half"], "rung": doc["rung"], "cer": 1.0,
                         "grade": "missing", "reasons": [], "quality": {}})
    return rows


def repair_pass(args) -> None:
    """Decode alone the pages of multi-page chunks that the checks catch (what ingest.repair does in the worker)."""
    from engine.chunk_decode import load_decoder
    from engine.model import load_model
    from ingest.grading import checks
    from ingest.quality import Thresholds
    from ingest.repair import chunk_page_stats

    t = Thresholds()
    out_path = Path(args.out)
    done = set()
    if out_path.exists():
        for line in out_path.read_text(encoding="utf-8").splitlines():
            try:
                done.add(json.loads(line)["key"])
            except (ValueError, KeyError):
                pass
    tokenizer = load_model(args.model, "cpu", "auto").tokenizer
    todo = []
    for doc in _docs(Path(args.decoded)):
        images = None
        for first, out in _outputs(doc):
            if out.n_input_pages < 2:
                continue
            images = images or _images(doc)
            imgs = images[first - 1 : first - 1 + out.n_input_pages]
            stats = chunk_page_stats(out, imgs, [None] * len(imgs), tokenizer, t, first)
            for i, st in enumerate(stats):
                key = _alone_key(doc["seed"], first + i)
                if checks(st["quality"], t) and key not in done:
                    todo.append((key, imgs[i]))
    print(f"{len(todo)} pages to decode alone", flush=True)
    decoder = load_decoder(args.model, args.device, "auto", mode=args.mode, max_batch=args.max_batch,
                           max_pages_per_chunk=1)
    queue = deque(todo)
    with out_path.open("a", encoding="utf-8") as sink:
        while queue or decoder.busy:
            while queue and decoder.free_rows > 0:
                key, image = queue.popleft()
                decoder.submit(key, [image], args.context_limit, args.tokens_per_page)
            for key, res in decoder.poll():
                if isinstance(res, BaseException):
                    raise res
                po = res.pages[0]
                sink.write(json.dumps({"key": key, **_page_record(po)}, ensure_ascii=False) + "\n")
                sink.flush()
                print(f"alone {key}", flush=True)


def _summary(rows: list[dict], cut: float = 0.10) -> dict:
    import statistics

    def q(xs, f):
        xs = sorted(xs)
        return round(xs[min(len(xs) - 1, int(f * len(xs)))], 4) if xs else None

    out = {"pages": len(rows), "bad_pages": sum(r["cer"] > cut for r in rows), "grades": {}}
    for g in ("good", "fair", "poor", "missing"):
        cers = [r["cer"] for r in rows if r["grade"] == g]
        if cers:
            out["grades"][g] = {"pages": len(cers), "cer_median": q(cers, 0.5), "cer_p90": q(cers, 0.9),
                                "cer_mean": round(statistics.fmean(cers), 4),
                                f"share_cer_over_{cut}": round(sum(c > cut for c in cers) / len(cers), 4)}
    bad = [r for r in rows if r["cer"] > cut]
    poor = [r for r in rows if r["grade"] == "poor"]
    out["recall_poor"] = round(sum(r["grade"] == "poor" for r in bad) / len(bad), 4) if bad else None
    out["precision_poor"] = round(sum(r["cer"] > cut for r in poor) / len(poor), 4) if poor else None
    out["good_cer_median"] = out["grades"].get("good", {}).get("cer_median")
    out["bad_graded_good"] = sum(r["grade"] == "good" for r in bad)
    return out


def table(args) -> None:
    from dataclasses import asdict

    from engine.model import load_model
    from ingest.config import load_settings

    t = load_settings(args.config).quality.thresholds() if args.config else load_settings(ROOT / "config.toml") \
        .quality.thresholds()
    tokenizer = load_model(args.model, "cpu", "auto").tokenizer
    docs = _docs(Path(args.decoded))
    alone = {}
    if args.repaired and Path(args.repaired).exists():
        for line in Path(args.repaired).read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            alone[rec["key"]] = rec
    rows = graded_pages(docs, alone, t, tokenizer)
    if args.fit:
        from dataclasses import asdict as _asdict

        t = fit([r for r in rows if r["half"] == "labelled"], t)
        rows = _regrade(rows, t)
        print("thresholds chosen on the labelled half:", json.dumps({k: v for k, v in _asdict(t).items() if k in (
            "unsure_word_prob", "unsure_words_poor", "unsure_words_fair", "mean_logprob_poor", "mean_logprob_fair",
            "ink_short", "ink_long", "ink_short_fair", "ink_long_fair")}))
    halves = {h: _summary([r for r in rows if r["half"] == h]) for h in ("labelled", "held_out")}
    repaired = [r for r in rows if r.get("repair")]
    record = {"command": " ".join(["python", "scripts/calibrate_grades.py"] + sys.argv[1:]),
              "model": args.model, "decoded_mode": docs[0].get("mode") if docs else None,
              "documents": len(docs), "thresholds": asdict(t), "halves": halves,
              "repairs": {"pages": len(repaired), "kept_alone": sum(r["repair"].get("kept") == "alone" for r in repaired)},
              "by_axis": _by_axis([r for r in rows if r["half"] == "held_out"]),
              "ink_vs_truth": _ink_vs_truth(rows)}
    if args.rows:
        Path(args.rows).write_text("\n".join(json.dumps({k: v for k, v in r.items() if k != "word_confidence"})
                                             for r in rows) + "\n", encoding="utf-8")
    print(_format(record))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def _regrade(rows: list[dict], t) -> list[dict]:
    """The rows graded again with thresholds ``t`` (the figures that depend on them recomputed)."""
    from ingest.grading import grade

    out = []
    for r in rows:
        q = dict(r["quality"])
        conf = [c for c in (r.get("word_confidence") or []) if c is not None]
        if conf:
            q["unsure_words"] = sum(c < t.unsure_word_prob for c in conf) / len(conf)
        g, reasons = grade(q, t) if r["grade"] != "missing" else ("missing", [])
        out.append({**r, "grade": g, "reasons": reasons})
    return out


def _middle(candidates: list, score) -> object:
    """Of the candidates (Thresholds) that share the best score, the one in the middle of them: each searched field
    at the median of its tied values (a threshold in the middle of the gap between good and bad pages, not at its
    edge), when that combination scores as well; else the first tied candidate."""
    from dataclasses import fields, replace

    best = max(score(t) for t in candidates)
    tied = [t for t in candidates if score(t) == best]
    names = [f.name for f in fields(tied[0]) if len({getattr(t, f.name) for t in tied}) > 1]
    middle = replace(tied[0], **{n: sorted(getattr(t, n) for t in tied)[len(tied) // 2] for n in names})
    return middle if score(middle) == best else tied[len(tied) // 2]


def fit(rows: list[dict], base) -> tuple:
    """Thresholds chosen on ``rows`` (the labelled half): the poor rules first, the most precise set whose recall of
    pages with CER > 0.10 is >= 0.93 (a margin over the 0.9 asked), then the fair rules, the most pages left good whose
    median CER is <= 0.02 and of which at most 5% are above 0.10; ties broken by the middle of the tied thresholds."""
    import itertools
    from dataclasses import replace

    def poor_score(t):
        s = _summary(_regrade(rows, t))
        if s["recall_poor"] is None or s["recall_poor"] < 0.93:
            return (-1.0, 0.0)
        return (s["precision_poor"] or 0.0, s["recall_poor"])

    candidates = [replace(base, unsure_word_prob=wp, unsure_words_poor=up, mean_logprob_poor=lp, ink_short=ishort,
                          ink_long=ilong, unsure_words_fair=up, mean_logprob_fair=lp, ink_short_fair=ishort,
                          ink_long_fair=ilong)
                  for wp, up, lp, ishort, ilong in itertools.product(
                      (0.1, 0.2, 0.3, 0.5), (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.8),
                      (-0.05, -0.1, -0.15, -0.2, -0.3, -0.4, -0.6, -0.8, -1.0, -1.5), (0.3, 0.4, 0.5, 0.6),
                      (1.5, 2.0, 2.5, 3.0))]
    scores = {id(t): poor_score(t) for t in candidates}
    poor_t = _middle(candidates, lambda t: scores.get(id(t)) or poor_score(t))

    def fair_score(t):
        good = _summary(_regrade(rows, t))["grades"].get("good")
        if not good or good["cer_median"] > 0.02 or good["share_cer_over_0.1"] > 0.05:
            return (-1, 0.0)
        return (good["pages"], -good["share_cer_over_0.1"])

    fair = [replace(poor_t, unsure_words_fair=uf, mean_logprob_fair=lf, ink_short_fair=sf, ink_long_fair=lgf)
            for uf, lf, sf, lgf in itertools.product((0.02, 0.05, 0.08, 0.1, 0.15, 0.2, 0.3), (-0.03, -0.05, -0.08,
                                                     -0.1, -0.15, -0.2, -0.3, -0.5), (0.6, 0.7, 0.8, 0.9),
                                                     (1.2, 1.4, 1.7, 2.0))
            if uf <= poor_t.unsure_words_poor and lf >= poor_t.mean_logprob_poor and sf >= poor_t.ink_short
            and lgf <= poor_t.ink_long]
    fscores = {id(t): fair_score(t) for t in fair}
    return _middle(fair, lambda t: fscores.get(id(t)) or fair_score(t)) if fair else poor_t


def _ink_vs_truth(rows: list[dict]) -> dict:
    """How well ingest.ink measures the print: its characters over the truth's, percentiles over the pages with at
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
    lines = [f"{rec['documents']} documents; thresholds from config"]
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("decode", help="decode the ladder (JSON lines, resumable)")
    d.add_argument("--model", default=str(ROOT / "models" / "demo"))
    d.add_argument("--device", default="cpu")
    d.add_argument("--mode", default="plain", help="plain, lossless (the same tokens) or fast; plain is the fastest on "
                                                 "a CPU at batch 8")
    d.add_argument("--docs", type=int, default=260)
    d.add_argument("--seed0", type=int, default=SEED0)
    d.add_argument("--max-batch", type=int, default=8)
    d.add_argument("--tokens-per-page", type=int, default=TOKENS_PER_PAGE)
    d.add_argument("--context-limit", type=int, default=32768)
    d.add_argument("--out", default=str(ROOT / "var" / "ladder" / "decoded.jsonl"))
    r = sub.add_parser("repair", help="decode alone the pages the checks catch (JSON lines, resumable)")
    r.add_argument("--model", default=str(ROOT / "models" / "demo"))
    r.add_argument("--device", default="cpu")
    r.add_argument("--mode", default="plain")
    r.add_argument("--max-batch", type=int, default=8)
    r.add_argument("--tokens-per-page", type=int, default=TOKENS_PER_PAGE)
    r.add_argument("--context-limit", type=int, default=32768)
    r.add_argument("--decoded", default=str(ROOT / "var" / "ladder" / "decoded.jsonl"))
    r.add_argument("--out", default=str(ROOT / "var" / "ladder" / "repaired.jsonl"))
    tb = sub.add_parser("table", help="grades against the truth, per half")
    tb.add_argument("--model", default=str(ROOT / "models" / "demo"))
    tb.add_argument("--config", help="the config whose [quality] thresholds grade (default: the repo's config.toml)")
    tb.add_argument("--decoded", default=str(ROOT / "var" / "ladder" / "decoded.jsonl"))
    tb.add_argument("--repaired", default=str(ROOT / "var" / "ladder" / "repaired.jsonl"))
    tb.add_argument("--json", help="write the record here")
    tb.add_argument("--rows", help="write every page's grade, figures and CER here (JSON lines)")
    tb.add_argument("--fit", action="store_true", help="choose the grading thresholds on the labelled half first")
    args = ap.parse_args(argv)
    {"decode": decode, "repair": repair_pass, "table": table}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
