"""Lazy step graphs (`engine.kernels.step_graphs`), on the CPU: a shape runs eagerly until its ``capture_after``-th
use, is captured then (one key at a time, never the other widths of its batch), and the engine's tokens stay exact
whichever steps ran eagerly or from a graph."""

from __future__ import annotations

import pytest

from engine.batch.engine import BatchEngine
from engine.drafters.suffix_match import ReplayDrafter
from engine.kernels.step_graphs import StepGraphs
from engine.model.load import load_model
from engine.model.tiny import build_tiny_model
from engine.official import official_generate
from tests.conftest import text_page

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def bookkeeping(capture_after: int = 2) -> StepGraphs:
    graphs = object.__new__(StepGraphs)  # the bookkeeping only: no CUDA needed
    graphs.graphs, graphs._recent, graphs.max_groups, graphs.uses = {}, [], 4, {}
    graphs.capture_after = capture_after
    return graphs


def test_a_shape_is_captured_at_its_second_use():
    graphs = bookkeeping()
    assert not graphs.ready((4, 1, 384))  # first use: eager
    assert graphs.ready((4, 1, 384))  # second: capture and replay
    assert not graphs.ready((4, 2, 384))  # another width of the same rows: not captured with it
    graphs.graphs[(4, 1, 384)] = ("graph", ())
    assert graphs.ready((4, 1, 384))
    assert bookkeeping(capture_after=1).ready((1, 1, 128))


def test_steps_run_eagerly_until_captured_and_stay_exact(tmp_path, equal_step_costs):
    class Recording:
        """Stands in for `StepGraphs`: its bookkeeping, with 'replay' running the body eagerly (CPU)."""

        captured, capture_s = 0, 0.0

        def __init__(self, body):
            self.body, self.graphs, self.uses, self.capture_after = body, {}, {}, 6
            self.eager, self.replays = [], []

        ready = StepGraphs.ready

        def replay(self, key):
            if key not in self.graphs:
                self.graphs[key] = None
                self.captured += 1
            self.replays.append(key)
            return self.body(key)

        def clear(self):
            self.graphs.clear()

    loaded = load_model(str(build_tiny_model(tmp_path / "m", seed=0, sliding_window=8)), "cpu", "float32")
    chunks = [[text_page(i)] for i in range(3)]
    expected = [official_generate(loaded, c, "single", 30).output_ids for c in chunks]
    engine = BatchEngine(loaded, "lossless", max_batch=3, drafter_factory=lambda r: [ReplayDrafter(r.replay_ids)])
    engine.graphs = graphs = Recording(engine.forward.step_key)
    results = engine.run([engine.prepare(c, 30, replay_ids=ids[:10] + [0] * 20) for c, ids in zip(chunks, expected)])
    assert [r.output_ids for r in results] == expected
    assert graphs.captured == len(graphs.graphs) and graphs.captured >= 1
    assert all(graphs.uses[key] >= 6 for key in graphs.graphs)  # no shape used fewer times was captured
    rare = [key for key, uses in graphs.uses.items() if uses < 6]
    assert rare and not set(rare) & set(graphs.graphs)
