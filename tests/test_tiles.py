"""Tile configurations chosen by measurement (engine/kernels/tiles.py): never one whose bits differ from the default's,
the fastest of the others per rows bucket, the default until tuned; and the invariant kernels run the configuration
they are given (CPU: Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import invariant as K
from engine.kernels.tiles import DEFAULT, NARROW, TileTable, rows_bucket

A, B, C = (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (128, 128, 64, 8, 3)


def test_untuned_table_runs_the_default_tiles():
    table = TileTable()
    assert table.pick("linear", 1280, 1280, 7) == DEFAULT and table.pick("grouped", 1792, 1280, 9000) == DEFAULT
    assert table.pick("linear", 64, 1280, 300) == NARROW  # the router's shape keeps its narrow tiles
    assert [rows_bucket(m) for m in (1, 16, 17, 256, 257, 5000)] == [16, 16, 64, 256, 1024, 4096]


def test_tune_keeps_the_fastest_bitwise_equal_config_per_bucket():
    weight = torch.zeros(128, 32)
    costs = {16: {DEFAULT: 1.0, A: 2.0, B: 0.5, C: 0.1}, 1024: {DEFAULT: 3.0, A: 1.0, B: 0.5, C: 0.2}}
    calls = []

    def run(config, m, inputs):
        calls.append((config, m))
        if config == C and m == 1024:
            raise RuntimeError("out of shared memory")  # a candidate the card cannot run: dropped everywhere
        out = inputs.sum(dim=1, keepdim=True).expand(m, 128).clone()
        return out + 1e-3 if config == B else out  # B's bits differ from the default's: never chosen

    def timer(fn):
        fn()
        config, m = calls[-1]
        return costs[m][config]

    table = TileTable()
    table.tune("linear", weight, run, candidates=(DEFAULT, A, B, C), buckets=(16, 1024), timer=timer)
    # C ran at 16 rows but failed at 1024, so it is out everywhere; B's bits differ: the fastest of the others
    assert table.pick("linear", 128, 32, 10) == DEFAULT and table.pick("linear", 128, 32, 600) == A
    assert table.pick("linear", 128, 32, 20) == DEFAULT  # a bucket not tuned: the default
    assert set(table.rejected["linear", 128, 32]) == {B, C}
    summary = table.summary()["linear 128x32"]
    assert summary["16"] == "64-64-64-4-3" and summary["1024"] == "64-128-64-4-3" and sorted(summary["not_bitwise"]) == ["128-128-64-8-3", "128-64-64-4-3"]
    n_calls = len(calls)
    table.tune("linear", weight, run, candidates=(DEFAULT, A), buckets=(16,), timer=timer)
    assert len(calls) == n_calls  # once a process and device for a shape


@pytest.mark.parametrize("config", [DEFAULT, A, B, C])
def test_kernels_run_the_config_they_are_given(config):
    torch.manual_seed(0)
    x, w = torch.randn(70, 96), torch.randn(150, 96)
    assert torch.allclose(K.matmul(x, w, config=config), x @ w.T, atol=1e-4)
    experts = torch.tensor([[0, 3], [1, 3], [1, 2], [0, 1], [2, 3]])

    class Experts:
        num_experts = 4
        gate_up_proj = torch.randn(4, 24, 96)
        down_proj = torch.randn(4, 96, 12)
        act_fn = staticmethod(torch.nn.functional.silu)

    xs = torch.randn(5, 96)
    out = K.routed_experts(Experts, xs, experts, config)
    for pair, e in enumerate(experts.reshape(-1).tolist()):
        g, u = (Experts.gate_up_proj[e] @ xs[pair // 2]).chunk(2)
        assert torch.allclose(out[pair], Experts.down_proj[e] @ (torch.nn.functional.silu(g) * u), atol=1e-3)


def test_tune_tiles_over_a_model_measures_every_shape(tiny_model_dir):
    """The tiny model's distinct linear shapes, its lm_head and its routed experts each get a tuning (the interpreter's
    times mean nothing; what is checked is that every shape is measured and every choice is bitwise the default)."""
    from engine.model.load import load_model

    loaded = load_model(tiny_model_dir, device="cpu", dtype="float32")
    table = TileTable()
    K.tune_tiles(loaded.model, table, candidates=(DEFAULT, A), buckets=(16,))
    text = loaded.model.model.language_model
    shapes = {tuple(m.weight.shape) for m in text.modules() if isinstance(m, torch.nn.Linear)}
    shapes.add(tuple(loaded.model.lm_head.weight.shape))
    tuned = {(n, k) for kind, n, k, _ in table.tuned if kind == "linear"}
    assert tuned == {s for s in shapes if s[0] > 64}
    assert any(kind == "grouped" for kind, *_ in table.tuned)
    assert all(c in (DEFAULT, A) for c in table.choice.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tuned_tiles_give_the_default_bits_on_the_card(tiny_model_dir):
    """bf16 on the GPU: every configuration the tuning kept gives, at row counts it was not tuned at, the bits of the
    default tiles (rows computed alone or among others alike)."""
    from engine.model.load import load_model

    loaded = load_model(tiny_model_dir, device="cuda", dtype="bfloat16")
    table = TileTable()
    K.tune_tiles(loaded.model, table)
    assert table.choice  # something was measured
    head = loaded.model.lm_head.weight
    for m in (1, 37, 300, 2000):
        x = torch.randn(m, head.shape[1], device="cuda", dtype=torch.bfloat16)
        config = table.pick("linear", head.shape[0], head.shape[1], m)
        out = K.matmul(x, head, config=config)
        assert torch.equal(out, K.matmul(x, head, config=DEFAULT))
        assert torch.equal(out[:1], K.matmul(x[:1], head, config=table.pick("linear", *head.shape, 1)))
