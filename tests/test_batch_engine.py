"""The batched engine is token-identical to official ``generate()`` of each chunk alone (CPU, fp32, tiny random
models): batches of up to 5 rows, 1- and 3-page chunks, more chunks than rows (admissions while others decode),
chunks that end early, drafts always right, half right and always wrong, the no-repeat rule firing, windows
4/8/128, a 3-page chunk long enough for the 1024-token rule window to slide. Then the batch-level parts: the step
width chooser, the block drafter for all rows, out-of-memory shrinking, constant memory, the other torch
implementations of the step, widths and buckets, log-probabilities, the fallback to eager steps when a CUDA graph
cannot be captured. The CUDA tests at the end run only where CUDA is available (the GPU machine)."""

from __future__ import annotations

import json
import random

import pytest
import torch

import engine.batch.acceptance
from engine.batch.engine import BatchEngine
from engine.drafters.suffix_match import ReplayDrafter
from engine.kernels.step_graphs import GraphCaptureError, StepGraphs, cuda_graphs_available
from engine.model.kv_slots import PREFIX_BUCKETS, bucket, pow2_buckets
from engine.model.load import load_model
from engine.model.tiny import build_tiny_model
from engine.official import official_generate
from tests.conftest import text_page

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
LENGTHS = {4: 60, 8: 100, 128: 400, "loop": 100, "eos": 100}  # new tokens: >= 3x the window, past 128
PAGES = [text_page(i) for i in range(6)]
CHUNKS = [[PAGES[0]], PAGES[1:4], [PAGES[4]], PAGES[2:5], [PAGES[5]]]  # 1- and 3-page chunks

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    specs = {4: dict(sliding_window=4), 8: dict(sliding_window=8), 128: dict(sliding_window=128),
             "loop": dict(sliding_window=8, text_init=0.02), "eos": dict(sliding_window=8, eos_scale=3.0)}
    return {name: load_model(str(build_tiny_model(root / str(name), seed=0, **spec)), "cpu", "float32")
            for name, spec in specs.items()}


def limit(name, chunk_index: int) -> int:
    return LENGTHS[name] // (2 if chunk_index == 2 else 1)  # chunk 2 ends early (its own limit)


@pytest.fixture(scope="module")
def official(models):
    memo = {}

    def get(name, chunk_index, max_new=None):
        chunk = CHUNKS[chunk_index]
        n = max_new or limit(name, chunk_index)
        if (name, chunk_index, n) not in memo:
            memo[name, chunk_index, n] = official_generate(models[name], chunk, "single" if len(chunk) == 1 else "multi",
                                                           n).output_ids
        return memo[name, chunk_index, n]

    return get


def corrupt(ids: list[int], vocab: int, how: str, seed: int) -> list[int]:
    rng = random.Random(seed)
    if how == "right":
        return list(ids)
    if how == "half":
        return [t if rng.random() < 0.5 else rng.randrange(vocab) for t in ids]
    return [(t + 1) % vocab for t in ids]


def decode_all(loaded, expected: list[list[int]], mode: str = "plain", max_batch: int = 5, drafts: str | None = None,
               name=8, **options) -> list:
    """Every chunk through one engine, each to its own limit; drafts: a replay drafter fed each chunk's expected
    ids, corrupted."""
    vocab = loaded.model.config.text_config.vocab_size
    factory = None if drafts is None else (lambda r: [ReplayDrafter(r.replay_ids)])
    engine = BatchEngine(loaded, mode, max_batch=max_batch, drafter_factory=factory, **options)
    requests = [engine.prepare(chunk, limit(name, i), key=i,
                               replay_ids=None if drafts is None else corrupt(ids, vocab, drafts, i))
                for i, (chunk, ids) in enumerate(zip(CHUNKS, expected))]
    return engine.run(requests)


@pytest.mark.parametrize("window", [4, 8, 128])
def test_batches_equal_official_for_every_chunk(models, official, window, equal_step_costs):
    loaded = models[window]
    expected = [official(window, i) for i in range(len(CHUNKS))]
    assert all(len(ids) >= 3 * window for ids in expected if len(ids) == LENGTHS[window])
    for max_batch in (1, 3, 5):  # 3 rows for 5 chunks: admissions while others decode
        results = decode_all(loaded, expected, "plain", max_batch, name=window)
        assert [r.output_ids for r in results] == expected, max_batch
        assert max(r.stats["batch_rows"] for r in results) > 1 or max_batch == 1
    for how in ("right", "half", "wrong"):
        results = decode_all(loaded, expected, "lossless", 3, drafts=how, name=window)
        assert [r.output_ids for r in results] == expected, how
        taus = [r.stats["tau"] for r in results]  # right drafts: long accepted runs, once the width choice measured
        # plain (its first measures left out) and climbed from narrow widths (a 50-token chunk spends a few rounds on that)
        assert (min(taus) > 3) if how == "right" else (max(taus) == 0 if how == "wrong" else 0 < max(taus) < 8)


