"""The speculative engine is token-identical to the official path (CPU, fp32, tiny random models).

Windows 4, 8 and 128; 1 page and 3-page chunks; outputs well past the window (400 tokens at 128);
drafters always right, half right, always wrong; the no-repeat-ngram rule firing; EOS; constant memory.
"""

from __future__ import annotations

import random

import pytest
import torch
from PIL import Image
from transformers import GenerationConfig
from transformers.models.unlimited_ocr.generation_unlimited_ocr import (
    UnlimitedOcrSlidingWindowNoRepeatNgramLogitsProcessor as OfficialRule)

from engine.chunk_decode import OfficialDecoder, load_decoder, prompt_length
from engine.drafters.ngram import NgramDrafter
from engine.drafters.suffix_match import ReferenceDrafter, ReplayDrafter
from engine.model import load_model
from engine.ngram_rule import NoRepeatNgramRule
from engine.official import official_generate, official_inputs, rswa_mask
from engine.rswa_cache import RswaKVCache
from engine.runner import RswaRunner
from engine.speculative import SpeculativeDecoder, decode_ids
from engine.tiny import build_tiny_model, set_eos_scale
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
    for trial in range(120):
        n, window = rng.choice([(2, 5), (3, 8), (4, 3), (35, 128), (35, 1024)])
        vocab = 3 if n < 35 else 5
        period = rng.randint(1, 12)
        motif = [rng.randrange(vocab) for _ in range(period)]

        def token(i):  # mostly periodic, so that long n-grams repeat and the rule fires
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


# --- the cache and the forward ----------------------------------------------------------------------------

def test_cache_mask_follows_tags_through_rollbacks():
    window, max_step, prefix = 5, 4, 3
    cache = RswaKVCache(num_layers=1, num_kv_heads=1, head_dim=2, prefix_len=prefix, window=window,
                        max_step_tokens=max_step, dtype=torch.float32, device="cpu")
    assert cache.ring_size == window + max_step - 1
    size = cache.nbytes()
    with pytest.raises(ValueError):
        cache.begin_step(prefix + 1)  # a step never mixes prefix and output positions
    _, mask = cache.begin_step(prefix)
    cache.commit(prefix)
    assert mask[0, 0, :, :prefix].tolist() == torch.tril(torch.ones(prefix, prefix, dtype=torch.bool)).tolist()
    rng = random.Random(0)
    for _ in range(500):
        k = rng.randint(1, max_step)
        positions, mask = cache.begin_step(k)
        start = cache.length
        for row, p in enumerate(positions[0].tolist()):
            ring = mask[0, 0, row, prefix:]
            assert mask[0, 0, row, :prefix].all()
            visible = sorted(cache.tags[ring].tolist())
            assert visible == list(range(max(prefix, p - window + 1), p + 1))  # exactly the window, itself included
        cache.commit(rng.randint(1, k))  # reject a random tail
        assert cache.length > start
    assert cache.nbytes() == size
    with pytest.raises(ValueError):
        cache.begin_step(max_step + 1)


def test_runner_logits_equal_hf_forward_with_rswa_mask(models):
    loaded = models[4]
    pages = _pages(1)
    output = official_generate(loaded, pages, "single", 50).output_ids
    inputs = official_inputs(loaded, pages, "single")
    prefix = inputs["input_ids"].shape[1]
    seq = torch.tensor([inputs["input_ids"][0].tolist() + output[:-1]])
    with torch.inference_mode():
        expected = loaded.model(input_ids=seq, pixel_values=inputs["pixel_values"],
                                attention_mask=rswa_mask(prefix, seq.shape[1], 4)).logits[0, prefix - 1:]
    runner = RswaRunner(loaded.model)
    cache, first = runner.prefill(inputs, max_step_tokens=6)
    rows, done, sizes = [first], 0, [1, 3, 6, 2, 5, 4]
    while done < len(output) - 1:
        k = min(sizes[len(rows) % len(sizes)], len(output) - 1 - done)
        junk = [5] * min(2, 6 - k)  # drafted tokens that get rejected
        rows.extend(runner.step(cache, output[done:done + k] + junk)[:k])
        cache.commit(k)
        done += k
    torch.testing.assert_close(torch.stack(rows), expected, rtol=1e-4, atol=1e-4)


# --- token-exactness --------------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [4, 8, 128])
@pytest.mark.parametrize("n_pages", [1, 3])
def test_plain_and_lossless_equal_official(models, official, window, n_pages):
    loaded, pages = models[window], _pages(n_pages)
    expected = official(window, n_pages)
    max_new = LENGTHS[window]
    assert len(expected) == max_new >= 3 * window
    vocab = loaded.model.config.text_config.vocab_size
    assert decode_ids(loaded, pages, max_new, mode="plain") == expected
    assert decode_ids(loaded, pages, max_new) == expected  # ngram drafter only
    for how in ["right", "every_other", "random_half", "wrong"]:
        replay = _corrupt(expected, vocab, how)
        assert decode_ids(loaded, pages, max_new, replay_ids=replay) == expected, how


