"""The shipped demo model (models/demo) through the engine: exactness on real box markup, and the drafters that
follow it. Skips cleanly when the folder is absent (a checkout without the weights)."""

from __future__ import annotations

import pymupdf
import pytest
import torch

from engine.drafters.markup import MarkupDrafter
from engine.drafters.suffix_match import ReferenceDrafter
from tests.conftest import DEMO, needs_demo

SEEDS = range(880_000, 880_010)  # held out: below the generator's training seeds (>= 1,000,000)
MAX_NEW_TOKENS = 400  # > 3x the 128-token window

pytestmark = [needs_demo,
              pytest.mark.usefixtures("one_torch_thread")]  # a busy 2-core box makes two OpenMP threads spin


@pytest.fixture(scope="module")
def demo():
    from engine.model.load import load_model

    torch.manual_seed(0)
    return load_model(str(DEMO), "cpu", "float32")


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_markup_drafter_drafts_header_punctuation(demo):
    tok = demo.tokenizer
    drafter = MarkupDrafter(tok)
    earlier = ids(tok, "<|det|>sub_title [1, 2, 3, 4]<|/det|>Intro\n")
    header = ids(tok, "<|det|>sub_title [130, 206, 460, 277]<|/det|>")

    def after(text: str) -> list[int]:
        return drafter.propose(earlier + ids(tok, text), 16)

    assert drafter.propose(earlier, 8) == []  # in text: not its part
    assert after("<|det|>") == ids(tok, "sub_title [")  # the label the output used last
    assert after("<|det|>ti") == ids(tok, "tle [")  # a common label it can still be
    assert after("<|det|>sub_title [") == []  # a coordinate comes next
    assert after("<|det|>sub_title [130") == ids(tok, ", ")
    assert after("<|det|>sub_title [130,") == ids(tok, " ")
    assert after("<|det|>sub_title [130, 206, 460, 277") == ids(tok, "]") + [tok.convert_tokens_to_ids("<|/det|>")]
    assert after("<|det|>sub_title [130, 206, 460, 277]") == [tok.convert_tokens_to_ids("<|/det|>")]
    assert drafter.propose(earlier + header, 8) == []  # the header is closed: text follows
    assert after("<|det|>sub_title [130") == ids(tok, ", ")  # any k, any order of calls


def test_reference_resumes_after_a_header_and_stays_out_of_it(demo):
    tok = demo.tokenizer
    layer = "First block line\nSecond block here"
    reference = ReferenceDrafter(tok, [layer])
    first = ids(tok, "<|det|>text [1, 2, 3, 4]<|/det|>First block line\n")
    assert reference.propose(first, 4) != []
    second_header = ids(tok, "<|det|>text [5, 6, 7, 8]")
    assert reference.propose(first + second_header, 4) == []  # inside a header: nothing from the page's words
    closed = first + second_header + ids(tok, "]<|/det|>")
    assert reference.propose(closed, 6) == ids(tok, "Second block here")[:6]  # the next element's text
    assert reference.propose(closed + ids(tok, "Se"), 4) == ids(tok, "Second block here")[2:6]


def test_demo_model_plain_and_lossless_equal_official_on_10_pages(demo):
    """On the demo model, 10 held-out synthetic pages (text layer as the reference), fp32, CPU: plain and lossless
    (reference + markup + ngram), each with the 10 pages in one batch, emit official generate()'s tokens exactly
    for every page."""
    from engine.batch.engine import BatchEngine
    from engine.official import official_generate
    from ingest.synth.documents import make_document, render_pages

    images, layers = [], []
    for seed in SEEDS:
        pdf, _labels = make_document(seed, 1)
        with pymupdf.open(stream=pdf, filetype="pdf") as doc:
            layers.append(doc[0].get_text())
        images.append(render_pages(pdf)[0])
    expected = [official_generate(demo, [image], "single", MAX_NEW_TOKENS).output_ids for image in images]
    assert all(len(ids) > 128 for ids in expected)
    plain = BatchEngine(demo, "plain", max_batch=len(images))
    results = plain.run([plain.prepare([image], MAX_NEW_TOKENS) for image in images])
    assert [r.output_ids for r in results] == expected
    lossless = BatchEngine(demo, "lossless", max_batch=len(images), drafters=("reference", "markup", "ngram"))
    results = lossless.run([lossless.prepare([image], MAX_NEW_TOKENS, reference_texts=[layer])
                            for image, layer in zip(images, layers)])
    assert [r.output_ids for r in results] == expected
    accepted = {name: sum(r.stats["drafters"].get(name, {}).get("accepted", 0) for r in results)
                for name in ("reference", "markup")}
    assert accepted["reference"] > 0 and accepted["markup"] > 0, accepted


def sentence_page(text: str):
    """A sentence typed on an A4 page as office software would (16 pt Helvetica from the top-left margin), rendered
    the way uflash renders PDFs."""
    from ingest.synth.documents import render_pages
    from scripts.eval.demo import typed_sentence_pdf

    return render_pages(typed_sentence_pdf(text, 72))[0]


def test_demo_model_reads_sentences_the_test_chooses(demo):
    """A page rendered from a sentence this test chooses (plain English, mostly words the generator's word
    list lacks) comes back in the page's Markdown, CER <= 5% (and each of six such sentences at <= 10%, mean <= 5%).
    Decoded the way uflash decodes (lossless engine, token-identical to official)."""
    from rapidfuzz.distance import Levenshtein

    from engine.batch.engine import BatchEngine
    from engine.official import decode_text
    from ingest.reading.text import page_markdown
    from scripts.eval.demo import OPEN_SENTENCES

    engine = BatchEngine(demo, "lossless", max_batch=len(OPEN_SENTENCES))
    results = engine.run([engine.prepare([sentence_page(sentence)], 200) for sentence in OPEN_SENTENCES])
    cers = {}
    for sentence, res in zip(OPEN_SENTENCES, results):
        read = " ".join(page_markdown(decode_text(demo, res.output_ids)).split())
        cers[sentence] = Levenshtein.distance(read, sentence) / len(sentence)
    chosen = "The quick brown fox jumps over the lazy dog near the river bank."
    assert cers[chosen] <= 0.05, cers
    assert max(cers.values()) <= 0.10 and sum(cers.values()) / len(cers) <= 0.05, cers
