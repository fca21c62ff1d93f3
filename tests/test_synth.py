"""The synthetic document generator (ingest/synth): determinism, label format, density, text layer, scans."""

from __future__ import annotations

import re

import numpy as np
import pymupdf
import pytest

from ingest.synth.documents import (
    HELD_OUT_LIMIT,
    join_pages,
    layout_labels,
    make_document,
    page_arrays,
    render_pages,
    strip_markup,
)

ELEMENT = re.compile(r"^<\|det\|>(\w+) \[(\d+), (\d+), (\d+), (\d+)\]<\|/det\|>(.*)$", re.DOTALL)
LABELS = {"title", "sub_title", "text", "list", "table", "header", "footer"}


def _elements(label: str) -> list[tuple]:
    parts = label.split("<|det|>")[1:]
    out = []
    for part in parts:
        m = ELEMENT.match("<|det|>" + part.rstrip("\n"))
        assert m, f"bad element: {part[:80]!r}"
        out.append((m.group(1), *map(int, m.groups()[1:5]), m.group(6)))
    return out


def test_same_seed_same_document_and_labels():
    a, b = make_document(1234, 2), make_document(1234, 2)
    assert a == b
    assert make_document(1235, 2)[1] != a[1]
    assert layout_labels(1234, 2) == a[1]  # labels without drawing are the same


def test_label_format_and_boxes_on_the_999_grid():
    for seed in range(20):
        for label in layout_labels(seed, 2):
            assert label.startswith("<|det|>")
            for name, x1, y1, x2, y2, text in _elements(label):
                assert name in LABELS
                assert 0 <= x1 <= x2 <= 999 and 0 <= y1 <= y2 <= 999
                assert text.strip()
                if name == "table":
                    assert text.startswith("<table><tr><td>") and text.endswith("</td></tr></table>")


def test_pages_average_at_least_300_characters_and_use_several_fonts():
    chars, fonts, chinese = [], set(), 0
    for seed in range(30):
        doc = pymupdf.open(stream=make_document(seed, 1)[0], filetype="pdf")
        chars.append(len(strip_markup(layout_labels(seed, 1)[0])))
        fonts.update(f[3] for f in doc[0].get_fonts())
        chinese += any("\u4e00" <= ch <= "\u9fff" for ch in layout_labels(seed, 1)[0])
    assert sum(chars) / len(chars) >= 300
    assert len({f.split("-")[0] for f in fonts}) >= 2, fonts
    assert chinese >= 1


def test_pdf_has_a_text_layer_matching_the_labels():
    pdf, labels = make_document(7, 2)
    with pymupdf.open(stream=pdf, filetype="pdf") as doc:
        assert doc.page_count == 2
        for page, label in zip(doc, labels):
            layer = " ".join(page.get_text().split())
            first = _elements(label)[0][-1].split("\n")[0]
            assert first.split()[0] in layer


def test_scan_mode_has_no_text_layer_but_the_same_labels():
    pdf, labels = make_document(7, 2, scan=True)
    assert labels == make_document(7, 2)[1]
    with pymupdf.open(stream=pdf, filetype="pdf") as doc:
        for page in doc:
            assert page.get_text().strip() == ""
            assert page.get_images()


def test_render_and_training_arrays_agree():
    pdf, _ = make_document(9, 1)
    image = render_pages(pdf, 1024)[0]
    assert max(image.size) == 1024 and image.mode == "RGB"
    square, label = page_arrays(9, 1, 1024)[0]
    assert square.shape == (1024, 1024) and label == make_document(9, 1)[1][0]
    x0 = (1024 - image.width) // 2
    gray = np.asarray(image.convert("L"), dtype=int)
    assert np.abs(square[:, x0 : x0 + image.width].astype(int) - gray).max() <= 1
    assert (square[:, : x0] == 127).all()  # gray padding like the processor


