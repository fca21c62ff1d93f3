"""Page figures (ingest.quality.measures), the log-probabilities the decoders record, and fast mode's relaxed acceptance."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.batch.acceptance import accept
from engine.batch.engine import BatchEngine
from engine.chunk_decode import EngineDecoder
from engine.model.load import load_model
from engine.ngram_rule import NoRepeatNgramRule
from engine.official import official_generate
from ingest.quality.measures import (
    Thresholds,
    distinct_n,
    edit_distance,
    finish_reason,
    loop_tail,
    looping,
    normalized_edit_distance,
    page_quality,
)
from tests.conftest import text_page


def _dp_distance(a, b) -> int:
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def test_edit_distance_equals_the_textbook_dp():
    rng = random.Random(7)
    for _ in range(500):
        a = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 90)))
        b = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 90)))
        assert edit_distance(a, b) == _dp_distance(a, b)
    assert edit_distance([1, 2, 3], [1, 3]) == 1  # token lists too
    assert normalized_edit_distance("", "") == 0.0 and normalized_edit_distance("abc", "") == 1.0
    assert normalized_edit_distance("kitten", "sitting") == pytest.approx(3 / 7)


def test_distinct_and_loops():
    clean = list(range(300))
    assert distinct_n(clean, 20) == 1.0 and distinct_n(clean[:10], 20) is None
    line = list(range(100, 220))  # a 120-token line repeated: an exact loop beyond the rule's 128 window
    looped = list(range(40)) + line * 4
    assert loop_tail(looped) == (120, 480)
    assert distinct_n(looped, 20) < 0.4
    assert loop_tail(clean) is None and not looping(clean)
    near = []  # a short loop the no-repeat rule forces to vary: a different token every 30
    for i in range(300):
        near.append(5 if i % 2 else 6)
        if i % 30 == 29:
            near.append(1000 + i)
    assert loop_tail(near) is None and looping(near)


def test_finish_reason_repetition_only_when_out_of_room():
    looped = [1, 2, 3, 4] * 50
    assert finish_reason("length", looped) == "repetition"
    assert finish_reason("context_limit", looped) == "repetition"
    assert finish_reason("eos", looped) == "eos"  # it stopped on its own: Distinct-n judges the rest
    assert finish_reason("context_limit", list(range(400))) == "context_limit"
    assert finish_reason("page_separator", list(range(50))) == "page_separator"


def test_page_quality():
    ids = list(range(400))
    q = page_quality("eos", ids, [-0.01] * 399 + [-3.0], "Register of deeds, 1851. " * 8,
                     "Register of deeds, 1851. " * 8)
    assert q["finish_reason"] == "eos" and q["distinct_20"] == 1.0 and q["distinct_35"] == 1.0
    assert q["min_logprob"] == -3.0 and q["mean_logprob"] == pytest.approx((399 * -0.01 - 3.0) / 400, abs=1e-4)
    assert q["low_confidence_share"] == pytest.approx(1 / 400, abs=1e-4) and q["text_layer_ned"] == 0.0
    assert page_quality("eos", ids, [], "x", None)["text_layer_ned"] is None  # no text layer: no comparison
    looped = page_quality("length", [7, 8, 9] * 100, [-0.2] * 300, "abc" * 100, None)
    assert looped["finish_reason"] == "repetition"


# -- log-probabilities and fast mode on a tiny random model -------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(str(tiny_model_dir), "cpu", "float32")
    torch.set_num_threads(previous)


def generate(loaded, pages, max_new: int, mode: str, replay_ids=None, **options):
    engine = BatchEngine(loaded, mode, **options)
    return engine.run([engine.prepare(pages, max_new, replay_ids=replay_ids,
                                      reference_texts=["page 1 line", "page 2"] if len(pages) == 2 else None)])[0]


def test_every_mode_records_the_same_logprobs(loaded):
    pages = [text_page(1), text_page(2)]
    official = official_generate(loaded, pages, "multi", 60)
    assert len(official.logprobs) == len(official.output_ids) == 60
    for mode in ("plain", "lossless"):
        res = generate(loaded, pages, 60, mode)
        assert res.output_ids == official.output_ids
        assert res.logprobs == pytest.approx(official.logprobs, abs=1e-4)
    assert all(lp <= 0.0 for lp in official.logprobs)


def test_chunk_pages_carry_their_ids_and_logprobs(loaded):
    decoder = EngineDecoder(BatchEngine(loaded, "plain"))
    out = decoder.decode([text_page(3)], context_limit=4096, max_new_tokens=40)
    page = out.pages[0]
    assert page.ids == out.output_ids and len(page.logprobs) == 40 and page.stats["mode"] == "plain"


def test_fast_acceptance_takes_a_likely_draft_and_then_the_targets_token():
    """A step's rows (`engine.model.forward.summarize`): row 0 judges draft d1 = 5 where the target prefers 3."""
    probs0 = torch.full((10,), 0.1 / 8)
    probs0[3], probs0[5] = 0.6, 0.3
    logits0 = probs0.log()
    logits1 = torch.zeros(10)
    logits1[7] = 4.0
    lse0, lse1 = float(torch.logsumexp(logits0, 0)), float(torch.logsumexp(logits1, 0))
    rows = [(3, float(logits0[3]), lse0, float(logits0[5]), 5), (7, 4.0, lse1, 0.0, 5)]
    row = [logits0, logits1].__getitem__

    def run(**options):
        return accept(rows, 1, NoRepeatNgramRule(35, 128, []), eos_token_id=1, logits_row=row, **options)

    lossless = run()
    assert lossless.emitted == [3] and lossless.relaxed == 0
    assert lossless.logprobs == [pytest.approx(math.log(0.6), abs=1e-5)]
    assert run(fast_threshold=0.31).emitted == [3]  # below the threshold: the target's own token
    fast = run(fast_threshold=0.29)
    assert fast.emitted == [5, 7] and fast.relaxed == 1  # then the target's choice after the relaxed draft
    assert fast.logprobs[0] == pytest.approx(math.log(0.3), abs=1e-5)
    assert run(fast_threshold=1e-9, strict_ids=frozenset({5})).emitted == [3]  # never EOS / page separator


