"""The static-buffer fast path (issue 6) is token-identical to the official path (CPU, fp32, tiny random models).

Backend ``static`` runs exactly the step that CUDA graphs capture, eagerly: windows 4, 8 and 128; 1 page and
3-page chunks; outputs >= 3x the window; drafters always right, half right, always wrong; the three MoE
implementations; padding of steps to width buckets; the no-repeat-ngram rule firing; EOS; constant memory;
the fallback to the eager engine. The CUDA-graph tests at the end run only where CUDA is available.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.cuda_graphs import GraphCaptureError, StepGraphs, cuda_graphs_available
from engine.fast_decoder import FastDecoder
from engine.model import load_model
from engine.official import official_generate
from engine.static_runner import PREFIX_BUCKETS, StaticRswaRunner, bucket, width_buckets
from engine.tiny import build_tiny_model, set_eos_scale
from tests.conftest import text_page

LENGTHS = {4: 60, 8: 100, 128: 400}  # new tokens per window: >= 3x the window, and past 128
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _pages(n: int):
    return [text_page(i) for i in range(n)]


def _kind(n: int) -> str:
    return "single" if n == 1 else "multi"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("static")
    specs = {4: dict(sliding_window=4), 8: dict(sliding_window=8), 128: dict(sliding_window=128),
             "loop": dict(sliding_window=8, text_init=0.02)}
    return {name: str(build_tiny_model(root / str(name), seed=0, **spec)) for name, spec in specs.items()}


@pytest.fixture(scope="module")
def models(folders):
    return {name: load_model(path, "cpu", "float32") for name, path in folders.items()}


@pytest.fixture(scope="module")
def official(models):
    memo = {}

    def get(name, n_pages):
        if (name, n_pages) not in memo:
            memo[name, n_pages] = official_generate(models[name], _pages(n_pages), _kind(n_pages),
                                                    LENGTHS.get(name, 200)).output_ids
        return memo[name, n_pages]

    return get


def _corrupt(ids: list[int], vocab: int, how: str) -> list[int]:
    if how == "right":
        return list(ids)
    if how == "random_half":
        rng = random.Random(0)
        return [t if rng.random() < 0.5 else rng.randrange(vocab) for t in ids]
    if how == "wrong":
        return [(t + 1) % vocab for t in ids]
    raise ValueError(how)


def _ids(loaded, pages, max_new, backend="static", **kwargs) -> list[int]:
    replay = kwargs.pop("replay_ids", None)
    decoder = FastDecoder(loaded, backend=backend, **kwargs)
    return decoder.generate(pages, max_new, replay_ids=replay).output_ids


# --- buckets and buffers ----------------------------------------------------------------------------------

def test_buckets():
    assert width_buckets(17) == [1, 2, 4, 8, 16, 17]
    assert width_buckets(16) == [1, 2, 4, 8, 16]
    assert width_buckets(1) == [1]
    assert bucket(273 + 6, PREFIX_BUCKETS) == 384 and bucket(16 * 273 + 6, PREFIX_BUCKETS) == 4608
    with pytest.raises(ValueError):
        bucket(10**9, PREFIX_BUCKETS)


def test_ring_covers_window_plus_widest_step(models):
    runner = StaticRswaRunner(models[8].model, max_step_tokens=17)
    assert runner.ring_size >= 8 + 17 - 1 and runner.ring_size % 16 == 0
    with pytest.raises(RuntimeError):
        runner.step([1])  # no prefill yet


# --- token-exactness --------------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [4, 8, 128])
@pytest.mark.parametrize("n_pages", [1, 3])
def test_static_plain_and_lossless_equal_official(models, official, window, n_pages):
    loaded, pages = models[window], _pages(n_pages)
    expected = official(window, n_pages)
    max_new = LENGTHS[window]
    assert len(expected) == max_new >= 3 * window
    vocab = loaded.model.config.text_config.vocab_size
    assert _ids(loaded, pages, max_new, mode="plain") == expected
    for how in ["right", "random_half", "wrong"]:
        assert _ids(loaded, pages, max_new, replay_ids=_corrupt(expected, vocab, how)) == expected, how


@pytest.mark.parametrize("moe", ["gather", "dense", "mixed"])
@pytest.mark.parametrize("n_pages", [1, 3])
def test_other_moe_implementations(models, official, moe, n_pages):
    loaded, pages, expected = models[8], _pages(n_pages), official(8, n_pages)
    vocab = loaded.model.config.text_config.vocab_size
    assert _ids(loaded, pages, LENGTHS[8], mode="plain", moe=moe) == expected
    assert _ids(loaded, pages, LENGTHS[8], moe=moe, replay_ids=_corrupt(expected, vocab, "random_half")) == expected


@pytest.mark.parametrize("n_pages", [1, 3])
def test_batched_gemv_projections(models, official, n_pages):
    """linear="bmv" (the fp32 CUDA default: one GEMV per step token) decodes the official tokens too."""
    loaded, pages, expected = models[8], _pages(n_pages), official(8, n_pages)
    vocab = loaded.model.config.text_config.vocab_size
    assert _ids(loaded, pages, LENGTHS[8], mode="plain", linear="bmv") == expected
    for how in ["right", "random_half"]:
        ids = _ids(loaded, pages, LENGTHS[8], linear="bmv", replay_ids=_corrupt(expected, vocab, how))
        assert ids == expected, how


@pytest.mark.parametrize("n_pages", [1, 3])
def test_fast_mode_static_equals_eager(models, official, n_pages):
    """mode fast on the static runner: the eager engine's relaxed rule, token for token (the draft logits come
    back with the step's one copy); at threshold 1 it is lossless."""
    from engine.speculative import SpeculativeDecoder

    loaded, pages, expected = models[8], _pages(n_pages), official(8, n_pages)
    vocab = loaded.model.config.text_config.vocab_size
    wrong = _corrupt(expected, vocab, "random_half")
    assert _ids(loaded, pages, LENGTHS[8], mode="fast", fast_threshold=1.0, replay_ids=wrong) == expected
    threshold = 1.0 / vocab  # a random tiny model spreads its probability: some drafts pass, some do not
    eager = SpeculativeDecoder(loaded, mode="fast", fast_threshold=threshold).generate(pages, LENGTHS[8],
                                                                                      replay_ids=wrong)
    static = FastDecoder(loaded, mode="fast", backend="static", fast_threshold=threshold)
    res = static.generate(pages, LENGTHS[8], replay_ids=wrong)
    assert res.extra["speculative"]["backend"] == "static"
    assert res.output_ids == eager.output_ids
    relaxed = res.extra["speculative"]["relaxed_tokens"]
    assert relaxed == eager.extra["speculative"]["relaxed_tokens"] and 0 < relaxed < len(res.output_ids)
    assert res.output_ids != expected
    assert res.logprobs == pytest.approx(eager.logprobs, abs=1e-4)