def test_join_pages_and_strip_markup():
    labels = layout_labels(3, 2)
    assert join_pages(labels[:1]) == labels[0]
    joined = join_pages(labels)
    assert joined.startswith("<PAGE><|det|>") and joined.count("<PAGE>") == 2
    text = strip_markup("<|det|>table [1, 2, 3, 4]<|/det|><table><tr><td>a</td><td>b c</td></tr></table>\n"
                        "<|det|>text [1, 2, 3, 4]<|/det|>x\ny")
    assert text == "a b c x y"
    assert HELD_OUT_LIMIT == 1_000_000


@pytest.mark.parametrize("kind", ["words"])
def test_word_pages(kind):
    (arr, label), = page_arrays(0, 1, 256, kind=kind)
    assert arr.shape == (256, 256) and _elements(label)[0][0] == "title"


def test_character_grid_marks_every_visible_character():
    (arr, label, grid), = page_arrays(5, 1, 1024, chars=True)
    assert grid.shape == (64, 128)
    visible = sum(not ch.isspace() for ch in strip_markup(label).replace(" ", ""))
    assert 0.8 * visible <= (grid > 0).sum() <= visible  # a few share a cell
    (_, _, none), = page_arrays(5, 1, 1024, scan_prob=1.0, chars=True)
    assert none is None  # scan-like pages (rotated) have no grid


def test_eval_sentence_pages_carry_their_sentence():
    """scripts/eval/demo.py's sentence sets: the rendered page holds exactly the sentence it is scored on."""
    import pymupdf

    from scripts.eval.demo import OPEN_SENTENCES, list_sentences, sentence_pdf

    for text in [OPEN_SENTENCES[0], *list_sentences(2, 820_000)]:
        with pymupdf.open(stream=sentence_pdf(text)) as doc:
            assert " ".join(doc[0].get_text().split()) == text


def test_open_words_put_pseudo_words_on_the_page():
    """``open_words``: that share of words becomes pseudo-words outside the word list, deterministically by seed,
    in the labels and in the text layer alike; 0 leaves every document as it was."""
    from ingest.synth.text import word_table

    listed = {w.lower() for w in word_table()[0]}
    assert layout_labels(4321, 2, open_words=0.0) == layout_labels(4321, 2)
    pdf, labels = make_document(4321, 2, open_words=0.3)
    assert (pdf, labels) == make_document(4321, 2, open_words=0.3)
    assert layout_labels(4321, 2, open_words=0.3) == labels
    words = [w.lower() for w in re.findall(r"[A-Za-z]{3,}", strip_markup(" ".join(labels)))]
    unlisted = sum(w not in listed for w in words) / len(words)
    assert 0.15 < unlisted < 0.45, unlisted
    with pymupdf.open(stream=pdf, filetype="pdf") as doc:
        layer = " ".join(" ".join(page.get_text().split()) for page in doc)
    assert all(w in layer.lower() for w in words if w not in listed)
    with pytest.raises(ValueError):
        make_document(1, 1, open_words=1.5)


def test_sparse_pages_are_nearly_empty_and_only_a_share_of_training_documents():
    """kind="sparse": one to three body elements anywhere on the page, no running header, deterministic; the
    text layer holds the labels' words. `demo_data.sparse_document` draws a fixed share of training seeds."""
    from scripts.train.demo_data import sparse_document

    tops = []
    for seed in range(50_000, 50_020):
        pdf, labels = make_document(seed, 1, kind="sparse")
        assert (pdf, labels) == make_document(seed, 1, kind="sparse")
        els = _elements(labels[0])
        body = [e for e in els if e[0] != "footer"]
        assert 1 <= len(body) <= 3 and all(e[0] in {"text", "sub_title", "list"} for e in body), labels[0]
        assert len(strip_markup(labels[0])) < 900
        tops.append(body[0][2])
        with pymupdf.open(stream=pdf, filetype="pdf") as doc:
            layer = " ".join(doc[0].get_text().split())
        assert strip_markup(body[0][5]).split()[0] in layer
    assert min(tops) < 300 < max(tops)  # the first element is not always at the top
    share = sum(sparse_document(s, 0.15) for s in range(HELD_OUT_LIMIT, HELD_OUT_LIMIT + 4000)) / 4000
    assert 0.12 < share < 0.18 and not any(sparse_document(s, 0.0) for s in range(1000))
