"""The engine against the official path, one chunk at a time (CPU, fp32, tiny random models): the no-repeat rule
against transformers' own processor, the rule firing, EOS, the chunk decoder's contract (pages, stats, context
limit), constant memory, the drafters. Batches of chunks: tests/test_batch_engine.py."""

from __future__ import annotations

import random

import pytest
import torch
from PIL import Image
from transformers import GenerationConfig
from transformers.models.unlimited_ocr.generation_unlimited_ocr import (
    UnlimitedOcrSlidingWindowNoRepeatNgramLogitsProcessor as OfficialRule,
)

from engine.batch.engine import BatchEngine
from engine.chunk_decode import EngineDecoder, OfficialDecoder, prompt_length
from engine.drafters.ngram import NgramDrafter
from engine.drafters.suffix_match import ReferenceDrafter, ReplayDrafter
from engine.loading import load_decoder
from engine.model.load import load_model
from engine.model.tiny import build_tiny_model, set_eos_scale
from engine.ngram_rule import NoRepeatNgramRule
from engine.official import official_generate, official_inputs
from tests.conftest import text_page as _page

LENGTHS = {4: 60, 8: 100, 128: 400}  # new tokens per window: >= 3x the window, and past 128


def _pages(n: int) -> list[Image.Image]:
    return [_page(i) for i in range(n)]