def test_linear_choice():
    from engine.static_runner import StaticRswaRunner

    with pytest.raises(ValueError, match="linear must be one of"):
        StaticRswaRunner(None, 4, linear="cublas")


@pytest.mark.parametrize("attn", ["matmul", "matmul_t", "auto"])
@pytest.mark.parametrize("n_pages", [1, 3])
def test_other_attention(models, official, n_pages, attn):
    """``matmul`` everywhere, ``matmul_t`` (both products transposed), and ``auto`` (SDPA at width 1, matmul for
    verify widths >= 2) in one decode."""
    loaded, pages, expected = models[128], _pages(n_pages), official(128, n_pages)
    vocab = loaded.model.config.text_config.vocab_size
    assert _ids(loaded, pages, LENGTHS[128], mode="plain", attn=attn) == expected
    replay = _corrupt(expected, vocab, "random_half")
    assert _ids(loaded, pages, LENGTHS[128], attn=attn, replay_ids=replay) == expected


@pytest.mark.parametrize("k_max", [1, 3, 32])
def test_widths_and_padding_around_the_window(models, official, k_max):
    """k_max 3 -> widths 1, 2, 4 (a 3-token step runs padded to 4); 32 -> a ring of 4 + 33 - 1 -> 48 slots."""
    expected = official(4, 1)
    vocab = models[4].model.config.text_config.vocab_size
    for how in ["right", "random_half"]:
        replay = _corrupt(expected, vocab, how)
        assert _ids(models[4], _pages(1), LENGTHS[4], k_max=k_max, replay_ids=replay) == expected, (k_max, how)