def test_the_next_plain_step_runs_ahead_with_the_same_tokens(models, official, equal_step_costs):
    """The next plain step goes to the device before the host commits this one (engine/batch/overlap.py): the same
    tokens and log-probabilities as without it, with admissions while others decode and a chunk that ends early; in
    lossless mode too once always-wrong drafts stop drafting; dropping the rows discards a step launched ahead."""
    loaded = models[8]
    expected = [official(8, i) for i in range(len(CHUNKS))]
    vocab = loaded.model.config.text_config.vocab_size
    runs = {}
    for mode, overlap in (("plain", True), ("plain", False), ("lossless", True)):
        factory = (lambda r: [ReplayDrafter(r.replay_ids)]) if mode == "lossless" else None
        engine = BatchEngine(loaded, mode, max_batch=3, drafter_factory=factory, overlap=overlap)
        requests = [engine.prepare(c, limit(8, i), key=i, replay_ids=corrupt(ids, vocab, "wrong", i))
                    for i, (c, ids) in enumerate(zip(CHUNKS, expected))]
        results = engine.run(requests)
        assert [r.output_ids for r in results] == expected, (mode, overlap)
        runs[mode, overlap] = ([r.logprobs for r in results], engine.steps_ahead, engine.steps)
    assert runs["plain", True][0] == runs["plain", False][0]  # (lossless verifies at other widths: fp32 rounds apart)
    assert runs["plain", False][1] == 0 and runs["plain", True][1] > runs["plain", True][2] // 2
    assert runs["lossless", True][1] > 0  # once the wrong drafts stopped drafting
    engine = BatchEngine(loaded, "plain", max_batch=2)
    for i in (0, 2):
        engine.submit(engine.prepare(CHUNKS[i], limit(8, i), key=i))
    while engine.in_flight is None:
        engine.step()
    dropped = engine.drop_rows()
    assert engine.in_flight is None and sorted(r.key for r in dropped) == [0, 2]
    assert [r.output_ids for r in engine.run(dropped)] == [expected[r.key] for r in dropped]


def test_rule_fires_inside_batches_and_is_followed(models, official, monkeypatch):
    """A looping model: the no-repeat rule bans the argmax in verify rows; the batch still equals official."""
    loaded = models["loop"]
    expected = [official("loop", i) for i in range(len(CHUNKS))]
    fallbacks = []
    real = engine.batch.acceptance.greedy_token
    monkeypatch.setattr(engine.batch.acceptance, "greedy_token", lambda row, banned: fallbacks.append(1) or real(row, banned))
    assert [r.output_ids for r in decode_all(loaded, expected, "plain", 5, name="loop")] == expected
    assert [r.output_ids for r in decode_all(loaded, expected, "lossless", 5, drafts="half", name="loop")] == expected
    assert len(fallbacks) >= 4


def test_chunks_that_end_early_leave_their_row_to_the_next(models, official):
    loaded = models["eos"]
    expected = [official("eos", i) for i in range(len(CHUNKS))]
    assert sum(ids[-1] == loaded.eos_token_id for ids in expected) >= 3  # EOS before the limit
    results = decode_all(loaded, expected, "lossless", 2, drafts="half", name="eos")
    assert [r.output_ids for r in results] == expected
    assert [r.finish_reason for r in results] == ["eos" if ids[-1] == loaded.eos_token_id else "length"
                                                 for ids in expected]


def test_the_multi_page_rule_window_slides_inside_a_batch(models, official):
    """A 3-page chunk (multi-page rule: window 1024 over prompt + output) decoded for 1,100 tokens beside a
    single-page chunk on the looping model, where the rule keeps firing: the window slides past the prompt."""
    loaded = models["loop"]
    long_multi, single = official("loop", 1, 1100), official("loop", 0, 300)
    prompt = len(loaded.processor(images=CHUNKS[1], text="<image>" * 3 + "Multi page parsing.")["input_ids"][0])
    assert prompt + len(long_multi) > 1024 + 35
    engine = BatchEngine(loaded, "lossless", max_batch=2)
    results = engine.run([engine.prepare(CHUNKS[1], 1100), engine.prepare(CHUNKS[0], 300)])
    assert [r.output_ids for r in results] == [long_multi, single]


