"""Admission in bounded pieces and out of memory at admission (CPU, fp32, a tiny random model): chunks admitted a
piece a turn while other rows decode, and an out-of-memory error injected at admission (several chunks at once,
one chunk beside rows in flight, one chunk alone) shrink the admission or the batch; every chunk still ends once,
token-identical to official ``generate()`` of that chunk alone."""

from __future__ import annotations

import pytest
import torch

from engine.batch.admission import next_group
from engine.batch.engine import BatchEngine
from engine.chunk_decode import EngineDecoder
from engine.model.load import load_model
from engine.model.tiny import build_tiny_model
from engine.official import official_generate
from tests.conftest import text_page

PAGES = [text_page(i) for i in range(6)]
CHUNKS = [[PAGES[0]], PAGES[1:4], [PAGES[4]], PAGES[2:5], [PAGES[5]]]  # 1- and 3-page chunks
TOKENS = 40

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("admission") / "m", seed=0, sliding_window=8)
    return load_model(str(folder), "cpu", "float32")


@pytest.fixture(scope="module")
def expected(loaded):
    return [official_generate(loaded, c, "single" if len(c) == 1 else "multi", TOKENS).output_ids for c in CHUNKS]


def oom(when):
    """An admission hook that raises out of memory the first time ``when(requests)`` holds."""
    fired = []

    def hook(requests):
        if not fired and when(requests):
            fired.append(len(requests))
            raise torch.OutOfMemoryError("CUDA out of memory (injected at admission)")

    hook.fired = fired
    return hook


def run_all(engine: BatchEngine) -> dict:
    """Every chunk through ``engine``; each key must end exactly once."""
    for i, chunk in enumerate(CHUNKS):
        engine.submit(engine.prepare(chunk, TOKENS, key=i))
    ended: dict = {}
    while engine.busy:
        for res in engine.step():
            assert res.request.key not in ended, "a chunk produced twice"
            ended[res.request.key] = res.output_ids
    return ended


@pytest.mark.parametrize("mode", ["plain", "lossless"])
def test_admission_runs_a_piece_a_turn_between_steps(loaded, expected, mode):
    engine = BatchEngine(loaded, mode, max_batch=5, admit_tokens=1)  # one chunk a turn
    for i, chunk in enumerate(CHUNKS):
        engine.submit(engine.prepare(chunk, TOKENS, key=i))
    engine.step()
    assert engine.active == 1 and len(engine.pending) == 4  # the first chunk decodes while the others wait
    engine.step()
    assert engine.active == 2
    ended = {}
    while engine.busy:
        ended.update({r.request.key: r.output_ids for r in engine.step()})
    assert [ended[i] for i in range(len(CHUNKS))] == expected


def test_groups_are_bounded_by_rows_pages_and_tokens(loaded):
    engine = BatchEngine(loaded, "plain", max_batch=5)
    pending = [engine.prepare(c, TOKENS, key=i) for i, c in enumerate(CHUNKS)]  # 1, 3, 1, 3, 1 pages
    assert len(next_group(pending, 5, 64, 10**6)) == 5
    assert len(next_group(pending, 2, 64, 10**6)) == 2
    assert len(next_group(pending, 5, 4, 10**6)) == 2  # 1 + 3 pages
    assert len(next_group(pending, 5, 1, 1)) == 1  # at least one chunk: the turn's first group
    assert not next_group(pending, 5, 1, 1, first=False)  # a later group of the turn keeps within its budget


def test_out_of_memory_admitting_several_chunks_halves_the_group_and_loses_nothing(loaded, expected):
    engine = BatchEngine(loaded, "plain", max_batch=5)
    engine.admission_hook = hook = oom(lambda requests: len(requests) > 1)
    ended = run_all(engine)
    assert hook.fired == [5] and engine.admit_pages == 4  # 9 pages asked, 4 a group from then on
    assert engine.row_limit == 5  # the batch did not shrink: the admission did
    assert [ended[i] for i in range(len(CHUNKS))] == expected


def test_out_of_memory_admitting_beside_rows_in_flight_shrinks_the_batch(loaded, expected):
    """Without memory figures (the CPU) the batch halves, and the cache gives the memory of the rows above back."""
    engine = BatchEngine(loaded, "lossless", max_batch=5, admit_tokens=1)
    engine.admission_hook = hook = oom(lambda requests: engine.active == 2)
    ended = run_all(engine)
    assert hook.fired == [1] and engine.row_limit == 2 and engine.kv.rows == 2
    assert [ended[i] for i in range(len(CHUNKS))] == expected