def test_one_runner_serves_chunks_of_different_lengths(models, official):
    """Buffers grow for a longer prefix and are reused for a shorter one (stale prefix slots masked)."""
    loaded = models[8]
    decoder = FastDecoder(loaded, mode="plain", backend="static")
    for n_pages in [1, 3, 1]:
        assert decoder.generate(_pages(n_pages), LENGTHS[8]).output_ids == official(8, n_pages)


@pytest.mark.parametrize("n_pages", [1, 3])
def test_rule_fires_and_static_path_follows_it(models, official, n_pages):
    loaded, pages = models["loop"], _pages(n_pages)
    expected = official("loop", n_pages)
    assert _ids(loaded, pages, len(expected), mode="plain") == expected
    assert _ids(loaded, pages, len(expected), drafters=("ngram",)) == expected  # drafts the looping tokens


def test_eos_and_chunk_output(models):
    loaded = load_model(models[8].path, "cpu", "float32")  # a fresh copy: the EOS row changes
    set_eos_scale(loaded.model, 8.0, seed=2)
    for n_pages in [1, 3]:
        pages = _pages(n_pages)
        expected = official_generate(loaded, pages, _kind(n_pages), 80)
        assert expected.finish_reason == "eos" and len(expected.output_ids) < 80
        ids = expected.output_ids
        for mode, replay in [("plain", None), ("lossless", ids + ids), ("lossless", ids[:-1] + [5, 6, 7])]:
            out = FastDecoder(loaded, mode=mode, backend="static").decode(
                pages, context_limit=32768, max_new_tokens=80, replay_ids=replay)
            assert out.output_ids == ids and out.finish_reason == "eos", (n_pages, mode)
            assert out.chunk_stats["backend"] == "static"


def test_memory_is_constant_in_output_length(models):
    decoder = FastDecoder(models["loop"], mode="lossless", k_max=16, drafters=("ngram",), backend="static")
    short = decoder.generate(_pages(1), 300).extra["speculative"]
    long = decoder.generate(_pages(1), 3000).extra["speculative"]
    assert (short["tokens"], long["tokens"]) == (300, 3000)
    assert short["cache_bytes"] == long["cache_bytes"]
    assert long["verify_rounds"] > 50 and long["accepted_tokens"] > 500  # the ring wrapped under speculation


# --- backends and fallback --------------------------------------------------------------------------------

def test_auto_backend_without_cuda_is_the_eager_engine(models, official):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: auto means graphs")
    decoder = FastDecoder(models[8], mode="plain")
    assert decoder.backend == "eager" and decoder.static is None and decoder.fallback_reason
    assert decoder.generate(_pages(1), LENGTHS[8]).output_ids == official(8, 1)
    with pytest.raises(ValueError):
        FastDecoder(models[8], backend="graphs")
    assert not cuda_graphs_available()[0]
    with pytest.raises(GraphCaptureError):
        StepGraphs(lambda w, b: (), "cuda")


def test_capture_failure_falls_back_to_the_eager_engine(models, official):
    class Failing:
        def has(self, width, prefix_bucket):
            return False

        def capture(self, width, prefix_bucket):
            raise GraphCaptureError("capture of the 1-token step failed: simulated")

        def touch(self, prefix_bucket):
            pass

        def clear(self):
            pass

    decoder = FastDecoder(models[8], mode="lossless", backend="static")
    decoder.static.graphs = Failing()
    expected = official(8, 1)
    out = decoder.generate(_pages(1), LENGTHS[8], replay_ids=expected)
    assert out.output_ids == expected
    assert decoder.backend == "eager" and "simulated" in decoder.fallback_reason
    assert "backend" not in out.extra["speculative"]  # the eager engine's stats


