"""Grades (ingest.quality.grades), the print measured on a page (ingest.pages.ink), and the repair of pages that look fine but
are wrong (ingest.quality.repair), through the real worker on a real SQLite ledger and real PDFs with a scripted decoder."""

from __future__ import annotations

import json
import threading

import pymupdf
import pytest
from PIL import Image
from sqlalchemy import func, select

from db.models import Document, Page
from db.session import Database
from engine.chunk_output import assemble
from engine.official import DecodeResult
from ingest.config import load_settings
from ingest.intake.enqueue import intake_file
from ingest.pages.ink import ink_text
from ingest.pages.render import render_pages
from ingest.quality.grades import checks, explain, grade, grade_document, neighbour_ratio, repeats
from ingest.quality.measures import Thresholds
from ingest.quality.repair import keeps_alone
from ingest.worker.worker import Worker
from tests.conftest import make_pdf, serve_until, uflash, worker_config

T = Thresholds()

PARAGRAPHS = [
    "Minutes of the parish council. The council met in the school room on the third of March. The clerk read the "
    "accounts of the year, and the members agreed to repair the roof of the almshouse before the winter.",
    "Register of burials, eighteen fifty one. John Miller, farmer, aged sixty two, buried on the ninth of May by "
    "the vicar. Mary Ann Cooper, widow, aged seventy, buried on the twelfth of June in the old churchyard.",
    "Letters received. A letter from the bishop about the new organ, another from the county surveyor about the "
    "bridge over the mill stream, and a note from the schoolmaster asking for coal for the winter months.",
]


def _clean(**over):
    base = {"finish_reason": "eos", "tokens": 500, "chars": 1800, "distinct_20": 1.0, "distinct_35": 1.0,
            "mean_logprob": -0.05, "min_logprob": -2.1, "low_confidence_share": 0.01, "unsure_words": 0.02,
            "plain_chars": 1700, "ink_chars": 1650, "chars_vs_ink": 1.03, "neighbour_chars_ratio": 1.1}
    return {**base, **over}


def test_grades_on_figures_and_the_text_layer_never_counts():
    assert grade(_clean(), T) == ("good", [])
    assert grade(_clean(text_layer_ned=0.95), T) == ("good", [])  # a text layer that disagrees: shown, not graded
    assert grade(_clean(finish_reason="repetition", distinct_20=0.3), T) == ("poor", ["repetition", "low_distinct_20"])
    assert grade(_clean(finish_reason="context_limit"), T)[0] == "poor"
    assert grade(_clean(unsure_words=0.5), T) == ("poor", ["unsure_words"])
    assert grade(_clean(unsure_words=(T.unsure_words_fair + T.unsure_words_poor) / 2), T) == ("fair", ["unsure_words"])
    assert grade(_clean(chars_vs_ink=T.ink_short / 2), T) == ("poor", ["text_vs_ink"])
    assert grade(_clean(chars_vs_ink=T.ink_long * 2), T) == ("poor", ["text_vs_ink"])
    assert grade(_clean(chars_vs_ink=None, ink_chars=0), T) == ("good", [])  # a blank page read as blank
    assert grade(_clean(repeats={"page": 2, "share": 0.9, "scope": "chunk"}), T) == ("poor", ["repeats_page"])
    assert grade(_clean(repeats={"page": 2, "share": 0.9, "scope": "document"}), T) == \
        ("fair", ["repeats_page_elsewhere"])
    assert grade(_clean(repeats={"page": 2, "share": 0.9, "scope": "chunk", "confirmed": True}), T)[0] == "fair"
    assert grade(_clean(pages_mismatch={"given": 4, "returned": 3}), T) == ("poor", ["pages_mismatch"])
    assert checks(_clean(repeats={"page": 1, "share": 1.0}, chars_vs_ink=0.1), T) == ["repeats_page", "text_vs_ink"]
    q = _clean(unsure_words=0.18, repeats={"page": 2, "share": 0.83}, chars_vs_ink=0.2, plain_chars=120,
               ink_chars=900)
    assert explain("unsure_words", q) == "the model was unsure of 18% of its words"
    assert explain("repeats_page", q) == "repeats page 2 (83% of its text is there)"
    assert explain("repeats_page", q, short=True) == "repeats page 2"
    assert explain("text_vs_ink", q) == ("far less text than the page's print suggests (120 characters read, "
                                         "about 900 on the page)")


