"""Archival outputs: the word layout, word confidences, ALTO 4.4 (validated offline against the LoC schema), hOCR
(parsed with the Internet Archive's hOCR library), the PDF/A-2b made by OCRmyPDF, and uflash as OCRmyPDF's engine."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pikepdf
import pymupdf
import pytest
from lxml import etree
from PIL import Image, ImageDraw

from engine.chunk_output import assemble
from engine.official import DecodeResult
from ingest.reading.words import GRID, layout_page, page_segments, plain_words
from tests.conftest import (
    DEMO,
    HAS_DEMO,
    ROOT,
    assert_pdfa_2b,
    make_pdf,
    needs_demo,
    serve_until,
    uflash,
    worker_config,
)

SCHEMA = ROOT.parent / "shared" / "schemas" / "alto-4-4.xsd"
ALTO = "{http://www.loc.gov/standards/alto/ns-v4#}"

PAGE_TEXTS = [
    "<|det|>title [100, 40, 900, 90]<|/det|>Stadtrat Protokoll 1923\n"
    "<|det|>text [100, 120, 900, 300]<|/det|>Die Sitzung begann um neun Uhr.\nAnwesend waren zwölf Räte.\n"
    "<|det|>table [100, 350, 900, 600]<|/det|><table><tr><td>Posten</td><td>Betrag</td></tr>"
    "<tr><td>Miete</td><td>12,50</td></tr></table>\n"
    "<|det|>image [100, 650, 500, 900]<|/det|>",
    "<|det|>text [80, 60, 920, 200]<|/det|>Zweite Seite: Ελληνικά und 中文 Text.\n"
    "<|det|>figure [80, 300, 600, 700]<|/det|>Abb. 1 Rathaus",
]
UNSURE = "zwölf"  # the test plants a low-probability token on this word
ELEMENT_BOX = re.compile(r"<\|det\|>\w+ \[(\d+), (\d+), (\d+), (\d+)\]<\|/det\|>")


# -- the word layout ----------------------------------------------------------------------------------------------
def test_words_are_the_text_without_markup_in_order():
    assert plain_words(PAGE_TEXTS[0]) == ["Stadtrat", "Protokoll", "1923", "Die", "Sitzung", "begann", "um", "neun",
                                          "Uhr.", "Anwesend", "waren", "zwölf", "Räte.", "Posten", "Betrag", "Miete",
                                          "12,50"]
    # text outside any element, ref/grounding tags, a header cut off by the end, control characters XML cannot carry
    text = "Vorwort<|ref|>x<|/ref|>y\n<|det|>text [1, 2, 3, 4]<|/det|>a\x01b <|grounding|>c\n<|det|>text [5, 6"
    assert plain_words(text) == ["Vorwort", "x", "y", "a", "b", "c"]
    segs = page_segments(text)
    assert [s.label for s in segs] == [None, "text"] and segs[1].grid_box == (1, 2, 3, 4)
    table = page_segments(PAGE_TEXTS[0])[2]
    assert table.table and [[w.text for w in line] for line in table.lines] == [["Posten", "Betrag"], ["Miete", "12,50"]]
    assert plain_words("<|det|>text [10, 20, 30]<|/det|>kaputt") == ["kaputt"]  # a header without a box: words kept


def test_word_boxes_split_the_element_by_lines_and_character_widths():
    layout = layout_page(PAGE_TEXTS[0], 1, 1000, 2000, confidences=None)
    assert [b.kind for b in layout.blocks] == ["text", "text", "table", "picture"]
    text = layout.blocks[1]
    assert text.box.x0 == 100 and text.box.y0 == round(120 * 2000 / GRID)
    assert len(text.lines) == 2 and text.lines[0].box.y1 == text.lines[1].box.y0  # two bands
    for block in layout.blocks:
        for line in block.lines:
            assert all(block.box.contains(w.box) for w in line.words)
            xs = [(w.box.x0, w.box.x1) for w in line.words]
            assert all(a1 <= b0 for (_, a1), (b0, _) in zip(xs, xs[1:]))  # left to right, no overlap
    widest = max(text.lines, key=lambda line: line.box.width)
    assert widest.box.x1 >= text.box.x1 - 1  # the widest line fills the box
    first = text.lines[0].words
    assert first[1].box.width > 2 * first[3].box.width  # "Sitzung" against "um": by character widths
    assert layout.blocks[3].lines == [] and layout.blocks[3].box.y1 == round(900 * 2000 / GRID)


# -- word confidences ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    if not HAS_DEMO:
        pytest.skip("models/demo is not in this checkout")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO))


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_tokenizer_whose_tokens_decode_without_their_spaces_still_gives_each_word_its_token_quickly():
    """A word-level tokenizer (the stand-in's: a token decoded alone has no space, the whole text has one between
    words) takes the character alignment: each word gets exactly its own token's probability, and a page of 1,000
    words takes well under a second (the alignment is not quadratic)."""
    import time

    from ingest.reading.confidence import word_confidences
    from scripts.standin.vocab import build_tokenizer

    tok = build_tokenizer(4000)
    ids = list(range(200, 1200))
    text = tok.decode(ids)
    assert text.count(" ") == len(ids) - 1
    logprobs = [-0.01 * (k % 7) for k in range(len(ids))]
    t0 = time.perf_counter()
    conf = word_confidences(text, ids, logprobs, tok)
    assert time.perf_counter() - t0 < 1.0
    assert conf == [round(math.exp(lp), 4) for lp in logprobs]


def test_a_planted_low_probability_token_gives_its_word_the_lowest_confidence(tokenizer):
    from ingest.reading.confidence import char_tokens, token_bytes, word_confidences

    text = PAGE_TEXTS[0]
    ids = ids_of(tokenizer, text)
    decoded, _ = char_tokens(token_bytes(tokenizer, ids))
    assert decoded == text  # special tokens (<|det|>, <td>, </td>) and byte pieces (ö, ä) rebuild the text
    logprobs = [math.log(0.999)] * len(ids)
    at = text.index(UNSURE) + 2  # the "ö"
    pos = 0
    for k, piece in enumerate(token_bytes(tokenizer, ids)):
        if pos <= len(text[:at].encode()) < pos + len(piece):
            logprobs[k] = math.log(0.05)
            break
        pos += len(piece)
    conf = dict(zip(plain_words(text), word_confidences(text, ids, logprobs, tokenizer)))
    assert max(conf.values()) <= 0.999 + 1e-9  # a product of its tokens' probabilities: never above the surest
    assert min(conf, key=conf.get) == UNSURE and conf[UNSURE] < 0.05
    assert all(c > 0.9 for w, c in conf.items() if w != UNSURE)
    # no probabilities: no confidences; a decoder text that differs (spaces cleaned up) is matched char by char
    assert word_confidences(text, ids, [], tokenizer) == [None] * len(conf)
    other = text.replace("Uhr.", "Uhr .")
    shifted = word_confidences(other, ids, logprobs, tokenizer)
    assert shifted[plain_words(other).index(UNSURE)] < 0.05 and len(shifted) == len(conf) + 1


def test_a_character_split_over_two_tokens_counts_for_both():
    from ingest.reading.confidence import char_tokens

    text, owners = char_tokens(["ä".encode()[:1], "ä".encode()[1:] + b"b", b" c"])
    assert text == "äb c" and owners[0] == (0, 1) and owners[1] == (1, 1) and owners[3] == (2, 2)


# -- a multi-page document through the worker ---------------------------------------------------------------------
class ScriptedDecoder:
    """Reads every chunk as ``PAGE_TEXTS`` (real token ids of the demo tokenizer, one token planted unsure)."""

    mode, model_name, device = "lossless", "scripted", "cpu"

    def __init__(self, tokenizer):
        self.loaded = SimpleNamespace(tokenizer=tokenizer)
        self.sep = tokenizer.convert_tokens_to_ids("<PAGE>")

    def describe(self):
        return {}

    def free_memory(self):
        pass

    def decode(self, images, context_limit, max_new_tokens=None, **hints):
        tok = self.loaded.tokenizer
        text = "".join("<PAGE>" + t for t in PAGE_TEXTS[: len(images)])
        ids = ids_of(tok, text) + [tok.eos_token_id]
        logprobs = [math.log(0.999)] * len(ids)
        unsure = ids_of(tok, text[: text.index(UNSURE) + 1])
        logprobs[len(unsure) - 1] = math.log(0.02)  # the "z" of "zwölf"
        res = DecodeResult(prompt_ids=[0] * 10, output_ids=ids, finish_reason="eos", seconds=1.0, text=text,
                           prompt_kind="multi", n_pages=len(images), ngram_window=1024, logprobs=logprobs)
        return assemble(res, len(images), hit_context=False, page_sep_id=self.sep, eos_token_id=tok.eos_token_id)


def scanned_pdf(path: Path, n: int, size=(576, 768)) -> Path:
    """Image-only pages with some ink, as a scanner writes them (no text layer)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = pymupdf.open()
    for i in range(n):
        img = Image.new("L", (1200, 1600), 255)
        ImageDraw.Draw(img).text((200, 200 + 100 * i), f"page {i + 1}", fill=0)
        png = path.with_name(f"{path.stem}-{i}.png")
        img.save(png)
        page = doc.new_page(width=size[0], height=size[1])
        page.insert_image(page.rect, filename=str(png))
        png.unlink()
    doc.save(path)
    return path