def test_any_static_path_error_falls_back_and_loses_nothing(models, official):
    decoder = FastDecoder(models[8], mode="plain", backend="static")

    def broken(token_ids):
        raise RuntimeError("simulated kernel failure")

    decoder.static.step = broken
    assert decoder.generate(_pages(1), LENGTHS[8]).output_ids == official(8, 1)
    assert decoder.backend == "eager" and decoder.fallback_reason == "RuntimeError: simulated kernel failure"


def test_graphs_kept_for_the_most_recently_used_prefix_buckets():
    graphs = object.__new__(StepGraphs)  # the bookkeeping only: no CUDA needed
    graphs.graphs, graphs._recent, graphs.max_prefix_buckets = {}, [], 2
    for prefix_bucket in [384, 4608, 384, 512]:
        graphs.touch(prefix_bucket)
        for width in [1, 2]:
            graphs.graphs.setdefault((width, prefix_bucket), ("graph", ()))
    assert sorted(graphs.graphs) == [(1, 384), (1, 512), (2, 384), (2, 512)]  # 4608: least recently used
    graphs.clear()
    assert not graphs.graphs and not graphs._recent


# --- CUDA graphs (GPU only) -------------------------------------------------------------------------------

def test_moe_auto_choice():
    from engine.static_moe import resolve

    assert resolve("auto", torch.device("cpu"), torch.float32) == "grouped"
    assert resolve("auto", torch.device("cuda"), torch.bfloat16) == "grouped"
    assert resolve("auto", torch.device("cuda"), torch.float32) == "gather"  # grouped_mm is bf16-only on CUDA
    assert resolve("dense", torch.device("cuda"), torch.float32) == "dense"
    with pytest.raises(ValueError):
        resolve("sparse", torch.device("cpu"), torch.float32)


@CUDA
@pytest.mark.parametrize("window", [8, 128])
@pytest.mark.parametrize("n_pages", [1, 3])
def test_cuda_graphs_equal_official_fp32(folders, window, n_pages):
    from engine.static_moe import make_official_experts_runnable

    loaded = load_model(folders[window], "cuda", "float32")
    make_official_experts_runnable(loaded.model)
    pages = _pages(n_pages)
    expected = official_generate(loaded, pages, _kind(n_pages), LENGTHS[window]).output_ids
    vocab = loaded.model.config.text_config.vocab_size
    for moe, attn, linear in [("auto", "sdpa", "auto"), ("dense", "sdpa", "auto"), ("gather", "sdpa", "auto"),
                              ("mixed", "sdpa", "auto"), ("auto", "matmul", "auto"), ("auto", "auto", "torch"),
                              ("auto", "matmul_t", "auto")]:
        plain = FastDecoder(loaded, mode="plain", backend="graphs", moe=moe, attn=attn, linear=linear)
        assert plain.static.linear == ("bmv" if linear == "auto" else linear)
        res = plain.generate(pages, LENGTHS[window])
        assert plain.backend == "graphs", plain.fallback_reason
        assert res.output_ids == expected, (moe, attn, linear)
        assert res.extra["speculative"]["graphs"] >= 1
        for how in ["right", "random_half", "wrong"]:
            ids = _ids(loaded, pages, LENGTHS[window], backend="graphs", moe=moe, attn=attn, linear=linear,
                       replay_ids=_corrupt(expected, vocab, how))
            assert ids == expected, (moe, attn, linear, how)
    from engine.speculative import SpeculativeDecoder

    wrong, threshold = _corrupt(expected, vocab, "random_half"), 1.0 / vocab  # fast mode on graphs = eager's rule
    eager = SpeculativeDecoder(loaded, mode="fast", fast_threshold=threshold).generate(pages, LENGTHS[window],
                                                                                      replay_ids=wrong)
    fast = FastDecoder(loaded, mode="fast", backend="graphs", fast_threshold=threshold)
    res = fast.generate(pages, LENGTHS[window], replay_ids=wrong)
    assert fast.backend == "graphs" and res.extra["speculative"]["relaxed_tokens"] > 0
    assert res.output_ids == eager.output_ids