def test_out_of_memory_admitting_frees_the_rows_admission_lacks_at_once(loaded, expected, monkeypatch):
    """Admission lacks 2.5 rows' worth of memory (nothing free but what dropped rows give back): three rows go in one
    shrink, their chunks queued again from the start, and no more once the free memory covers the need; a second
    error, with a need raised to 3.5 rows, takes the one row more it lacks; every chunk ends once, exact."""
    engine = BatchEngine(loaded, "plain", max_batch=5, admit_tokens=1)
    per_row = engine.kv.bytes_per_row()
    engine.admission_need = int(2.5 * per_row)
    monkeypatch.setattr(engine, "free_memory", lambda: (5 - engine.kv.rows) * per_row)  # what the dropped rows held
    fired = []

    def hook(requests):
        if engine.active == 4 and not fired or engine.active == 1 and len(fired) == 1:
            fired.append(engine.active)
            if len(fired) == 2:
                engine.admission_need = int(3.5 * per_row)
            raise torch.OutOfMemoryError("CUDA out of memory (injected at admission)")

    engine.admission_hook = hook
    ended = run_all(engine)
    assert fired == [4, 1]
    first, second = engine.memory_events
    assert (first["rows_before"], first["rows"], first["queued_again"]) == (5, 2, 2)
    assert (second["rows_before"], second["rows"]) == (2, 1)
    assert "2.5" not in first["reason"] and "GiB needed" in first["reason"]
    assert engine.row_limit == engine.kv.rows == 1 and engine.kv.keys[0].shape[0] == 1
    assert [ended[i] for i in range(len(CHUNKS))] == expected


def test_rows_dropped_after_admission_runs_out_of_memory():
    """The figures of a 16-page stand-in run: rows of 265 MiB, 12.9 GiB needed, 2 GiB free: 42 rows' worth lacking,
    43 rows go at once; enough free by the figures: one row still (the figures were short); the size a failed
    allocation asked for is read from torch's message."""
    from engine.batch.admission import failed_allocation
    from engine.batch.memory import rows_to_drop

    mib, gib = 2**20, 2**30
    assert rows_to_drop(265 * mib, int(12.9 * gib), 2 * gib) == 43
    assert rows_to_drop(265 * mib, gib, 5 * gib) == 1
    message = "CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity of 79.18 GiB of which"
    assert failed_allocation(torch.OutOfMemoryError(message)) == 3 * gib
    assert failed_allocation(torch.OutOfMemoryError("Tried to allocate 512.00 MiB.")) == 512 * mib
    assert failed_allocation(torch.OutOfMemoryError("injected")) == 0


def test_the_cache_keeps_fewer_rows_with_their_contents_and_frees_the_rest(loaded, monkeypatch):
    """`KVSlots.keep_rows`: the first rows' keys and values unchanged, the buffers smaller; a copy that does not fit
    leaves a view of the old buffer (right shape), given back by the next call."""
    engine = BatchEngine(loaded, "plain", max_batch=5)
    kv = engine.kv
    with torch.inference_mode():
        for buf in [*kv.keys, *kv.values]:
            buf.normal_()
    kept = [b[:3].clone() for b in [*kv.keys, *kv.values]]
    before = kv.nbytes()
    assert kv.keep_rows(3) and kv.rows == 3
    assert all(torch.equal(b, k) for b, k in zip([*kv.keys, *kv.values], kept))
    assert kv.nbytes() == before - 2 * kv.bytes_per_row()
    assert not kv.keep_rows(3) and not kv.keep_rows(4)
    real = kv.zeros
    monkeypatch.setattr(kv, "zeros", lambda shape: (_ for _ in ()).throw(torch.OutOfMemoryError("injected")))
    assert kv.keep_rows(2) and all(b.shape[0] == 2 for b in [*kv.keys, *kv.values])
    assert all(b.untyped_storage().nbytes() > b.numel() * b.element_size() for b in kv.keys)  # views
    monkeypatch.setattr(kv, "zeros", real)
    assert kv.keep_rows(2)
    assert all(b.untyped_storage().nbytes() == b.numel() * b.element_size() for b in [*kv.keys, *kv.values])
    assert all(torch.equal(b, k[:2]) for b, k in zip([*kv.keys, *kv.values], kept))


def test_a_chunk_that_does_not_fit_alone_at_admission_comes_back_with_its_error(loaded, expected):
    engine = BatchEngine(loaded, "plain", max_batch=2)
    engine.admission_hook = oom(lambda requests: requests[0].key == 1)
    decoder = EngineDecoder(engine)
    engine.row_limit = 1
    for i in (0, 1, 2):
        decoder.submit(i, CHUNKS[i], 4096, TOKENS)
    results = {}
    while decoder.busy:
        for key, out in decoder.poll():
            assert key not in results
            results[key] = out
    assert isinstance(results[1], torch.OutOfMemoryError)
    assert results[0].output_ids == expected[0] and results[2].output_ids == expected[2]