@pytest.fixture(scope="module")
def archived(tmp_path_factory, tokenizer, tiny_model_dir):
    """A 2-page scan (text, a table, pictures) decoded by the worker and written in every format."""
    from db.session import Database
    from ingest.config import load_settings
    from ingest.intake.enqueue import intake_file
    from ingest.worker.worker import Worker

    tmp = tmp_path_factory.mktemp("archived")
    cfg = worker_config(tmp, tiny_model_dir, orientation={"auto": False},
                        outputs={"formats": ["md", "json", "pdf", "alto", "hocr"]})
    s = load_settings(cfg)
    s.ensure_folders()
    db = Database(s.database_url)
    doc = intake_file(db, s, scanned_pdf(s.inbox / "protokoll.pdf", 2)).document_id
    serve_until(Worker(s, db, lambda: ScriptedDecoder(tokenizer)), lambda: (s.outbox / "protokoll" / "alto").is_dir())
    db.dispose()
    folder = s.outbox / "protokoll"
    return SimpleNamespace(folder=folder, doc=doc, meta=json.loads((folder / "document.json").read_text("utf-8")))


def test_every_alto_file_validates_and_carries_the_words_and_their_confidences(archived):
    schema = etree.XMLSchema(etree.parse(str(SCHEMA)))  # imports the local xlink.xsd: no network
    files = sorted((archived.folder / "alto").iterdir())
    assert [f.name for f in files] == ["0001.xml", "0002.xml"]
    for f, page, text in zip(files, archived.meta["pages"], PAGE_TEXTS):
        tree = etree.parse(str(f))
        schema.assertValid(tree)
        assert page["text"] == text
        strings = tree.findall(f".//{ALTO}String")
        assert [s.get("CONTENT") for s in strings] == plain_words(text)  # word for word, no markup
        # every token was given probability 0.999 but the planted one 0.02: a word's confidence is 0.999 to the power
        # of its tokens (at least one, at most one a byte and one shared with a neighbour), times 0.02 for the planted
        for word, s in zip(plain_words(text), strings):
            top = 0.02 if word == UNSURE else 0.999
            assert round(top * 0.999 ** (len(word.encode()) + 1), 4) <= float(s.get("WC")) <= top, (word, s.get("WC"))
        # each word inside the box its element's markup gives, scaled from the 0-999 grid to the 768 x 1024 page
        boxes = [[int(v) * size / GRID for v, size in zip(box, (768, 1024, 768, 1024))] for box in ELEMENT_BOX.findall(text)]
        for s in strings:
            x0, y0 = float(s.get("HPOS")), float(s.get("VPOS"))
            x1, y1 = x0 + float(s.get("WIDTH")), y0 + float(s.get("HEIGHT"))
            assert any(b[0] - 1 <= x0 < x1 <= b[2] + 1 and b[1] - 1 <= y0 < y1 <= b[3] + 1 for b in boxes), s.get("CONTENT")
        pg = tree.find(f".//{ALTO}Page")
        assert (pg.get("WIDTH"), pg.get("HEIGHT")) == ("768", "1024")  # the page image the model read
        assert pg.get("PHYSICAL_IMG_NR") == str(page["index"]) and pg.get("ROTATION") is None
        assert tree.find(f".//{ALTO}fileName").text == "protokoll.pdf"
        steps = " ".join(e.text for e in tree.findall(f".//{ALTO}processingStepDescription"))
        assert "estimated" in steps and "lossless" in steps and "WC = product" in steps
    first = etree.parse(str(files[0]))
    wc = {s.get("CONTENT"): float(s.get("WC")) for s in first.iter(f"{ALTO}String")}
    assert min(wc, key=wc.get) == UNSURE and wc[UNSURE] < 0.03 and all(v > 0.9 for k, v in wc.items() if k != UNSURE)
    tags = {t.get("ID"): t.get("LABEL") for t in first.iter(f"{ALTO}LayoutTag")}
    table = [b for b in first.iter(f"{ALTO}TextBlock") if tags[b.get("TAGREFS")] == "table"]
    assert len(table) == 1 and len(table[0].findall(f"{ALTO}TextLine")) == 2  # a line per row
    (picture,) = first.iter(f"{ALTO}Illustration")
    assert tags[picture.get("TAGREFS")] == "image" and picture.get("HPOS") == str(round(100 * 768 / GRID))
    second = etree.parse(str(files[1]))  # a figure with words: the Illustration, then a TextBlock of its words
    (figure,) = second.iter(f"{ALTO}Illustration")
    assert figure.getnext().tag == f"{ALTO}TextBlock" and figure.getnext().get("HPOS") == figure.get("HPOS")