def test_fast_mode_is_never_cut_short_and_counts_relaxed_tokens(models, official):
    loaded = models[8]
    expected = [official(8, i) for i in range(len(CHUNKS))]
    # every step drafts (no width choice): whether relaxed tokens appear must not hang on the host's timing
    results = decode_all(loaded, expected, "fast", 3, drafts="half", fast_threshold=0.01, adaptive_width=False)
    assert [len(r.output_ids) for r in results] == [len(ids) for ids in expected]
    assert sum(r.stats["relaxed_tokens"] for r in results) > 0


def test_memory_is_constant_in_output_length(models):
    loaded = models[8]
    engine = BatchEngine(loaded, "plain", max_batch=2)
    before = engine.kv.nbytes()
    engine.run([engine.prepare(CHUNKS[0], 300), engine.prepare(CHUNKS[1], 30)])
    assert engine.kv.nbytes() == before
    assert engine.kv.ring_size == 32  # window 8 + widest step 17 - 1, rounded up to a multiple of 16
    wider = BatchEngine(loaded, "plain", max_batch=2, prefix_capacity=4000)
    assert wider.kv.capacity >= 4000 and wider.kv.nbytes() > before


def test_out_of_memory_sends_rows_back_and_loses_nothing(models, official, monkeypatch):
    loaded = models[8]
    expected = [official(8, i) for i in range(len(CHUNKS))]
    engine = BatchEngine(loaded, "plain", max_batch=4)
    real, calls = engine.forward.step_body, []

    def flaky(n, w, prefix_bucket):
        calls.append(n)
        if len(calls) == 5:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(n, w, prefix_bucket)

    monkeypatch.setattr(engine.forward, "step_body", flaky)
    results = engine.run([engine.prepare(c, limit(8, i), key=i) for i, c in enumerate(CHUNKS)])
    assert [r.output_ids for r in results] == expected
    assert engine.row_limit == 2 and max(calls[5:]) <= 2
    assert engine.kv.rows == 2 and all(k.shape[0] == 2 for k in engine.kv.keys)  # the cache gave the memory back


def test_the_block_drafter_drafts_for_every_row_and_stays_exact(models, official):
    from engine.drafters.block import BlockDrafterConfig, BlockDrafterNet

    loaded = models[8]
    hidden = loaded.model.config.text_config.hidden_size
    expected = [official(8, i) for i in range(len(CHUNKS))]
    for memory in (False, True):
        torch.manual_seed(0)
        net = BlockDrafterNet(BlockDrafterConfig(target_hidden=hidden, layers=[0, 2], block=4, context=8, dim=32,
                                                 num_layers=1, num_heads=2, memory=memory)).eval().requires_grad_(False)
        engine = BatchEngine(loaded, "lossless", max_batch=3, block_net=net, drafters=("block",))
        results = engine.run([engine.prepare(c, limit(8, i)) for i, c in enumerate(CHUNKS)])
        assert [r.output_ids for r in results] == expected, memory
        assert sum(r.stats["drafters"]["block"]["proposed"] for r in results) > 0  # untrained: soon benched


def test_invariant_kernels_equal_official_and_do_not_depend_on_the_batch(models, official):
    """The Triton kernels (interpreted on the CPU, fp32): official tokens, and a chunk's log-probabilities bitwise
    the same alone at batch 1 in plain mode as beside others in lossless mode."""
    loaded = models[8]
    chunks = [CHUNKS[0], CHUNKS[1]]
    expected = [official(8, i, 12) for i in range(2)]
    alone = BatchEngine(loaded, "plain", max_batch=1, kernels="invariant").run(
        [BatchEngine(loaded, "plain").prepare(chunks[0], 12)])
    engine = BatchEngine(loaded, "lossless", max_batch=2, kernels="invariant")
    batched = engine.run([engine.prepare(c, 12) for c in chunks])
    assert [r.output_ids for r in batched] == expected and alone[0].output_ids == expected[0]
    assert alone[0].logprobs == batched[0].logprobs