def test_repeats_are_found_and_boilerplate_is_not_one():
    a, b, c = PARAGRAPHS
    assert repeats([a, b, b], T) == [None, None, {"page": 2, "share": 1.0}]
    assert repeats([a, b, b + " and one more line at the end"], T)[2]["page"] == 2
    assert repeats([a, b, c], T) == [None, None, None]
    assert repeats(["Page 1", "Page 2", "Page 2"], T) == [None, None, None]  # too short to judge
    assert repeats([b, a], T, later_only=True) == [None, None]
    # a running header on every page of a long document is not a repeat
    header = "The Parish Magazine of Saint Mary, Little Hadham. "
    pages = [header + f"Notice {i}: " + PARAGRAPHS[i % 3][: 40 + i] + f" ({i * 37} {i * 91})" for i in range(30)]
    assert all(r is None for r in repeats([header + f" page {i}" for i in range(30)], T))
    assert len(pages) == 30
    graded = grade_document([{**_clean(), "plain": x, "chunk_id": 1 + i // 4} for i, x in enumerate([a, b, c, b])], T)
    assert graded[3]["repeats"] == {"page": 2, "share": 1.0, "scope": "chunk"} and graded[3]["grade"] == "poor"
    graded = grade_document([{**_clean(), "plain": x, "chunk_id": i} for i, x in enumerate([a, b, c, b])], T)
    assert graded[3]["repeats"]["scope"] == "document" and graded[3]["grade"] == "fair"
    assert "plain" not in graded[0] and "chunk_id" not in graded[0]
    chars = [2000, 2100, 150, 1900]
    assert neighbour_ratio(chars, 2) == pytest.approx(150 / 2000) and neighbour_ratio([50, 60], 0) is None


def _page_image(text: str, size: float) -> Image.Image:
    doc = pymupdf.open()
    page = doc.new_page(width=595, height=842)
    page.insert_textbox(pymupdf.Rect(60, 60, 535, 800), text, fontsize=size, fontname="helv")
    pix = page.get_pixmap(matrix=pymupdf.Matrix(1024 / 842, 1024 / 842), colorspace=pymupdf.csRGB)
    return Image.frombytes("RGB", (pix.width, pix.height), pix.samples)


def test_ink_measures_the_print_on_the_page_whatever_its_size():
    text = " ".join(PARAGRAPHS * 2)
    for size in (10, 14, 20):
        m = ink_text(_page_image(text, size))
        assert 0.6 < m.chars / len(text) < 1.6, (size, m)
        assert abs(m.skew) < 0.3
    blank = ink_text(Image.new("RGB", (724, 1024), "white"))
    assert blank.chars == 0 and blank.lines == 0
    turned = _page_image(text, 12).rotate(2.0, fillcolor="white", resample=Image.BILINEAR)
    m = ink_text(turned)
    assert 0.6 < m.chars / len(text) < 1.6 and 1.5 < abs(m.skew) < 2.5


# -- repair through the worker -------------------------------------------------------------------------------

class CopyingDecoder:
    """A scripted decoder: a chunk of several pages is read right, except that its last page repeats the page before
    it, written with more confidence than anything else; a page decoded alone is read right. Records every decode."""

    mode, model_name, device = "lossless", "copying", "cpu"

    def __init__(self, pdf, n: int, truth: list[str]):
        self.page_of = {p.image.tobytes(): p.index for p in render_pages(pdf, "pdf", 1, n)}
        self.truth, self.calls = truth, []

    def describe(self):
        return {}

    def free_memory(self):
        pass

    def decode(self, images, context_limit, max_new_tokens=None, **hints):
        pages = [self.page_of[im.tobytes()] for im in images]
        self.calls.append(pages)
        texts = [self.truth[n - 1] for n in pages]
        if len(pages) > 1:
            texts[-1] = texts[-2]
        body = "".join(("<PAGE>" if len(pages) > 1 else "") + f"<|det|>text [60, 60, 900, 300]<|/det|>{t}"
                       for t in texts)
        n = len(body)
        lps = [-0.03] * n if len(pages) == 1 else [-0.02] * (n - len(texts[-1])) + [-0.01] * len(texts[-1])
        res = DecodeResult(prompt_ids=[0] * 10, output_ids=list(range(n)), finish_reason="eos", seconds=0.1,
                           text=body, prompt_kind="multi" if len(pages) > 1 else "single", n_pages=len(pages),
                           logprobs=lps)
        return assemble(res, len(pages), hit_context=False)


def _scan_pdf(path, texts):
    """An image-only PDF (no text layer) of the pages."""
    src = make_pdf(path.with_suffix(".src.pdf"), texts)
    out = pymupdf.open()
    with pymupdf.open(src) as doc:
        for page in doc:
            pix = page.get_pixmap(dpi=110, colorspace=pymupdf.csGRAY)
            new = out.new_page(width=page.rect.width, height=page.rect.height)
            new.insert_image(new.rect, stream=pix.tobytes("png"))
    out.save(path)
    src.unlink()
    return path


def _run(tmp_path, tiny_model_dir, scan: bool, repair: bool, threads: dict | None = None,
         monkeypatch=None):
    """The worker over one 3-page chunk whose page 3 repeats page 2; ``threads``: {what: the threads it ran on} of the
    decodes, the page figures, the store and the grades (the loop's thread must only decode)."""
    from ingest.quality.calibration import FITTED

    # the repair is what is tested: graded with the demo model's thresholds (set in the config), not the conservative
    # ones the uncalibrated tiny model gets
    demo = {k: getattr(Thresholds(), k) for k in FITTED}
    cfg = worker_config(tmp_path, tiny_model_dir, quality={"repair": repair, **demo}, orientation={"auto": False})
    s = load_settings(cfg)
    s.ensure_folders()
    db = Database(s.database_url)
    pdf = (_scan_pdf if scan else make_pdf)(s.inbox / "minutes.pdf", PARAGRAPHS)
    decoder = CopyingDecoder(pdf, 3, PARAGRAPHS)
    doc = intake_file(db, s, pdf).document_id
    if threads is not None:
        import ingest.quality.repair
        import ingest.worker.finish
        import ingest.worker.worker

        def on_thread(what, fn):
            def recorded(*args, **kwargs):
                threads.setdefault(what, set()).add(threading.current_thread().name)
                return fn(*args, **kwargs)
            return recorded

        decoder.decode = on_thread("decode", decoder.decode)
        for module, name, what in ((ingest.quality.repair, "page_stats", "page figures"),
                                   (ingest.worker.finish, "grade_document", "grades"),
                                   (ingest.worker.worker, "store_chunk", "store")):
            monkeypatch.setattr(module, name, on_thread(what, getattr(module, name)))

    def done():
        with db.session() as ss:
            return ss.get(Document, doc).status in ("done", "failed")

    serve_until(Worker(s, db, lambda: decoder), done)
    with db.session() as ss:
        pages = ss.scalars(select(Page).where(Page.document_id == doc).order_by(Page.page_index)).all()
        assert ss.get(Document, doc).status == "done"
    return cfg, s, decoder, pages


@pytest.mark.parametrize("scan", [False, True], ids=["born-digital", "scan"])
def test_a_page_that_repeats_its_neighbour_is_decoded_alone_and_the_right_reading_kept(tmp_path, tiny_model_dir,
                                                                                        scan, monkeypatch):
    threads: dict[str, set[str]] = {}
    cfg, s, decoder, pages = _run(tmp_path, tiny_model_dir, scan=scan, repair=True, threads=threads,
                                  monkeypatch=monkeypatch)
    assert decoder.calls == [[1, 2, 3], [3]]  # one chunk, then page 3 alone
    # the decode loop's thread only decodes (the repair's too); page figures, the store and grades run beside it
    loop = threading.current_thread().name
    assert threads == {"decode": {loop}, "page figures": {"checks"}, "store": {"checks"}, "grades": {"finish"}}, \
        threads
    assert [p.text.split("<|/det|>")[1] for p in pages] == PARAGRAPHS  # page 3 has its own text
    rep = pages[2].stats["repair"]
    assert rep["checks"] == ["repeats_page"] and rep["kept"] == "alone"
    assert rep["chunk"]["text"].endswith(PARAGRAPHS[1]) and rep["alone"]["text"].endswith(PARAGRAPHS[2])
    assert rep["chunk"]["confidence"] > rep["alone"]["confidence"]  # the copy was the more confident reading ...
    assert rep["chunk"]["checks"] == ["repeats_page"] and rep["alone"]["checks"] == []  # ... but a copy
    assert [p.stats["quality"]["grade"] for p in pages] == ["good"] * 3
    assert "repair" not in pages[0].stats and "repair" not in pages[1].stats
    report = uflash("--config", str(cfg), "report")
    assert report.returncode == 0, report.stderr
    assert "repaired: repeats page 2, read again alone" in report.stdout
    doc = json.loads((s.outbox / "minutes" / "document.json").read_text(encoding="utf-8"))
    assert doc["pages"][2]["stats"]["repair"]["kept"] == "alone"


@pytest.mark.parametrize("scan", [False, True], ids=["born-digital", "scan"])
def test_without_repair_a_copied_page_is_poor_with_or_without_a_text_layer(tmp_path, tiny_model_dir, scan):
    _, _, decoder, pages = _run(tmp_path, tiny_model_dir, scan=scan, repair=False)
    assert decoder.calls == [[1, 2, 3]]
    q = pages[2].stats["quality"]
    assert q["grade"] == "poor" and q["reasons"] == ["repeats_page"] and q["repeats"]["page"] == 2
    assert (q["text_layer_ned"] is None) == scan  # the scan has no text layer; the grade is the same
    assert [p.stats["quality"]["grade"] for p in pages[:2]] == ["good", "good"]


def test_repair_keeps_the_reading_with_fewer_failed_checks_and_counts_a_cut_off_reading_as_one_more():
    def reading(checks_failed, finish="eos", confidence=-0.05):
        return {"checks": checks_failed, "finish_reason": finish, "confidence": confidence}

    copy = reading(["repeats_page"], confidence=-0.01)  # the chunk's: a confident copy of the page before
    assert keeps_alone(reading([], confidence=-0.3), copy)  # fewer checks wins over confidence
    assert not keeps_alone(reading(["text_vs_ink"], confidence=-0.3), copy)  # as many checks: the more confident
    # read alone the page ran into its token limit (a loop, written with confidence): as bad as the copy, and of
    # two as bad, the one that ended by itself
    assert not keeps_alone(reading([], "length", confidence=0.0), copy)
    assert not keeps_alone(reading([], "repetition", confidence=0.0), copy)
    assert keeps_alone(reading([]), reading(["pages_mismatch"], "length"))
    # a confidence of exactly 0.0 is a confidence, not a missing one
    assert keeps_alone(reading(["text_vs_ink"], confidence=0.0), reading(["text_vs_ink"], confidence=-0.1))
    assert keeps_alone(reading(["text_vs_ink"], confidence=-0.1), reading(["text_vs_ink"], confidence=None))


class MergingDecoder(CopyingDecoder):
    """A chunk of several pages comes back one page short: its second page holds the second and third pages' text
    (the model missed a separator). A page decoded alone is read right."""

    def decode(self, images, context_limit, max_new_tokens=None, **hints):
        pages = [self.page_of[im.tobytes()] for im in images]
        self.calls.append(pages)
        texts = [self.truth[n - 1] for n in pages]
        if len(pages) > 2:
            texts = texts[:1] + [" ".join(texts[1:])]
        body = "".join(("<PAGE>" if len(pages) > 1 else "") + f"<|det|>text [60, 60, 900, 300]<|/det|>{t}"
                       for t in texts)
        res = DecodeResult(prompt_ids=[0] * 10, output_ids=list(range(len(body))), finish_reason="eos", seconds=0.1,
                           text=body, prompt_kind="multi" if len(pages) > 1 else "single", n_pages=len(pages),
                           logprobs=[-0.02] * len(body))
        return assemble(res, len(pages), hit_context=False)


def test_pages_of_a_chunk_that_came_back_short_are_decoded_alone(tmp_path, tiny_model_dir):
    """3 pages in, 2 out: page 3 is re-queued (the worker's rule) and pages 1-2, which may hold their neighbours'
    text, are each decoded again alone; page 2's own reading is kept."""
    from ingest.quality.calibration import FITTED

    demo = {k: getattr(Thresholds(), k) for k in FITTED}  # graded as in _run: the demo model's thresholds
    cfg = worker_config(tmp_path, tiny_model_dir, quality=demo, orientation={"auto": False})
    s = load_settings(cfg)
    s.ensure_folders()
    db = Database(s.database_url)
    pdf = make_pdf(s.inbox / "merged.pdf", PARAGRAPHS)
    decoder = MergingDecoder(pdf, 3, PARAGRAPHS)
    doc = intake_file(db, s, pdf).document_id

    def done():
        with db.session() as ss:
            return ss.get(Document, doc).status in ("done", "failed")

    serve_until(Worker(s, db, lambda: decoder), done)
    assert decoder.calls == [[1, 2, 3], [1], [2], [3]]
    with db.session() as ss:
        pages = ss.scalars(select(Page).where(Page.document_id == doc).order_by(Page.page_index)).all()
    assert [p.text.split("<|/det|>")[1] for p in pages] == PARAGRAPHS
    assert all("pages_mismatch" in p.stats["repair"]["checks"] for p in pages[:2]) and "repair" not in pages[2].stats
    assert pages[1].stats["repair"]["kept"] == "alone" and "text_vs_ink" in pages[1].stats["repair"]["checks"]
    assert all(p.stats["quality"]["grade"] == "good" for p in pages)
    with db.session() as ss:
        assert ss.scalar(select(func.count()).select_from(Page)) == 3