def test_the_hocr_parses_with_an_hocr_library_and_carries_the_same_words_and_boxes(archived):
    from hocr.parse import hocr_page_get_dimensions, hocr_page_iterator, hocr_page_to_word_data

    seen = 0
    for hp, page in zip(hocr_page_iterator(str(archived.folder / "document.hocr")), archived.meta["pages"]):
        seen += 1  # (the iterator streams: each page is cleared once the next is asked for)
        assert hocr_page_get_dimensions(hp) == (768, 1024)  # the page image the model read
        words = [w for par in hocr_page_to_word_data(hp) for line in par["lines"] for w in line["words"]]
        assert [w["text"] for w in words] == plain_words(page["text"])
        # the words, boxes and confidences the ALTO file of the page gives (written apart, checked above)
        strings = etree.parse(str(archived.folder / "alto" / f"{page['index']:04d}.xml")).findall(f".//{ALTO}String")
        alto = [(round(float(s.get("HPOS"))), round(float(s.get("VPOS"))),
                 round(float(s.get("HPOS")) + float(s.get("WIDTH"))), round(float(s.get("VPOS")) + float(s.get("HEIGHT"))))
                for s in strings]
        assert [tuple(w["bbox"]) for w in words] == alto
        assert [w["confidence"] for w in words] == [round(100 * float(s.get("WC"))) for s in strings]
    assert seen == 2


