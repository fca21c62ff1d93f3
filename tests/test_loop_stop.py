"""A page that runs into a repetition loop ends while it happens (`engine.batch.loop_watch`), token-exact up to the
stop: a tiny model planted to loop (CPU, fp32), the pipeline's repetition rule (`ingest.quality.measures`)."""

from __future__ import annotations

import pytest
import torch

from engine.batch.engine import BatchEngine
from engine.chunk_decode import EngineDecoder
from engine.model.load import load_model
from engine.model.tiny import build_tiny_model
from engine.official import chunk_inputs, official_generate
from ingest.quality.measures import loop_stopper, looping
from scripts.bench.engine import plant_successor_chain
from tests.conftest import text_page

# one page: an exact loop (its no-repeat rule, 35-grams over the last 128 tokens, allows a unit this long); two
# pages: the multi-page rule (35-grams over 1,024 tokens) bans every exact repeat, so the model runs a near-loop
PERIODS = {1: 150, 2: 100}
TOKENS = 800

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def loopers(tmp_path_factory):
    """period -> a tiny model whose greedy output, from either prompt, walks one cycle of that many tokens for ever."""
    folder = build_tiny_model(tmp_path_factory.mktemp("loop") / "m", sliding_window=8)
    made = {}
    for period in sorted(set(PERIODS.values())):
        loaded = made[period] = load_model(str(folder), "cpu", "float32")
        entries = tuple({chunk_inputs(loaded, [text_page(i) for i in range(n)], kind)["input_ids"][0, -1].item()
                         for n, kind in ((1, "single"), (2, "multi"))})
        reserved = {loaded.eos_token_id, loaded.bos_token_id, loaded.image_token_id, loaded.page_sep_id}
        with torch.no_grad():
            plant_successor_chain(loaded.model, reserved | set(loaded.tokenizer.all_special_ids), seed=3, scale=30.0,
                                  cycle=period, entries=entries)
            loaded.model.lm_head.weight[loaded.eos_token_id].zero_()
    return made


def loop_start(ids: list[int], period: int) -> int:
    """Where the repetition begins: the first token that repeats the one ``period`` tokens before it."""
    return next(i for i in range(period, len(ids)) if ids[i] == ids[i - period])


@pytest.mark.parametrize("pages", [1, 2])
def test_a_planted_loop_ends_within_500_tokens_of_its_start_and_token_exact(loopers, pages):
    """Plain and lossless stop at the same token, within 500 tokens of where the repetition began, with what
    ``generate()`` emits up to there, finish reason ``repetition``; without the watch the chunk runs to its limit."""
    looper = loopers[PERIODS[pages]]
    images = [text_page(i) for i in range(pages)]
    reference = official_generate(looper, images, "single" if pages == 1 else "multi", TOKENS).output_ids
    assert len(reference) == TOKENS and looping(reference)  # without the watch: to the limit, in a loop
    start = loop_start(reference, PERIODS[pages])
    ends = {}
    for mode in ("plain", "lossless"):
        engine = BatchEngine(looper, mode, max_batch=2, loop_check=loop_stopper())
        (res,) = engine.run([engine.prepare(images, TOKENS)])
        assert res.finish_reason == "repetition"
        assert res.output_ids == reference[: len(res.output_ids)]
        ends[mode] = len(res.output_ids)
    assert ends["plain"] == ends["lossless"]
    assert ends["plain"] - start <= 500 and ends["plain"] % 64 == 0


def test_the_stopped_page_is_graded_as_a_loop_and_its_chunk_goes_back_without_it(loopers):
    """Through the chunk decoder: a one-page chunk keeps its page, finish reason ``repetition``; a two-page chunk
    stopped on its first page keeps no page and asks for its pages back (the page alone, then the rest)."""
    from ingest.worker.outcome import requeue_rule

    decoder = EngineDecoder(BatchEngine(loopers[PERIODS[1]], "lossless", max_batch=2, loop_check=loop_stopper()))
    one = decoder.decode([text_page(0)], 8192, TOKENS)
    assert one.finish_reason == "repetition" and one.pages[0].stats["finish_reason"] == "repetition"
    two = decoder.decode([text_page(0), text_page(1)], 8192, TOKENS)
    assert two.finish_reason == "repetition" and two.requeue and not two.pages
    assert requeue_rule(3, 4, len(two.pages), two.finish_reason) == [(3, 3), (4, 4)]