@pytest.mark.parametrize("k_max", [1, 3, 32])
def test_ring_sizes_around_the_window(models, official, k_max):
    expected = official(4, 1)
    vocab = models[4].model.config.text_config.vocab_size
    for how in ["right", "every_other"]:
        ids = decode_ids(models[4], _pages(1), LENGTHS[4], k_max=k_max, replay_k_max=k_max,
                         replay_ids=_corrupt(expected, vocab, how))
        assert ids == expected, (k_max, how)


@pytest.mark.parametrize("n_pages", [1, 3])
def test_a_rerun_replays_longer_drafts(models, official, n_pages):
    """The replay drafter's own cap (replay_k_max, 64 by default): a re-run with the right replay takes far fewer
    forwards than at k_max 16, token-identical; a corrupted replay still decodes the official tokens."""
    loaded, pages, expected = models[128], _pages(n_pages), official(128, n_pages)  # 400 tokens, past the window
    vocab = loaded.model.config.text_config.vocab_size
    forwards = {}
    for cap in (16, 64):
        res = SpeculativeDecoder(loaded, replay_k_max=cap).generate(pages, len(expected), replay_ids=expected)
        assert res.output_ids == expected, cap
        forwards[cap] = res.extra["speculative"]["forwards"]
    assert 2 * forwards[64] < forwards[16]
    for how in ["every_other", "random_half", "wrong"]:
        assert decode_ids(loaded, pages, len(expected), replay_ids=_corrupt(expected, vocab, how)) == expected, how
    with pytest.raises(ValueError, match="replay_k_max"):
        SpeculativeDecoder(loaded, replay_k_max=0)


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
            decoder = SpeculativeDecoder(loaded, mode=mode)
            out = decoder.decode(pages, context_limit=32768, max_new_tokens=80, replay_ids=replay)
            assert out.output_ids == ids and out.finish_reason == "eos", (n_pages, mode, replay)


# --- chunk decoder contract, memory -----------------------------------------------------------------------

def test_decode_returns_chunk_output_with_stats(models, official):
    loaded, pages = models[8], _pages(3)
    expected = official(8, 3)
    reference = OfficialDecoder(loaded).decode(pages, context_limit=32768, max_new_tokens=len(expected))
    decoder = SpeculativeDecoder(loaded, mode="lossless", k_max=8)
    out = decoder.decode(pages, context_limit=32768, max_new_tokens=len(expected), replay_ids=expected,
                         reference_texts=["page 0 line 0", "page 1 line 0", "page 2 line 0"])
    assert out.output_ids == reference.output_ids == expected
    assert [p.text for p in out.pages] == [p.text for p in reference.pages]
    assert (out.finish_reason, out.requeue) == (reference.finish_reason, reference.requeue)
    stats = out.chunk_stats
    assert stats["tokens"] == stats["output_tokens"] == len(expected)
    assert stats["verify_rounds"] + stats["single_steps"] + 1 == stats["forwards"] < len(expected) // 4
    assert stats["drafters"]["replay"]["acceptance"] == 1.0 and set(stats["drafters"]) == {"reference", "replay",
                                                                                           "markup", "ngram"}
    assert stats["tau"] == stats["accepted_tokens"] / stats["verify_rounds"] > 4
    assert all(stats[key] >= 0 for key in ["prefill_s", "draft_s", "verify_s", "single_s"])
    for page in out.pages:
        assert {"tokens", "verify_rounds", "single_steps", "verify_s", "tau"} <= set(page.stats)

    prompt = prompt_length(loaded, 3)
    cut = decoder.decode(pages, context_limit=prompt + 26)
    assert cut.finish_reason == "context_limit" and cut.output_ids == expected[:26]
    assert decoder.decode(pages, context_limit=prompt + 10).finish_reason == "no_room"
    assert decoder.describe()["mode"] == "lossless"


def test_load_decoder_modes(models):
    path = models[8].path
    assert load_decoder(path, "cpu", "float32", mode="plain").mode == "plain"
    assert isinstance(load_decoder(path, "cpu", "float32", mode="lossless"), SpeculativeDecoder)
    fast = load_decoder(path, "cpu", "float32", mode="fast", fast_threshold=0.5)
    assert fast.mode == "fast" and fast.describe()["fast_threshold"] == 0.5
    # engine.compile_step reaches the decoder; on the CPU the eager engine runs, with nothing to compile
    compiled = load_decoder(path, "cpu", "float32", mode="plain", compile_step=True)
    assert compiled.backend == "eager" and compiled.static is None
    with pytest.raises(ValueError):
        load_decoder(path, "cpu", "float32", mode="turbo")


def test_cache_memory_is_constant_in_output_length(models):
    # the looping model: its ngram drafts are often right, so 5,000 tokens take ~1,700 forwards
    decoder = SpeculativeDecoder(models["loop"], mode="lossless", k_max=16, drafters=("ngram",))
    short = decoder.generate(_pages(1), 500).extra["speculative"]
    long = decoder.generate(_pages(1), 5000).extra["speculative"]
    assert (short["tokens"], long["tokens"]) == (500, 5000)
    assert short["cache_bytes"] == long["cache_bytes"]
    assert long["ring_slots"] == 8 + 16  # window + k_max slots (a step writes up to k_max + 1 tokens)
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