def test_logprobs_match_the_eager_engine(models):
    from engine.speculative import SpeculativeDecoder

    eager = SpeculativeDecoder(models[8], mode="plain").generate(_pages(1), LENGTHS[8])
    static = FastDecoder(models[8], mode="plain", backend="static").generate(_pages(1), LENGTHS[8])
    assert static.output_ids == eager.output_ids
    torch.testing.assert_close(torch.tensor(static.logprobs), torch.tensor(eager.logprobs), rtol=1e-4, atol=1e-4)


@CUDA
@pytest.mark.parametrize("n_pages", [1, 3])
def test_cuda_graph_replays_equal_the_same_step_run_eagerly_bf16(folders, n_pages):
    """Same kernels, same shapes: the graphs path must give exactly the static path's tokens, in bf16 too."""
    loaded = load_model(folders[128], "cuda", "bfloat16")
    pages = _pages(n_pages)
    vocab = loaded.model.config.text_config.vocab_size
    for moe, attn in [("grouped", "sdpa"), ("dense", "sdpa"), ("gather", "sdpa"), ("grouped", "matmul")]:
        eager = FastDecoder(loaded, mode="plain", backend="static", moe=moe, attn=attn).generate(pages, 300)
        graphs = FastDecoder(loaded, mode="plain", backend="graphs", moe=moe, attn=attn)
        assert graphs.generate(pages, 300).output_ids == eager.output_ids and graphs.backend == "graphs", moe
        replay = _corrupt(eager.output_ids, vocab, "random_half")
        assert _ids(loaded, pages, 300, backend="graphs", moe=moe, attn=attn, replay_ids=replay) == \
            _ids(loaded, pages, 300, backend="static", moe=moe, attn=attn, replay_ids=replay), (moe, attn)


def test_compiled_step_is_token_identical_to_official(models, official):
    """`compile_step`: the step body through torch.compile (inductor's CPU backend here) gives official's tokens."""
    try:
        import torch._inductor  # noqa: F401
    except ImportError as exc:  # pragma: no cover - a torch build without inductor
        pytest.skip(f"torch.compile unavailable: {exc}")
    decoder = FastDecoder(models[8], mode="plain", backend="static", compile_step=True)
    out = decoder.decode(_pages(1), 32768, LENGTHS[8])
    assert decoder.static.compile_error is None and decoder.static.compiled and out.chunk_stats["compiled"]
    assert out.output_ids == official(8, 1)


@CUDA
@pytest.mark.parametrize("n_pages", [1, 3])
def test_cuda_graphs_with_the_block_drafter_equal_official_fp32(folders, n_pages):
    """The GPU path of issue 7: the block drafter drafting by graph replay, its drafts kept on the device for the
    verify graph (device_drafts) or read by the host first: both official's tokens, with the same rounds."""
    from engine.drafters.block import BlockDrafterConfig, BlockDrafterNet
    from engine.static_moe import make_official_experts_runnable

    loaded = load_model(folders[128], "cuda", "float32")
    make_official_experts_runnable(loaded.model)
    pages = _pages(n_pages)
    expected = official_generate(loaded, pages, _kind(n_pages), LENGTHS[128]).output_ids
    cfg = loaded.model.config.text_config
    torch.manual_seed(0)
    net = BlockDrafterNet(BlockDrafterConfig(
        target_hidden=cfg.hidden_size, layers=BlockDrafterConfig.default_layers(cfg.num_hidden_layers), block=6,
        context=16, dim=32, num_layers=1, num_heads=2, memory=True)).eval().requires_grad_(False).cuda()
    stats = {}
    for device_drafts in (True, False):
        dec = FastDecoder(loaded, mode="lossless", k_max=6, drafters=("block",), block_net=net, backend="graphs",
                          device_drafts=device_drafts, block_sits_out=False)
        res = dec.generate(pages, LENGTHS[128])
        assert dec.backend == "graphs", dec.fallback_reason
        assert res.output_ids == expected, device_drafts
        s = stats[device_drafts] = res.extra["speculative"]
        assert s["device_drafts"] is device_drafts and s["verify_rounds"] > 0
    assert stats[True]["drafters"] == stats[False]["drafters"]
