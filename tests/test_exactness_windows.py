"""Exactness where the multi-page no-repeat rule's 1024-token window slides (CPU, fp32): a chunk decoded long enough
that the window has left the prompt behind and tokens the rule would ban over the whole sequence are allowed again
(so an engine that ignored the window, or counted it from the wrong place, would emit other tokens), and a 4-page
chunk of the shipped demo model decoded losslessly with its block drafter, both token for token against
transformers' own greedy ``generate()``."""

from __future__ import annotations

import pytest

from engine.batch.engine import BatchEngine
from engine.model.load import load_model
from engine.model.tiny import build_tiny_model
from engine.ngram_rule import NoRepeatNgramRule
from engine.official import official_generate
from tests.conftest import DEMO, needs_demo, text_page

WINDOW, NGRAM = 1024, 35  # the official multi-page rule

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def decided_by_the_slide(prompt_ids: list[int], output_ids: list[int]) -> list[int]:
    """Output positions whose token the rule over the whole sequence would ban but the 1024-token window allows:
    the tokens an engine that ignored the window could not emit."""
    windowed, whole = NoRepeatNgramRule(NGRAM, WINDOW, prompt_ids), NoRepeatNgramRule(NGRAM, 10**9, prompt_ids)
    slid = []
    for i, token in enumerate(output_ids):
        assert token not in windowed.banned(), i  # official output obeys the windowed rule
        if token in whole.banned():
            slid.append(i)
        windowed.extend([token])
        whole.extend([token])
    return slid


def test_the_multi_page_window_slides_past_the_prompt_and_decides_tokens_the_engine_emits(tmp_path):
    """A looping tiny model (the rule keeps firing) on a 3-page chunk for 1,300 tokens, beside a single-page chunk:
    the window ends wholly inside the output, tokens past position ~1,130 are ones only the sliding window allows,
    and plain and lossless batches emit official's tokens exactly."""
    loaded = load_model(str(build_tiny_model(tmp_path / "loop", sliding_window=8, seed=0, text_init=0.02)), "cpu",
                        "float32")
    long_chunk, single = [text_page(i) for i in (1, 2, 3)], [text_page(0)]
    official = official_generate(loaded, long_chunk, "multi", 1300)
    expected, beside = official.output_ids, official_generate(loaded, single, "single", 200).output_ids
    assert official.ngram_window == WINDOW and len(expected) == 1300
    assert len(expected) > WINDOW + len(official.prompt_ids)  # the window has left the prompt behind
    slid = decided_by_the_slide(official.prompt_ids, expected)
    assert len(slid) > 50 and min(slid) > WINDOW, slid[:5]  # decided by the slide, not once but many times
    for mode in ("plain", "lossless"):  # every step as wide as its draft: what is accepted does not hang on timing
        engine = BatchEngine(loaded, mode, max_batch=2, adaptive_width=False)
        results = engine.run([engine.prepare(long_chunk, 1300), engine.prepare(single, 200)])
        assert [r.output_ids for r in results] == [expected, beside], mode
        if mode == "lossless":  # the drafts took part where the slide decided
            assert results[0].stats["accepted_tokens"] > len(expected) // 3


@needs_demo
def test_a_four_page_demo_chunk_is_lossless_with_the_block_drafter():
    """The demo model's own 4-page chunk of scan-like pages (what a user's document becomes through the pipeline):
    its prompt alone is longer than the rule's window, and 1,100 tokens later the window lies inside the output;
    lossless with the shipped block drafter (the only drafter) emits official generate()'s tokens exactly, most of
    them drafted by the block drafter."""
    from engine.loading import load_block_drafter
    from ingest.synth.documents import make_document, render_pages

    demo = load_model(str(DEMO), "cpu", "float32")
    pdf, _labels = make_document(880_200, 4, scan=True)  # held out: below the generator's training seeds
    pages = render_pages(pdf)
    max_new = 1100  # the whole chunk is ~2,500 tokens: the first 1,100 keep this test under a minute
    official = official_generate(demo, pages, "multi", max_new)
    expected = official.output_ids
    assert official.ngram_window == WINDOW and len(official.prompt_ids) > WINDOW  # slides from the first token
    assert len(expected) == max_new > WINDOW and expected.count(demo.page_sep_id) >= 2  # into the chunk's pages
    net = load_block_drafter(demo)
    assert net is not None
    engine = BatchEngine(demo, "lossless", block_net=net, drafters=("block",), adaptive_width=False)
    (result,) = engine.run([engine.prepare(pages, max_new)])
    assert result.output_ids == expected
    block = result.stats["drafters"]["block"]
    assert block["accepted"] > len(expected) // 2, block