def _word_in(word: pymupdf.Rect, element: pymupdf.Rect) -> bool:
    """A word of the text layer sits in its element: across within half a point, its middle inside (the height PyMuPDF
    gives a word is its font's ascent to descent, which may reach past the element's box)."""
    return element.x0 - 0.5 <= word.x0 and word.x1 <= element.x1 + 0.5 and element.y0 <= (word.y0 + word.y1) / 2 <= element.y1


def test_the_pdf_is_pdfa_2b_with_embedded_fonts_and_each_word_inside_its_element(archived):
    from ingest.reading.words import page_segments

    assert_pdfa_2b(archived.folder / "document.pdf")
    with pymupdf.open(archived.folder / "document.pdf") as doc:
        for page, stored in zip(doc, archived.meta["pages"]):
            words = page.get_text("words")
            assert [w[4] for w in words] == plain_words(stored["text"])  # word for word, in order
            r = page.rect
            spans = [(s.grid_box, [w.text for line in s.lines for w in line]) for s in page_segments(stored["text"])]
            k = 0
            for box, element_words in spans:
                el = pymupdf.Rect(r.width * box[0] / GRID, r.height * box[1] / GRID, r.width * box[2] / GRID,
                                  r.height * box[3] / GRID)
                for text in element_words:
                    assert words[k][4] == text
                    assert _word_in(pymupdf.Rect(words[k][:4]), el), (text, words[k][:4], el)
                    k += 1


# -- pages read turned, born-digital pages, no OCRmyPDF ------------------------------------------------------------
def test_a_page_read_turned_says_so_and_is_laid_out_as_read(tmp_path):
    from ingest.outputs.alto import write_alto

    page = {"index": 1, "text": PAGE_TEXTS[1], "run_id": 1,
            "stats": {"image_size": [1024, 724], "orientation": {"turned": 90}, "mode": "lossless"}}
    from ingest.reading.words import stored_layout

    layout = stored_layout(page)
    (f,) = write_alto(tmp_path, [layout], {"name": "quer.pdf", "page_count": 1}, {"id": 1, "model": "m"}, [page])
    tree = etree.parse(str(f))
    etree.XMLSchema(etree.parse(str(SCHEMA))).assertValid(tree)
    pg = tree.find(f".//{ALTO}Page")
    assert (pg.get("WIDTH"), pg.get("HEIGHT"), pg.get("ROTATION")) == ("1024", "724", "90")
    assert "turned 90 degrees clockwise" in tree.find(f".//{ALTO}processingStepSettings").text
    assert all(s.get("WC") is None for s in tree.iter(f"{ALTO}String"))  # no probabilities stored: no WC