def _kind(n: int) -> str:
    return "single" if n == 1 else "multi"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny models by name, each built and loaded once: windows 4/8/128 and a looping one (init 0.02)."""
    root = tmp_path_factory.mktemp("exact")
    specs = {4: dict(sliding_window=4), 8: dict(sliding_window=8), 128: dict(sliding_window=128),
             "loop": dict(sliding_window=8, text_init=0.02)}
    return {name: load_model(str(build_tiny_model(root / str(name), seed=0, **spec)), "cpu", "float32")
            for name, spec in specs.items()}


@pytest.fixture(scope="module")
def official(models):
    """official_generate output ids, computed once per (model, pages)."""
    memo = {}

    def get(name, n_pages):
        if (name, n_pages) not in memo:
            max_new = LENGTHS.get(name, 200)
            memo[name, n_pages] = official_generate(models[name], _pages(n_pages), _kind(n_pages), max_new).output_ids
        return memo[name, n_pages]

    return get


def _corrupt(ids: list[int], vocab: int, how: str) -> list[int]:
    if how == "right":
        return list(ids)
    if how == "every_other":
        return [t if i % 2 == 0 else (t + 7) % vocab for i, t in enumerate(ids)]
    if how == "random_half":
        rng = random.Random(0)
        return [t if rng.random() < 0.5 else rng.randrange(vocab) for t in ids]
    if how == "wrong":  # every token shifted: never the target's choice
        return [(t + 1) % vocab for t in ids]
    raise ValueError(how)


# --- the rule ---------------------------------------------------------------------------------------------

def test_rule_equals_official_processor_with_drafted_tails():
    rng = random.Random(1)
    bans = 0
    for _ in range(120):
        n, window = rng.choice([(2, 5), (3, 8), (4, 3), (35, 128), (35, 1024)])
        vocab = 3 if n < 35 else 5
        period = rng.randint(1, 12)
        motif = [rng.randrange(vocab) for _ in range(period)]

        def token(i, motif=motif, period=period, vocab=vocab):  # mostly periodic: long n-grams repeat, the rule fires
            return motif[i % period] if rng.random() < 0.97 else rng.randrange(vocab)

        prompt = [token(i) for i in range(rng.randint(0, 150))]
        rule, seq, processor = NoRepeatNgramRule(n, window, prompt), list(prompt), OfficialRule(n, window)
        for _ in range(12):
            tail = [token(len(seq) + i) for i in range(rng.randint(0, 6))]
            for j in range(len(tail) + 1):
                full = seq + tail[:j]
                if not full:
                    continue
                scores = processor(torch.tensor([full]), torch.zeros(1, vocab))
                expected = {t for t in range(vocab) if scores[0, t] == -float("inf")}
                assert rule.banned(tail[:j]) == expected, (n, window, len(full))
                bans += bool(expected)
            new = [token(len(seq) + i) for i in range(rng.randint(1, 8))]
            rule.extend(new)
            seq += new
    assert bans > 100




def decode_ids(loaded, pages, max_new: int, mode: str = "lossless", replay_ids=None, **options) -> list[int]:
    engine = BatchEngine(loaded, mode, **options)
    return engine.run([engine.prepare(pages, max_new, replay_ids=replay_ids)])[0].output_ids


def decoder(loaded, mode: str = "lossless", **options) -> EngineDecoder:
    return EngineDecoder(BatchEngine(loaded, mode, **options))

@pytest.mark.parametrize("n_pages", [1, 3])
def test_no_repeat_ngram_rule_fires_and_engine_follows_it(models, official, n_pages):
    loaded, pages = models["loop"], _pages(n_pages)
    expected = official("loop", n_pages)
    inputs = official_inputs(loaded, pages, _kind(n_pages))
    no_rule = GenerationConfig(max_new_tokens=len(expected), do_sample=False, no_repeat_ngram_size=0,
                               eos_token_id=loaded.eos_token_id, pad_token_id=loaded.pad_token_id)
    with torch.inference_mode():
        greedy = loaded.model.generate(**inputs, generation_config=no_rule)[0, inputs["input_ids"].shape[1]:].tolist()
    fired = next(i for i, (a, b) in enumerate(zip(expected, greedy)) if a != b)  # StopIteration: never fired
    assert 35 <= fired < len(expected) - 50
    assert decode_ids(loaded, pages, len(expected), mode="plain") == expected
    assert decode_ids(loaded, pages, len(expected)) == expected  # the ngram drafter proposes the loop itself
    assert decode_ids(loaded, pages, len(expected), replay_ids=expected) == expected
    assert decode_ids(loaded, pages, len(expected), replay_ids=greedy) == expected  # drafts the banned tokens


def test_eos_finish(models):
    loaded = load_model(models[8].path, "cpu", "float32")  # a fresh copy: the EOS row changes
    set_eos_scale(loaded.model, 8.0, seed=2)  # EOS after 15 (1 page) and 21 (3 pages) tokens
    for n_pages in [1, 3]:
        pages = _pages(n_pages)
        expected = official_generate(loaded, pages, _kind(n_pages), 80)
        assert expected.finish_reason == "eos" and len(expected.output_ids) < 80
        ids = expected.output_ids
        for mode, replay in [("plain", None), ("lossless", ids + ids), ("lossless", ids[:-1] + [5, 6, 7])]:
            out = decoder(loaded, mode).decode(pages, context_limit=32768, max_new_tokens=80, replay_ids=replay)
            assert out.output_ids == ids and out.finish_reason == "eos", (n_pages, mode, replay)


# --- chunk decoder contract, memory -----------------------------------------------------------------------

def test_decode_returns_chunk_output_with_stats(models, official, equal_step_costs):
    loaded, pages = models[8], _pages(3)
    expected = official(8, 3)
    reference = OfficialDecoder(loaded).decode(pages, context_limit=32768, max_new_tokens=len(expected))
    dec = decoder(loaded, "lossless", k_max=8)
    out = dec.decode(pages, context_limit=32768, max_new_tokens=len(expected), replay_ids=expected,
                         reference_texts=["page 0 line 0", "page 1 line 0", "page 2 line 0"])
    assert out.output_ids == reference.output_ids == expected
    assert [p.text for p in out.pages] == [p.text for p in reference.pages]
    assert (out.finish_reason, out.requeue) == (reference.finish_reason, reference.requeue)
    stats = out.chunk_stats
    assert stats["tokens"] == stats["output_tokens"] == len(expected)
    assert stats["verify_rounds"] + stats["single_steps"] + 1 == stats["forwards"] < len(expected) // 4
    assert stats["drafters"]["replay"]["acceptance"] == 1.0 and set(stats["drafters"]) == {"reference", "replay",
                                                                                           "markup", "ngram"}
    assert stats["tau"] == round(stats["accepted_tokens"] / stats["verify_rounds"], 4) > 4
    steps = stats["draft_s"] + stats["verify_s"] + stats["single_s"]
    assert stats["prefill_s"] > 0 and 0 < stats["verify_s"] <= steps <= stats["wall_seconds"] + 1e-3  # parts of it
    assert stats["batch_rows"] == 1.0
    single = dec.decode(_pages(1), context_limit=32768, max_new_tokens=40)
    page = single.pages[0]  # one page: the chunk's counts are the page's
    assert page.stats["tokens"] == 40 and page.stats["batch_rows"] == 1.0 and page.stats["mode"] == "lossless"
    assert (page.stats["verify_rounds"], page.stats["single_steps"]) == (single.chunk_stats["verify_rounds"],
                                                                        single.chunk_stats["single_steps"])

    prompt = prompt_length(loaded, 3)
    cut = dec.decode(pages, context_limit=prompt + 26)
    assert cut.finish_reason == "context_limit" and cut.output_ids == expected[:26]
    assert dec.decode(pages, context_limit=prompt + 10).finish_reason == "no_room"
    assert dec.describe()["mode"] == "lossless"


def test_a_chunks_seconds_include_its_admission(models):
    """The vision and prefill of a chunk's admission (made 2 s slow here) are part of its seconds (and so of its
    tokens per second)."""
    import time

    engine = BatchEngine(models[8], "plain")
    real = engine.forward.prefill
    engine.forward.prefill = lambda *args, **kw: (time.sleep(2.0), real(*args, **kw))[1]
    out = EngineDecoder(engine).decode(_pages(1), context_limit=32768, max_new_tokens=5)
    assert out.chunk_stats["prefill_s"] >= 2.0
    assert out.chunk_stats["wall_seconds"] >= out.chunk_stats["prefill_s"]


def test_load_decoder_modes(models):
    path = models[8].path
    assert load_decoder(path, "cpu", "float32", mode="plain").mode == "plain"
    lossless = load_decoder(path, "cpu", "float32", mode="lossless", max_batch="auto", max_pages_per_chunk=4)
    assert isinstance(lossless, EngineDecoder) and lossless.describe()["backend"] == "eager"
    assert lossless.engine.max_batch == 4 and lossless.engine.kv.capacity >= prompt_length(models[8], 4)
    assert lossless.describe()["kernels"] == "torch"  # fp32 / CPU: the model's own kernels
    fast = load_decoder(path, "cpu", "float32", mode="fast", fast_threshold=0.5)
    assert fast.mode == "fast" and fast.describe()["fast_threshold"] == 0.5
    assert isinstance(load_decoder(path, "cpu", "float32", mode="official"), OfficialDecoder)
    with pytest.raises(ValueError):
        load_decoder(path, "cpu", "float32", mode="turbo")


def test_cache_memory_is_constant_in_output_length(models):
    # the looping model: its ngram drafts are often right, so 5,000 tokens take far fewer forwards
    engine = BatchEngine(models["loop"], "lossless", drafters=("ngram",))
    short_run = engine.run([engine.prepare(_pages(1), 500)])[0]
    long_run = engine.run([engine.prepare(_pages(1), 5000)])[0]
    short, long = short_run.stats, long_run.stats
    assert (short["tokens"], long["tokens"]) == (500, 5000)
    assert long_run.output_ids[:500] == short_run.output_ids  # greedy: the same start, nothing left from the last run
    rule = NoRepeatNgramRule(35, 128, long_run.request.prompt_ids)
    for i, token in enumerate(long_run.output_ids):  # and the official rule obeyed all the way
        assert token not in rule.banned(), i
        rule.extend([token])
    assert short["cache_bytes"] == long["cache_bytes"] == engine.kv.bytes_per_row()
    assert long["ring_slots"] == 32  # window 8 + widest step 17 - 1, rounded up to 16
    assert long["verify_rounds"] > 100 and long["accepted_tokens"] > 1000  # the ring wrapped under speculation


# --- drafters ---------------------------------------------------------------------------------------------

def test_drafters_follow_their_sources(models):
    tok = models[8].tokenizer
    text = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    reference = ReferenceDrafter(tok, [text])
    assert reference.propose([], 4) == []  # nothing to align on yet
    start = 10
    markup = tok("<|det|>text [1, 2, 3, 4]<|/det|>", add_special_tokens=False)["input_ids"]
    assert reference.propose(markup + ids[:start + 1], 5) == ids[start + 1:start + 6]
    assert reference.propose(markup + ids[:start + 4], 3) == ids[start + 4:start + 7]  # alignment kept

    replay = ReplayDrafter([10, 11, 12, 13, 14, 15])
    assert replay.propose([], 3) == [10, 11, 12]
    assert replay.propose([10, 11, 99], 2) == [13, 14]  # no suffix match: same position in the source
    assert replay.propose([10, 11, 99, 13, 14, 15], 2) == []  # source exhausted

    ngram = NgramDrafter()
    assert ngram.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert ngram.propose([1, 2, 3, 4, 1, 2, 3, 9, 2, 3], 2) == [9, 2]  # the latest occurrence wins