def test_a_cache_that_cannot_grow_for_every_row_keeps_fewer_rows_and_loses_nothing(loaded, expected, monkeypatch):
    """A longer prefix arrives while rows decode, and the grown cache fits only 2 of the 5 rows (out of memory
    injected into the cache's allocation): rows 2 and up go back to the queue, the first two keep their prefixes."""
    from engine.batch.admission import _make_room

    engine = BatchEngine(loaded, "lossless", max_batch=5, drafter_factory=lambda r: [])
    for i, chunk in enumerate(CHUNKS):
        engine.submit(engine.prepare(chunk, TOKENS, key=i))
    ended = {r.request.key: r.output_ids for r in engine.step()}
    engine.step()
    assert engine.active == 5
    real = engine.kv.zeros

    def short(shape):
        if shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected into the cache)")
        return real(shape)

    monkeypatch.setattr(engine.kv, "zeros", short)
    assert _make_room(engine, 200)
    assert engine.kv.rows == 2 and engine.row_limit == 2 and engine.active == 2 and len(engine.pending) == 3
    while engine.busy:
        for res in engine.step():
            assert res.request.key not in ended
            ended[res.request.key] = res.output_ids
    assert [ended[i] for i in range(len(CHUNKS))] == expected


def test_the_auto_batch_keeps_room_for_the_vision_towers_attention_scores():
    """SAM's global attention materialises a score matrix per head and page: at the real model's 1024-pixel pages in
    bf16, 8 pages a vision call allocate 3 GiB in one piece (the allocation that once ran a 16-page batch out of
    memory at admission). The admission reserve holds it twice (scores and softmax) beside the rest, and grows with
    the pages a vision call takes."""
    from types import SimpleNamespace

    from transformers import UnlimitedOcrConfig

    from engine.batch.memory import VISION_BASE, admission_bytes, vision_bytes

    real = SimpleNamespace(model=SimpleNamespace(config=UnlimitedOcrConfig()), dtype=torch.bfloat16)
    scores_8_pages = 8 * 12 * (1024 // 16) ** 4 * 2
    assert scores_8_pages == 3 * 2**30
    assert vision_bytes(real) == VISION_BASE + 2 * scores_8_pages
    assert vision_bytes(real, vision_group=4) == VISION_BASE + scores_8_pages
    assert admission_bytes(real) - admission_bytes(real, vision_group=4) == scores_8_pages


def test_a_group_smaller_than_a_padded_vision_call_waits_a_few_turns_while_rows_decode():
    """Padded vision (batch-invariant kernels) costs a full call whatever it holds: a 1-page group waits up to
    ``ADMIT_WAIT_TURNS`` turns while rows decode; a full call's worth of pages, no row decoding, or unpadded vision
    go at once."""
    from types import SimpleNamespace

    from engine.batch.admission import ADMIT_WAIT_TURNS, worth_a_vision_call

    one, four = SimpleNamespace(n_pages=1), SimpleNamespace(n_pages=4)
    engine = SimpleNamespace(pad_vision=True, active=3, vision_group=8, admit_waited=0)
    assert [worth_a_vision_call(engine, [one]) for _ in range(ADMIT_WAIT_TURNS + 1)] == [False] * ADMIT_WAIT_TURNS + [
        True
    ]
    assert engine.admit_waited == 0 and not worth_a_vision_call(engine, [one, four])
    assert worth_a_vision_call(engine, [four, four]) and engine.admit_waited == 0
    assert worth_a_vision_call(SimpleNamespace(pad_vision=True, active=0, vision_group=8, admit_waited=0), [one])
    assert worth_a_vision_call(SimpleNamespace(pad_vision=False, active=3, vision_group=8, admit_waited=0), [one])


def test_waiting_to_fill_vision_calls_changes_no_token(loaded, expected, monkeypatch):
    """Padded vision groups (as with batch-invariant kernels): the chunks end with official ``generate()``'s tokens,
    each once, whether small groups wait or go at once; the wait moves admissions."""
    import engine.batch.admission as admission

    def run(wait_turns):
        monkeypatch.setattr(admission, "ADMIT_WAIT_TURNS", wait_turns)
        engine = BatchEngine(loaded, "plain", max_batch=3, vision_group=4, admit_tokens=1)
        engine.pad_vision = True
        admitted = []
        engine.admission_hook = lambda requests: admitted.append((engine.steps, [r.key for r in requests]))
        ended = run_all(engine)
        return [ended[i] for i in range(len(CHUNKS))], admitted

    waited, when_waiting = run(4)
    at_once, when_at_once = run(0)
    assert waited == at_once == expected
    assert when_waiting != when_at_once


def test_the_cache_grows_a_buffer_at_a_time_and_steps_down_by_a_tenth(loaded, monkeypatch):
    """Growing the prefix region never holds two caches: at any allocation the live buffers are the cache and one
    new buffer at most. When the grown cache does not fit for every row, the rows step down by about a tenth (not by
    halves) until it does."""
    import weakref

    from engine.model.kv_slots import KVSlots

    kv = KVSlots(num_layers=3, num_kv_heads=2, head_dim=8, window=8, max_batch=100, max_width=4, prefix_capacity=128,
                 dtype=torch.float32, device="cpu")
    live: list = []
    real = kv.zeros

    def tracked(shape):
        held = sum(t.numel() for t in (ref() for ref in live) if t is not None)
        peak.append(held)
        buffer = real(shape)
        live.append(weakref.ref(buffer))
        return buffer

    before = sum(t.numel() for t in [*kv.keys, *kv.values])
    live.extend(weakref.ref(t) for t in [*kv.keys, *kv.values])
    peak: list = []
    monkeypatch.setattr(kv, "zeros", tracked)
    kv.ensure_capacity(512)
    grown = sum(t.numel() for t in [*kv.keys, *kv.values])
    # at any allocation: the buffers grown so far and those not yet, never both copies of the cache
    assert grown > before and max(peak) <= grown - grown // 6 + before // 6
    monkeypatch.setattr(kv, "zeros", lambda shape: (_ for _ in ()).throw(torch.OutOfMemoryError("injected"))
                        if shape[0] > 81 and shape[1] > kv.ring_size + 512 else real(shape))
    kv.ensure_capacity(1024)
    assert kv.rows == 81 and kv.capacity >= 1024  # 100 and 90 rows did not fit: 90% of the rows each time
    assert all(b.shape[:2] == (81, kv.ring_size + kv.capacity) for b in [*kv.keys, *kv.values])


def test_a_closed_engine_holds_no_buffers_and_a_dropped_one_goes_at_once(loaded):
    """``close`` frees the cache, the step buffers and the queue whoever still holds the engine; an engine nobody
    holds is freed by reference counting alone (no cycle waits for the garbage collector). A closed engine refuses new
    chunks."""
    import gc
    import weakref

    engine = BatchEngine(loaded, "lossless", max_batch=2)
    engine.run([engine.prepare(CHUNKS[0], 8)])
    engine.submit(engine.prepare(CHUNKS[1], 8))
    engine.close()
    assert engine.kv.keys == [] and engine.forward.logits is None and not engine.busy and engine.graphs is None
    with pytest.raises(RuntimeError, match="closed"):  # queued there, a chunk would wait for ever
        engine.submit(engine.prepare(CHUNKS[0], 8))
    other = BatchEngine(loaded, "lossless", max_batch=2)
    other.run([other.prepare(CHUNKS[0], 8)])
    gone = weakref.ref(other)
    gc.disable()
    try:
        del other
        assert gone() is None
    finally:
        gc.enable()


def test_a_step_never_runs_more_tokens_than_its_buffers_hold(loaded, expected):
    """``step_tokens``: 4 rows of 3-token steps at most (12 tokens): a batch of 4 runs at width 2 at most, of 1 row at
    width 8 (the step buffers hold 12 tokens); every chunk still equals ``generate()``."""
    engine = BatchEngine(loaded, "lossless", max_batch=4, k_max=7, adaptive_width=False, step_tokens=12,
                         drafter_factory=lambda r: [type("Ahead", (), {"name": "ahead",
                                                                       "propose": lambda self, c, k: [5] * k})()])
    assert engine.forward.logits.numel() == 12 * engine.forward.vocab
    assert [engine.widest_at(n) for n in (1, 2, 4)] == [8, 4, 2]
    ended = run_all(engine)
    assert max(engine.width_steps) == 8 and [ended[i] for i in range(len(CHUNKS))] == expected



def test_vision_ahead_of_admission_changes_no_token_and_a_failure_turns_it_off(loaded, expected):
    """Vision ahead (`engine.batch.vision_ahead`; off CUDA the same sums, made earlier): with 2 rows and 5 chunks the
    waiting chunks' pages go through the tower while the rows decode; every chunk ends once, equal to ``generate()``.
    A failure ahead is said, its embeddings dropped, and admission makes them itself."""
    engine = BatchEngine(loaded, "lossless", max_batch=2, vision_ahead=True)
    assert run_all(engine) == dict(enumerate(expected)) and engine.ahead.pages > 0
    assert engine.timing["vision_ahead_s"] > 0
    failing = BatchEngine(loaded, "plain", max_batch=2, vision_ahead=True)
    failing.ahead._embed = lambda engine, take: (_ for _ in ()).throw(torch.OutOfMemoryError("injected ahead"))
    assert run_all(failing) == dict(enumerate(expected)) and not failing.ahead.enabled and failing.ahead.pages == 0
    assert not BatchEngine(loaded, "plain", max_batch=1).ahead.enabled  # auto: on CUDA only