def test_born_digital_pages_keep_their_own_text(tmp_path):
    from loguru import logger

    from ingest.outputs.pdfa import write_document_pdf

    doc = pymupdf.open(make_pdf(tmp_path / "digital.pdf", ["Original layer text"]))
    doc.insert_pdf(pymupdf.open(scanned_pdf(tmp_path / "scan.pdf", 1, size=(595, 842))))
    doc.save(tmp_path / "mixed.pdf")
    pages = [{"index": 1, "text": "<|det|>text [100, 100, 900, 200]<|/det|>model text one",
              "stats": {"image_size": [724, 1024]}},
             {"index": 2, "text": PAGE_TEXTS[1], "stats": {"image_size": [724, 1024]}}]
    js = tmp_path / "document.json"
    js.write_text(json.dumps({"pages": pages}), encoding="utf-8")
    said = []
    sink = logger.add(said.append, level="WARNING", format="{message}")
    try:
        kind = write_document_pdf(tmp_path / "document.pdf", tmp_path / "mixed.pdf", "pdf", pages, js)
    finally:
        logger.remove(sink)
    with pymupdf.open(tmp_path / "document.pdf") as out:
        first, second = (p.get_text("text") for p in out)
    assert "Original layer text" in first and "model text one" not in first
    assert " ".join(second.split()) == " ".join(plain_words(PAGE_TEXTS[1]))
    assert (kind, said) == ("pdfa-2b", [])  # with any Ghostscript or none (tests/test_pdfa.py: both)
    assert_pdfa_2b(tmp_path / "document.pdf")


def test_without_ocrmypdf_the_searchable_pdf_is_written_and_the_reason_logged(tmp_path, monkeypatch):
    from loguru import logger

    from ingest.outputs.pdfa import write_document_pdf

    monkeypatch.setitem(sys.modules, "ocrmypdf", None)  # import ocrmypdf -> ImportError
    pages = [{"index": 1, "text": PAGE_TEXTS[1], "stats": {"image_size": [768, 1024]}}]
    said = []
    sink = logger.add(said.append, level="WARNING", format="{message}")
    try:
        kind = write_document_pdf(tmp_path / "document.pdf", scanned_pdf(tmp_path / "s.pdf", 1), "pdf", pages,
                                  tmp_path / "unused.json")
    finally:
        logger.remove(sink)
    assert kind == "searchable" and "OCRmyPDF is not installed" in said[0]
    with pymupdf.open(tmp_path / "document.pdf") as out:
        assert "Ελληνικά" in out[0].get_text("text")


def test_outputs_formats_default_and_json_is_kept(tmp_path):
    from ingest.config import load_settings
    from ingest.errors import ConfigError
    from tests.conftest import write_config

    assert load_settings(write_config(tmp_path)).outputs.formats == ["md", "json", "pdf", "alto"]
    with pytest.raises(ConfigError, match="keep \"json\" in outputs.formats"):
        load_settings(write_config(tmp_path, outputs={"formats": ["md", "alto"]}))
    with pytest.raises(ConfigError, match="outputs.formats"):
        load_settings(write_config(tmp_path, outputs={"formats": ["json", "docx"]}))


