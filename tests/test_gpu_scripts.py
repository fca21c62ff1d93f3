"""Smoke tests of the GPU scripts in their CPU modes (tiny random models, eager steps, short outputs)."""

from __future__ import annotations

import json

import torch

from scripts.bench import engine as bench_engine
from scripts.bench import gpu_check
from tests.conftest import text_page


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _keeping_threads(run):
    threads = torch.get_num_threads()
    try:
        return run()
    finally:
        torch.set_num_threads(threads)


class TickClock:
    """A stand-in for ``time`` in the bench: each perf_counter() call moves on by ``tick`` seconds."""

    def __init__(self):
        self.now, self.tick = 0.0, 1.0

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now


def test_bench_engine_tiny_smoke(tmp_path, capsys, monkeypatch, equal_step_costs):
    """A timed generate() reads the clock twice (start, end), a timed engine run three times (start, first finished
    chunk, end): the test's ticks make generate take 2 s, plain 1 s and lossless 0.5 s, so every rate and ratio in
    the record has a value the test knows."""
    clock = TickClock()
    monkeypatch.setattr(bench_engine, "time", clock)
    seconds = {"generate": 2.0, "plain": 1.0 / 2, "lossless": 0.5 / 2}  # a tick each read after the first

    def timed(run, mode_of):
        def wrapper(*args, **kw):
            clock.tick = seconds[mode_of(args, kw)]
            try:
                return run(*args, **kw)
            finally:
                clock.tick = 1.0
        return wrapper

    monkeypatch.setattr(bench_engine, "run_generate", timed(bench_engine.run_generate, lambda a, kw: "generate"))
    monkeypatch.setattr(bench_engine, "run_engine", timed(bench_engine.run_engine, lambda a, kw: a[4]))
    path = tmp_path / "bench.json"
    rc = _keeping_threads(lambda: bench_engine.main(["--tiny", "--batch", "1,2", "--pages", "1", "--tokens", "24",
                                                     "--rates", "10", "--mem-tokens", "", "--json", str(path)]))
    report = _last_json(capsys)
    assert rc == 0 and report == json.loads(path.read_text())
    assert {"torch", "transformers", "gpu"} <= set(report["environment"]) and "error" not in report
    assert [(r["pages"], r["batch"]) for r in report["results"]] == [(1, 1), (1, 2)]
    for res in report["results"]:
        runs = res["runs"]
        assert not res["errors"] and set(runs) == {"generate", "plain", "lossless-10%"}  # torch kernels on the CPU
        assert all(r["tokens"] == 24 * res["batch"] for r in runs.values())
        assert res["generate_equal_tokens"] and runs["generate"]["warm_tokens"] == 8  # the anchor at equal tokens
        assert runs["plain"]["backend"] == "eager" and runs["generate"]["x_generate"] == 1.0
        tokens = 24 * res["batch"]
        assert {name: (r["tok_s"], r["x_generate"], r["x_plain"]) for name, r in runs.items()} == {
            "generate": (tokens / 2.0, 1.0, 0.5), "plain": (tokens / 1.0, 2.0, 1.0),
            "lossless-10%": (tokens / 0.5, 4.0, 2.0)}
        assert runs["lossless-10%"]["equal_to_plain"] and runs["lossless-10%"]["tau"] >= 3  # drafts 90% right
        assert runs["lossless-10%"]["width_reasons"].get("wide pays", 0) > 0  # why each width was chosen


def test_bench_engine_planted_chain_keeps_bf16_drafts_aligned(capsys, equal_step_costs):
    """``--plant``: a wide-margin successor chain, so in bf16 wide verify steps and single steps pick the same
    tokens: lossless with exact drafts equals plain and accepts long drafts."""
    rc = _keeping_threads(lambda: bench_engine.main(["--tiny", "--batch", "1", "--pages", "1", "--tokens", "200",
                                                     "--rates", "0", "--dtype", "bf16", "--plant", "30",
                                                     "--mem-tokens", "", "--no-generate"]))
    report = _last_json(capsys)
    assert rc == 0 and report["model"]["planted_chain_scale"] == 30 and report["dtype"] == "bfloat16"
    runs = report["results"][0]["runs"]
    assert runs["lossless-0%"]["equal_to_plain"] and runs["lossless-0%"]["tau"] >= 12


def test_gpu_check_cpu_smoke(tmp_path, tiny_model_dir, capsys):
    """fp32 on the CPU: official, then the engine with every chunk (1- and 4-page) in one batch, every run exact."""
    pages = tmp_path / "pages"
    pages.mkdir()
    for i in range(3):
        text_page(i).save(pages / f"page{i}.png")
    (pages / "page0.txt").write_text("page 0 line 0 text 0\n", encoding="utf-8")  # a text layer beside one page
    rc = _keeping_threads(lambda: gpu_check.main(["--model", str(tiny_model_dir), "--pages-dir", str(pages),
                                                  "--device", "cpu", "--skip-bf16", "--tokens", "12",
                                                  "--singles", "2", "--fours", "1"]))
    report = _last_json(capsys)
    assert rc == 0 and report["pages"] == 3 and "bf16" not in report
    runs = report["fp32"]["runs"]
    assert set(runs) == {"plain", "lossless", "lossless-scan"}
    assert all(r["identical"] == r["of"] == 3 for r in runs.values())