def test_fast_mode_is_complete_and_lossless_at_threshold_one(loaded):
    pages = [text_page(5)]
    lossless = generate(loaded, pages, 80, "lossless")
    wrong = [(t + 3) % 300 for t in lossless.output_ids]  # a replay draft that is always a bit wrong
    exact = generate(loaded, pages, 80, "fast", replay_ids=wrong, fast_threshold=1.0, adaptive_width=False)
    assert exact.output_ids == lossless.output_ids
    loose = generate(loaded, pages, 80, "fast", replay_ids=wrong, fast_threshold=1e-6, adaptive_width=False)
    assert loose.stats["mode"] == "fast" and loose.stats["relaxed_tokens"] > 0
    assert len(loose.output_ids) == 80  # never truncated: runs to the same limit
    assert loose.output_ids != lossless.output_ids


def test_quality_and_fast_settings_come_from_config_toml(tmp_path):
    from ingest.config import load_settings
    from ingest.errors import ConfigError
    from tests.conftest import write_config

    s = load_settings(write_config(tmp_path, quality={"mean_logprob_fair": -0.2, "loop_min_tokens": 64},
                                   engine={"mode": "fast", "fast_threshold": 0.5}))
    from ingest.quality.calibration import grading_thresholds

    t = grading_thresholds(s).thresholds  # the keys set in the config over the model's (here: none) calibration
    assert (t.mean_logprob_fair, t.loop_min_tokens, t.distinct_20_poor) == (-0.2, 64, Thresholds().distinct_20_poor)
    assert (s.engine.mode, s.engine.fast_threshold) == ("fast", 0.5)
    for bad in ({"quality": {"no_such_threshold": 1}}, {"quality": {"distinct_20_poor": "high"}},
                {"engine": {"fast_threshold": 0.0}}):
        with pytest.raises(ConfigError):
            load_settings(write_config(tmp_path, **bad))