def test_a_rerun_rewrites_every_format(tmp_path, tiny_model_dir):
    """The tiny random model writes anything (stray markup included): every ALTO file still validates, and a
    re-run rewrites ALTO, hOCR and the PDF with the new run's pages."""
    cfg = worker_config(tmp_path, tiny_model_dir, engine={"max_tokens_per_page": 8},
                        outputs={"formats": ["md", "json", "pdf", "alto", "hocr"]})
    r = uflash("--config", str(cfg), "run", str(scanned_pdf(tmp_path / "in" / "akte.pdf", 2)), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    folder = tmp_path / "outbox" / "akte"
    files = [folder / "alto" / "0001.xml", folder / "alto" / "0002.xml", folder / "document.hocr",
             folder / "document.pdf"]
    before = {f: f.stat().st_mtime_ns for f in files}
    r = uflash("--config", str(cfg), "rerun", "--doc", "1", "--mode", "plain", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert all(f.stat().st_mtime_ns > before[f] for f in files)
    meta = json.loads((folder / "document.json").read_text(encoding="utf-8"))
    schema = etree.XMLSchema(etree.parse(str(SCHEMA)))
    for f, page in zip(files[:2], meta["pages"]):
        tree = etree.parse(str(f))
        schema.assertValid(tree)
        assert [s.get("CONTENT") for s in tree.iter(f"{ALTO}String")] == plain_words(page["text"])
        assert tree.find(f".//{ALTO}processingDateTime").text == meta["run"]["started_at"]


# -- uflash as OCRmyPDF's engine ----------------------------------------------------------------------------------
@needs_demo
def test_ocrmypdf_with_the_uflash_plugin_writes_the_text_uflash_run_writes(tmp_path):
    """A 2-page scan: ``ocrmypdf --plugin ingest.commands.ocrmypdf_plugin`` (demo model, CPU) writes a PDF/A whose text, page
    by page and word for word, is what ``uflash run`` writes for the same file."""
    from ingest.synth.documents import make_document
    from tests.conftest import write_config

    data, _ = make_document(880_100, 2, scan=True)
    scan = tmp_path / "scan.pdf"
    scan.write_bytes(data)
    cfg = write_config(tmp_path, model={"path": str(DEMO), "device": "cpu", "dtype": "float32"},
                       engine={"max_pages_per_chunk": 4}, outputs={"formats": ["md", "json"]})
    r = uflash("--config", str(cfg), "run", str(scan), timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    meta = json.loads((tmp_path / "outbox" / "scan" / "document.json").read_text(encoding="utf-8"))
    assert all(plain_words(p["text"]) for p in meta["pages"])
    out = tmp_path / "ocrmypdf.pdf"
    r = subprocess.run([sys.executable, "-m", "ocrmypdf", "--plugin", "ingest.commands.ocrmypdf_plugin", "--uflash-config",
                        str(cfg), str(scan), str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    with pymupdf.open(out) as doc:
        assert [[w[4] for w in page.get_text("words")] for page in doc] == \
            [plain_words(p["text"]) for p in meta["pages"]]
    assert_pdfa_2b(out)
    with pikepdf.open(out) as pdf:
        assert "uflash" in str(pdf.open_metadata().get("xmp:CreatorTool"))


def test_a_page_read_turned_is_shown_turned_in_the_pdfa_with_its_words_upright(tmp_path):
    from ingest.outputs.pdfa import write_document_pdf

    img = Image.new("L", (1200, 1600), 255)
    ImageDraw.Draw(img).rectangle([0, 0, 200, 200], fill=0)  # a mark in the scan's top left corner
    img.save(tmp_path / "mark.png")
    doc = pymupdf.open()
    doc.new_page(width=576, height=768).insert_image(pymupdf.Rect(0, 0, 576, 768), filename=str(tmp_path / "mark.png"))
    doc.save(tmp_path / "sideways.pdf")
    pages = [{"index": 1, "text": "<|det|>title [0, 0, 500, 100]<|/det|>Oben links",
              "stats": {"image_size": [1024, 768], "orientation": {"turned": 90}}}]
    (tmp_path / "document.json").write_text(json.dumps({"pages": pages}), encoding="utf-8")
    kind = write_document_pdf(tmp_path / "document.pdf", tmp_path / "sideways.pdf", "pdf", pages,
                              tmp_path / "document.json")
    assert kind == "pdfa-2b"
    assert_pdfa_2b(tmp_path / "document.pdf")
    with pymupdf.open(tmp_path / "document.pdf") as out:
        page = out[0]
        assert page.rect.width > page.rect.height  # shown as read: landscape
        pix = page.get_pixmap(dpi=20)
        assert pix.pixel(pix.width - 2, 1) == (0, 0, 0)  # turned 90 degrees clockwise: the mark is top right
        words = page.get_text("words")
        assert [w[4] for w in words] == ["Oben", "links"]
        title = pymupdf.Rect(0, 0, page.rect.width * 500 / GRID, page.rect.height * 100 / GRID)
        # words as displayed (PyMuPDF gives a turned page's words unturned)
        assert all(_word_in(pymupdf.Rect(w[:4]) * page.rotation_matrix, title) for w in words), words
