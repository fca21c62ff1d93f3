"""Evaluate a (demo) Unlimited-OCR model on held-out synthetic documents through the official decode path.

    python -m scripts.eval.demo --model models/demo [--pages 50 --chunks 10 --office 1] [--device cpu]

1. single pages: N held-out synthetic pages (seeds never used in training), `document parsing.`; character
   error rate against the labels' text (markup, boxes and table tags stripped, whitespace collapsed);
   how many pages ended at the token limit instead of EOS.
2. 4-page chunks: `Multi page parsing.`; is every page separated (`<PAGE>` count == 4), CER per page.
3. plain office print: 16 pt Helvetica paragraphs on an A4 page made with pymupdf (insert_textbox).
4. single sentences (``--sentences N`` of each set), one 20 pt Helvetica text element on a page: ``sent-list``
   from the generator's own vocabulary, ``sent-open`` plain English whose words are mostly outside it; the gap
   between the two is how much the model reads versus recalls its training words.
5. nearly empty pages (``--sparse N``): N held-out synthetic pages of the generator's ``sparse`` kind (one to
   three elements anywhere, rarely a header), and ``sent-low``: the open sentences typed alone (16 pt Helvetica)
   lower on a blank page, where the training documents always had body text under a header.
Pages are rendered like the project renders PDFs (longer side 1024 px) and decoded with
`engine.official.official_generate`. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import codecs
import json
import sys
import time
from pathlib import Path

from rapidfuzz.distance import Levenshtein

from ingest.synth.documents import HELD_OUT_LIMIT, make_document, render_pages, strip_markup
from ingest.synth.text import paragraph

RENDER_PX = 1024  # ingest/pages/render.py DEFAULT_TARGET_PX (raised to the model's base size when that is larger)


def zen_of_python() -> str:
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints the Zen; its text is rot13 in this.s
        import this  # noqa: F401
    return codecs.decode(sys.modules["this"].s, "rot13")


def office_pdf(k: int) -> tuple[bytes, str]:
    """An A4 page of 16 pt Helvetica paragraphs (made with pymupdf) and its text."""
    import random

    import pymupdf

    if k == 0:
        lines = [ln for ln in zen_of_python().splitlines()[2:] if ln.strip()]
        paras = [" ".join(lines[i : i + 7]) for i in range(0, len(lines), 7)]
    else:
        rng = random.Random(990_000 + k)
        paras = [paragraph(rng, 220) for _ in range(3)]
    text = "\n\n".join(paras)
    doc = pymupdf.open()
    page = doc.new_page(width=595, height=842)
    left = page.insert_textbox(pymupdf.Rect(72, 72, 523, 770), text, fontsize=16, fontname="helv")
    if left < 0:
        raise RuntimeError("office text does not fit the page")
    data = doc.tobytes()
    doc.close()
    return data, text


# Plain English sentences, most of whose words are NOT in the generator's word list (ingest/synth/words.txt): the
# "open" sentence set measures reading beyond the training vocabulary.
OPEN_SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Minutes of the town council meeting held on the third of March.",
    "Please return the signed lease to the landlord before Friday noon.",
    "Grandmother baked bread and plum cake for the harvest festival.",
    "Rain flooded the cellar, so the parish ledgers were moved upstairs.",
    "Our neighbour sold his tractor, two cows and a wooden cart.",
]


def sentence_pdf(text: str) -> bytes:
    """One sentence as a generator-style text element (20 pt Helvetica, A4) on an otherwise empty page."""
    import pymupdf

    from ingest.synth.doc import _place, _wrap_words, draw_page

    doc = pymupdf.open()
    page = doc.new_page(width=595, height=842)
    draw_page(page, [_place("text", _wrap_words(text, "helv", 20.0, 475), "helv", 20.0, 60, 80, 26.0)])
    data = doc.tobytes()
    doc.close()
    return data


def typed_sentence_pdf(text: str, top: float = 72.0) -> bytes:
    """A sentence typed on an otherwise blank A4 page as office software would: 16 pt Helvetica at the left
    margin, `top` points from the top edge (72 = the first line of a page; lower = a lone line mid-page)."""
    import pymupdf

    doc = pymupdf.open()
    page = doc.new_page(width=595, height=842)
    page.insert_textbox(pymupdf.Rect(72, top, 523, top + 200), text, fontsize=16, fontname="helv")
    data = doc.tobytes()
    doc.close()
    return data


def list_sentences(n: int, seed: int) -> list[str]:
    """Sentences of the generator itself (its word list, numbers, codes), for the in-vocabulary sentence set."""
    import random

    from ingest.synth.text import sentence

    rng = random.Random(seed)
    return [sentence(rng, rng.randint(7, 11)) for _ in range(n)]


def _ensure_loguru() -> None:
    """engine.model.load logs with loguru; on a machine without it (the GPU image) use a print-based stand-in."""
    try:
        import loguru  # noqa: F401
    except ImportError:
        import types

        class _Logger:
            def __getattr__(self, _name):
                return lambda msg, *a, **k: print(str(msg).format(*a, **k), file=sys.stderr)

        sys.modules["loguru"] = types.SimpleNamespace(logger=_Logger())


class Scorer:
    def __init__(self, progress=None):
        self.rows = []
        self.progress = progress  # a tqdm bar advanced by one per row

    def add(self, kind, name, pred, ref, finish, tokens, seconds, note=""):
        p, r = strip_markup(pred), strip_markup(ref)
        edits = Levenshtein.distance(p, r)
        self.rows.append(dict(kind=kind, name=name, cer=edits / max(1, len(r)), edits=edits, chars=len(r),
                              finish=finish, tokens=tokens, seconds=seconds, note=note))
        if self.progress is not None:
            self.progress.update(1)

    def summary(self, kind):
        rows = [r for r in self.rows if r["kind"] == kind]
        if not rows:
            return None
        return {"n": len(rows), "cer_mean": sum(r["cer"] for r in rows) / len(rows),
                "cer_total": sum(r["edits"] for r in rows) / max(1, sum(r["chars"] for r in rows)),
                "length_limit": sum(r["finish"] != "eos" for r in rows),
                "tokens_mean": sum(r["tokens"] for r in rows) / len(rows),
                "seconds_mean": sum(r["seconds"] for r in rows) / len(rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/demo")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--pages", type=int, default=50, help="held-out single pages")
    ap.add_argument("--chunks", type=int, default=10, help="held-out 4-page chunks")
    ap.add_argument("--office", type=int, default=1, help="office-print pages (16 pt Helvetica)")
    ap.add_argument("--sentences", type=int, default=6,
                    help=f"single-sentence pages of each set: generator vocabulary, and open English (<= "
                         f"{len(OPEN_SENTENCES)})")
    ap.add_argument("--sparse", type=int, default=0,
                    help="held-out nearly empty pages (synth kind 'sparse'), and the open sentences typed alone "
                         "lower on a blank page ('sent-low')")
    ap.add_argument("--seed0", type=int, default=800_000, help="first held-out seed (< 1,000,000)")
    ap.add_argument("--max-new-tokens", type=int, default=1500, help="per page")
    ap.add_argument("--json", help="also write the full record (all rows) here")
    ap.add_argument("--verbose", action="store_true", help="print each page's output")
    args = ap.parse_args(argv)
    if args.seed0 + 10_000 + args.chunks > HELD_OUT_LIMIT:
        ap.error("held-out seeds must stay below 1,000,000")

    _ensure_loguru()
    from engine.model.load import load_model
    from engine.official import official_generate, split_pages

    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    global RENDER_PX
    RENDER_PX = max(RENDER_PX, loaded.processor.image_processor.size["height"])
    from tqdm import tqdm

    rows = (args.pages + 4 * args.chunks + args.office + args.sentences + min(args.sentences, len(OPEN_SENTENCES))
            + args.sparse + min(args.sparse, len(OPEN_SENTENCES)))
    sc = Scorer(tqdm(total=rows, desc="evaluating", unit="page", leave=False))
    chunk_ok = 0
    t0 = time.time()

    def read_page(kind: str, name: str, pdf: bytes, ref: str, limit: int) -> None:
        """Decode a one-page PDF on the official path and score it against `ref`."""
        res = official_generate(loaded, render_pages(pdf, RENDER_PX), "single", limit)
        sc.add(kind, name, res.text.strip(), ref, res.finish_reason, len(res.output_ids), res.seconds)
        if args.verbose:
            print(f"--- {kind} {name} cer {sc.rows[-1]['cer']:.3f}\n{ref}\n{res.text}\n", flush=True)

    for k in range(args.pages):
        pdf, labels = make_document(args.seed0 + k, 1)
        read_page("page", f"seed {args.seed0 + k}", pdf, labels[0], args.max_new_tokens)
    for k in range(args.chunks):
        seed = args.seed0 + 10_000 + k
        pdf, labels = make_document(seed, 4)
        res = official_generate(loaded, render_pages(pdf, RENDER_PX), "multi", 4 * args.max_new_tokens)
        pages = split_pages(res.text)
        ok = len(pages) == 4 and res.text.lstrip().startswith("<PAGE>")
        chunk_ok += ok
        per = res.seconds / 4
        if len(pages) == 4:
            for i in range(4):
                sc.add("chunk", f"seed {seed} p{i + 1}", pages[i], labels[i], res.finish_reason, len(res.output_ids) // 4,
                       per)
        else:
            sc.add("chunk", f"seed {seed} (pages {len(pages)})", " ".join(pages), " ".join(labels), res.finish_reason,
                   len(res.output_ids), res.seconds, note=f"{len(pages)} pages")
    for k in range(args.office):
        pdf, text = office_pdf(k)
        read_page("office", f"office {k}", pdf, text, args.max_new_tokens)
    for kind, texts in (("sent-list", list_sentences(args.sentences, args.seed0 + 20_000)),
                        ("sent-open", OPEN_SENTENCES[: args.sentences])):
        for text in texts:
            read_page(kind, text, sentence_pdf(text), text, 200)
    for k in range(args.sparse):
        seed = args.seed0 + 30_000 + k
        pdf, labels = make_document(seed, 1, kind="sparse")
        read_page("sparse", f"seed {seed}", pdf, labels[0], args.max_new_tokens)
    for k, text in enumerate(OPEN_SENTENCES[: args.sparse]):
        read_page("sent-low", text, typed_sentence_pdf(text, 200 + 90 * k), text, 200)

    sc.progress.close()
    summary = {kind: sc.summary(kind)
               for kind in ("page", "chunk", "office", "sent-list", "sent-open", "sparse", "sent-low")}
    if summary["chunk"]:
        summary["chunk"]["separated"] = f"{chunk_ok}/{args.chunks}"
    print(f"\nmodel {loaded.path} on {loaded.device} ({loaded.dtype}), {time.time() - t0:.0f}s")
    print(f"{'set':<9} {'n':>4} {'CER mean':>9} {'CER total':>10} {'hit limit':>9} {'tokens':>7} {'s/page':>7}  extra")
    for kind, s in summary.items():
        if s:
            extra = f"pages separated {s['separated']}" if kind == "chunk" else ""
            print(f"{kind:<9} {s['n']:>4} {s['cer_mean']:>9.4f} {s['cer_total']:>10.4f} {s['length_limit']:>9} "
                  f"{s['tokens_mean']:>7.0f} {s['seconds_mean']:>7.2f}  {extra}")
    record = {"model": loaded.path, "device": str(loaded.device), "dtype": str(loaded.dtype), **summary}
    if args.json:
        Path(args.json).write_text(json.dumps({**record, "rows": sc.rows}, indent=1))
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