def test_bench_cpu_synth_smoke(tmp_path, capsys, equal_step_costs):
    """The CPU benchmark on held-out demo-generator pages: summed over documents, every run exact."""
    from scripts.bench import cpu as bench_cpu

    path = tmp_path / "bench.json"
    rc = _keeping_threads(lambda: bench_cpu.main(["--tiny", "--synth", "2", "--max-new-tokens", "30", "--threads",
                                                  "1", "--json", str(path)]))
    report = _last_json(capsys)
    assert rc == 0 and report == json.loads(path.read_text())
    assert report["documents"] == 2 and report["source"] == "synth"
    runs = report["results"]
    assert set(runs) == {"official", "plain", "lossless", "lossless-replay", "always-wrong"}
    assert all(r["exact"] and r["exact_jobs"] == 2 and r["tokens"] == 60 for r in runs.values())
    replay = runs["lossless-replay"]
    assert replay["tau"] > 5 and replay["forwards"] < runs["plain"]["forwards"]
    counts = replay["drafters"]["replay"]  # the earlier run's tokens: every draft accepted; a rate, not a sum of
    assert counts["acceptance"] == 1.0 and counts["accepted"] == counts["proposed"] > 0  # per-document rates
    wrong = runs["always-wrong"]["drafters"]["replay"]
    assert wrong["acceptance"] == 0.0 and wrong["accepted"] == 0 < wrong["proposed"]


def test_vision_cost_counts_the_real_tower_by_part(tmp_path, capsys):
    """The real architecture's vision tower counted on the meta device: the parts add up to the total, SAM's four
    global-attention layers and its windowed ones both carry a share, and the JSON line is the record written."""
    from scripts.bench import vision_cost

    out = tmp_path / "vision.json"
    result = vision_cost.main(["--pages", "2", "--json", str(out)])
    assert _last_json(capsys) == json.loads(out.read_text()) == result
    parts = result["gflop_per_page_by_part"]
    assert abs(sum(parts.values()) - result["gflop_per_page"]) < 0.5
    assert result["global_layers"] == [2, 5, 8, 11] and min(parts["sam_global"], parts["sam_windowed"]) > 100
    assert 1000 < result["gflop_per_page"] < 1300  # a full-size SAM-B at 1,024 px and CLIP-L
    assert result["global_bias_gib"] == 2 * 12 * 4096 * 4096 * 2 / 2**30


def test_step_cost_tiny_smoke(tmp_path, capsys):
    """The step-cost bench on the CPU: a cost for every rows x width cell, the profiled step's time split by kernel,
    and both kernel sweeps (interpreted) finding each tile configuration bitwise equal to the default."""
    from scripts.bench import step_cost

    path = tmp_path / "step_cost.json"
    rc = _keeping_threads(lambda: step_cost.main([
        "--tiny", "--pages", "1", "--rows", "1,2", "--widths", "1,2", "--profile", "2x2", "--repeat", "1",
        "--matmul-rows", "1,8", "--configs", "64-64-64-4-3,128-64-64-4-3", "--tiles", "default", "--json",
        str(path)]))
    report = _last_json(capsys)
    assert rc == 0 and report == json.loads(path.read_text())
    cells = report["steps"]["default"]["1"]["cells"]
    assert set(cells) == {"1x1", "1x2", "2x1", "2x2"} and all(c["ms"] > 0 for c in cells.values())
    assert cells["2x1"]["x_width1"] == 1.0
    assert report["profile"]["2x2"]["device_ms"] > 0 and report["profile"]["2x2"]["kernels"]
    for sweep in (report["matmul"], report["grouped"]):
        results = [r for shape in sweep.values() for r in shape.values()]
        assert results and all(r["bitwise_default"] for r in results)


def test_width_model_tiny_smoke(tmp_path, capsys):
    """The modeled GPU: every row follows its target text in both modes, plain runs width 1 only, and lossless with
    90% right drafts on the modeled costs beats it (the clock is virtual: the figures do not depend on the machine)."""
    from scripts.bench import width_model

    path = tmp_path / "width_model.json"
    rc = _keeping_threads(lambda: width_model.main(["--rows", "4", "--chunks", "6", "--tokens", "60", "--slopes",
                                                    "14.5,3.5", "--json", str(path)]))
    report = _last_json(capsys)
    assert rc == 0 and report == json.loads(path.read_text())
    assert report["plain"]["targets_followed"] and set(report["plain"]["steps_by_width"]) == {"1"}
    runs = report["slopes"]
    assert all(r["targets_followed"] and r["tokens"] == 6 * 60 for r in runs.values())
    assert runs["3.5"]["x_plain"] >= runs["14.5"]["x_plain"] > 1.3