def test_invariant_kernel_pieces_match_torch():
    from engine.kernels import invariant as K

    torch.manual_seed(0)
    x, w, b = torch.randn(5, 96), torch.randn(70, 96), torch.randn(70)
    assert torch.allclose(K.matmul(x, w, b), x @ w.T + b, atol=1e-4)
    rows = torch.randn(3, 2500) * 5
    assert torch.allclose(K.logsumexp_rows(rows), torch.logsumexp(rows, -1), atol=1e-5)
    experts = torch.tensor([3, 0, 3, 1, 1, 1, 0, 2])
    slots_rows, block_expert, slot = K.expert_blocks(experts, 4)
    assert slots_rows[slot].tolist() == list(range(8))
    assert all(int(block_expert[s // K.BLOCK_M]) == int(e) for s, e in zip(slot.tolist(), experts.tolist()))
    weights = torch.randn(4, 12, 96)
    xs = torch.randn(8, 96)
    out = K.grouped_matmul(xs, weights, torch.where(slots_rows >= 0, slots_rows, slots_rows), block_expert,
                           slots_rows.shape[0])
    for pair, e in enumerate(experts.tolist()):
        assert torch.allclose(out[slot[pair]], weights[e] @ xs[pair], atol=1e-4)


@pytest.mark.parametrize("option", [dict(moe="gather"), dict(moe="dense"), dict(moe="mixed"), dict(attn="sdpa"),
                                    dict(attn="matmul"), dict(linear="bmv")], ids=lambda o: "-".join(o.values()))
def test_other_torch_implementations_equal_official(models, official, option):
    """The step's other routed-expert, attention and projection implementations (`engine.forward`), plain and with
    drafts half right: every chunk of a batch still equals official."""
    loaded = models[8]
    expected = [official(8, i) for i in range(len(CHUNKS))]
    assert [r.output_ids for r in decode_all(loaded, expected, "plain", 3, **option)] == expected
    assert [r.output_ids for r in decode_all(loaded, expected, "lossless", 3, drafts="half", **option)] == expected


@pytest.mark.parametrize("k_max", [1, 3, 32])
def test_widths_and_padding_around_the_window(models, official, k_max):
    """k_max 3: widths 1, 2, 4 (a 3-token draft runs padded to 4); 32: a ring of 4 + 33 - 1 -> 48 slots, wider
    than the window many times over."""
    loaded = models[4]
    engine = BatchEngine(loaded, "lossless", k_max=k_max)
    assert engine.widths == {1: [1, 2], 3: [1, 2, 4], 32: [1, 2, 4, 8, 16, 32, 33]}[k_max]
    assert engine.kv.ring_size == {1: 16, 3: 16, 32: 48}[k_max]
    expected = [official(4, i) for i in range(len(CHUNKS))]
    for how in ("right", "half"):
        results = decode_all(loaded, expected, "lossless", 3, drafts=how, name=4, k_max=k_max)
        assert [r.output_ids for r in results] == expected, (k_max, how)


def test_buckets():
    assert pow2_buckets(17) == [1, 2, 4, 8, 16, 17] and pow2_buckets(16) == [1, 2, 4, 8, 16]
    assert pow2_buckets(1) == [1] and pow2_buckets(5) == [1, 2, 4, 5]
    assert bucket(273 + 6, PREFIX_BUCKETS) == 384 and bucket(16 * 273 + 6, PREFIX_BUCKETS) == 4608
    with pytest.raises(ValueError):
        bucket(10**9, PREFIX_BUCKETS)
    with pytest.raises(ValueError):
        pow2_buckets(0)


def test_logprobs_and_fast_mode_at_threshold_one(models, official):
    """Each emitted token's log-probability is official's (plain, and lossless with drafts); fast mode at threshold
    1 accepts only what lossless accepts."""
    loaded = models[8]
    expected = [official(8, i) for i in range(len(CHUNKS))]
    reference = [official_generate(loaded, c, "single" if len(c) == 1 else "multi", limit(8, i)).logprobs
                 for i, c in enumerate(CHUNKS)]
    for mode, drafts, threshold in (("plain", None, 0.3), ("lossless", "half", 0.3), ("fast", "half", 1.0)):
        results = decode_all(loaded, expected, mode, 3, drafts=drafts, fast_threshold=threshold)
        assert [r.output_ids for r in results] == expected, mode
        assert sum(r.stats["relaxed_tokens"] for r in results) == 0
        for r, want in zip(results, reference):
            torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(want), rtol=1e-4, atol=1e-4)


def test_logprobs_are_python_floats_that_json_can_store(models, official):
    """The worker stores each page's log-probabilities and quality figures as JSON: every log-probability must be a
    Python float, those of verified drafts included (not numpy scalars from the step's summary)."""
    loaded = models[8]
    expected = [official(8, i) for i in range(len(CHUNKS))]
    results = decode_all(loaded, expected, "lossless", 3, drafts="half")
    assert [r.output_ids for r in results] == expected
    kinds = {type(lp).__name__ for r in results for lp in r.logprobs}
    assert kinds == {"float"}, kinds
    json.dumps([r.logprobs for r in results])


def test_moe_auto_choice():
    from engine.kernels.static_moe import resolve

    assert resolve("auto", torch.device("cpu"), torch.float32) == "grouped"
    assert resolve("auto", torch.device("cuda"), torch.bfloat16) == "grouped"
    assert resolve("auto", torch.device("cuda"), torch.float32) == "gather"  # grouped_mm is bf16-only on CUDA
    assert resolve("dense", torch.device("cuda"), torch.float32) == "dense"
    with pytest.raises(ValueError):
        resolve("sparse", torch.device("cpu"), torch.float32)


def test_without_cuda_the_engine_runs_eagerly(models, official):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: auto means graphs")
    engine = BatchEngine(models[8], "plain")
    assert engine.graphs is None and not cuda_graphs_available()[0]
    (res,) = engine.run([engine.prepare(CHUNKS[0], limit(8, 0))])
    assert res.output_ids == official(8, 0) and res.stats["backend"] == "eager"
    with pytest.raises(GraphCaptureError):
        StepGraphs(lambda key: (), "cuda")


def test_a_failed_graph_capture_falls_back_to_eager_steps_and_loses_nothing(models, official):
    class Failing:
        """Stands in for `StepGraphs` whose capture fails (a host sync in a kernel, out of memory ...)."""

        captured, capture_s = 0, 0.0

        def __init__(self):
            self.tried, self.graphs = [], {}

        def ready(self, key):
            return True  # capture now

        def capture(self, key):
            self.tried.append(key)
            raise GraphCaptureError(f"capture of {key} failed: simulated")

        replay = capture

        def clear(self):
            pass

    loaded = models[8]
    expected = [official(8, i) for i in range(len(CHUNKS))]
    vocab = loaded.model.config.text_config.vocab_size
    engine = BatchEngine(loaded, "lossless", max_batch=3, drafter_factory=lambda r: [ReplayDrafter(r.replay_ids)])
    engine.graphs = failing = Failing()
    results = engine.run([engine.prepare(c, limit(8, i), replay_ids=corrupt(ids, vocab, "half", i))
                          for i, (c, ids) in enumerate(zip(CHUNKS, expected))])
    assert [r.output_ids for r in results] == expected
    assert len(failing.tried) == 1 and engine.graphs is None  # tried once, then every step ran eagerly
    assert {r.stats["backend"] for r in results} == {"eager"}


def test_graphs_kept_for_the_most_recently_used_prefix_buckets():
    graphs = object.__new__(StepGraphs)  # the bookkeeping only: no CUDA needed
    graphs.graphs, graphs._recent, graphs.max_groups = {}, [], 2
    for prefix_bucket in [384, 4608, 384, 512]:
        graphs.touch(prefix_bucket)
        for rows, width in [(1, 1), (4, 2)]:
            graphs.graphs.setdefault((rows, width, prefix_bucket), ("graph", ()))
    assert sorted(graphs.graphs) == [(1, 1, 384), (1, 1, 512), (4, 2, 384), (4, 2, 512)]  # 4608: least recent
    graphs.clear()
    assert not graphs.graphs and not graphs._recent


# --- CUDA (the GPU machine) ---------------------------------------------------------------------------------------

@CUDA
@pytest.mark.parametrize("window", [8, 128])
def test_cuda_graph_batches_equal_official_fp32(tmp_path, window):
    folder = build_tiny_model(tmp_path / "m", sliding_window=window, seed=0)
    loaded = load_model(str(folder), "cuda", "float32")
    expected = [official_generate(loaded, c, "single" if len(c) == 1 else "multi", limit(window, i)).output_ids
                for i, c in enumerate(CHUNKS)]
    for mode, drafts in (("plain", None), ("lossless", "half"), ("lossless", "right")):
        results = decode_all(loaded, expected, mode, 3, drafts=drafts, name=window)
        assert [r.output_ids for r in results] == expected, (mode, drafts)
        assert results[0].stats["backend"] == "graphs"


@CUDA
def test_cuda_graphs_with_the_block_drafter_equal_official_fp32(tmp_path):
    """The block drafter's own graphs (`engine.drafters.block_rows`) beside the step graphs: every chunk exact."""
    from engine.drafters.block import BlockDrafterConfig, BlockDrafterNet

    folder = build_tiny_model(tmp_path / "m", sliding_window=8, seed=0)
    loaded = load_model(str(folder), "cuda", "float32")
    expected = [official_generate(loaded, c, "single" if len(c) == 1 else "multi", limit(8, i)).output_ids
                for i, c in enumerate(CHUNKS)]
    hidden = loaded.model.config.text_config.hidden_size
    torch.manual_seed(0)
    net = BlockDrafterNet(BlockDrafterConfig(target_hidden=hidden, layers=[0, 2], block=4, context=8, dim=32,
                                             num_layers=1, num_heads=2, memory=True)).to("cuda").eval()
    engine = BatchEngine(loaded, "lossless", max_batch=3, block_net=net.requires_grad_(False), drafters=("block",),
                         block_sits_out=False, adaptive_width=False)
    results = engine.run([engine.prepare(c, limit(8, i)) for i, c in enumerate(CHUNKS)])
    assert [r.output_ids for r in results] == expected
    assert results[0].stats["backend"] == "graphs" and engine.block.graphs is not None
    assert sum(r.stats["drafters"]["block"]["rounds"] for r in results) > 0


@CUDA
def test_cuda_invariant_kernels_in_bf16_do_not_depend_on_the_batch(tmp_path):
    folder = build_tiny_model(tmp_path / "m", sliding_window=128, seed=0)
    loaded = load_model(str(folder), "cuda", "bfloat16")
    chunks = [[text_page(i), text_page(i + 1)] if i % 3 == 0 else [text_page(i)] for i in range(16)]
    alone = BatchEngine(loaded, "plain", max_batch=1, kernels="invariant")
    solo = alone.run([alone.prepare(chunks[0], 200)])[0]
    engine = BatchEngine(loaded, "lossless", max_batch=16, kernels="invariant")
    batch = engine.run([engine.prepare(c, 200, replay_ids=solo.output_ids if i == 0 else None)
                        for i, c in enumerate(chunks)])
    assert batch[0].output_ids == solo.output_ids and batch[0].logprobs == solo.logprobs


def test_the_decoder_serves_a_decode_while_chunks_are_in_flight(models, official):
    """`EngineDecoder.decode` (an orientation probe, say) runs beside submitted chunks; those that end meanwhile come
    back from the next poll, every one exact."""
    from engine.chunk_decode import EngineDecoder

    loaded = models[8]
    decoder = EngineDecoder(BatchEngine(loaded, "lossless", max_batch=3))
    for i in (0, 1, 2):
        assert decoder.submit(i, CHUNKS[i], 4096, limit(8, i)) is None
    probe = decoder.decode(CHUNKS[3], 4096, 20)
    assert probe.output_ids == official(8, 3, 20)
    outputs = {}
    while decoder.busy or len(outputs) < 3:
        outputs.update(decoder.poll())
    assert {k: out.output_ids for k, out in outputs.items()} == {i: official(8, i) for i in (0, 1, 2)}
    assert decoder.free_rows == 3


def test_a_chunk_that_does_not_fit_alone_comes_back_with_its_error(models, official, monkeypatch):
    from engine.chunk_decode import EngineDecoder

    loaded = models[8]
    decoder = EngineDecoder(BatchEngine(loaded, "plain", max_batch=2))
    real = decoder.engine.forward.step_body

    def alone_too_big(n, w, prefix_bucket):
        row = decoder.engine.rows[0]
        if decoder.engine.active == 1 and row is not None and row.request.key == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(n, w, prefix_bucket)

    monkeypatch.setattr(decoder.engine.forward, "step_body", alone_too_big)
    decoder.engine.row_limit = 1  # one row: chunk 1 alone, chunk 2 waits in the queue
    for i in (1, 2):
        decoder.submit(i, CHUNKS[i], 4096, limit(8, i))
    results = {}
    while decoder.busy:
        results.update(decoder.poll())
    assert isinstance(results[1], torch.OutOfMemoryError)
    assert results[2].output_ids == official(8, 2)  # the queue went on
