#!/usr/bin/env python3
"""Calibrate the page grades against the truth on a difficulty ladder of labelled documents (scripts/synth/ladder.py).

    # 1. decode the ladder as the pipeline does (one document = one chunk of 1-4 pages, the engine in lossless mode,
    #    batched), one JSON line per document, appended as each ends: a crash loses nothing, a restart goes on
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
        docs[seed] = {"seed": seed, "half": "held_out" if (seed - args.seed0) % 2 else "labelled",
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("decode", help="decode the ladder (JSON lines, resumable)")
    d.add_argument("--model", default=str(ROOT / "models" / "demo"))
    d.add_argument("--device", default="cpu")
    d.add_argument("--mode", default="lossless")
    d.add_argument("--docs", type=int, default=260)
    d.add_argument("--seed0", type=int, default=SEED0)
    d.add_argument("--max-batch", type=int, default=8)
    d.add_argument("--tokens-per-page", type=int, default=TOKENS_PER_PAGE)
    d.add_argument("--context-limit", type=int, default=32768)
    d.add_argument("--out", default=str(ROOT / "var" / "ladder" / "decoded.jsonl"))
    args = ap.parse_args(argv)
    if args.cmd == "decode":
        decode(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
