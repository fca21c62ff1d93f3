"""Smoke tests of the GPU scripts in their CPU modes (tiny random models, static backend, short outputs)."""

from __future__ import annotations

import json

import pytest
import torch

from scripts import bench_engine, gpu_check, profile_step


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_bench_engine_tiny_smoke(tmp_path, capsys):
    path = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    try:
        rc = bench_engine.main(["--tiny", "--quick", "--tokens", "40", "--rates", "0,100", "--moe", "grouped,gather",
                                "--attn", "sdpa,matmul", "--mem-tokens", "20,40", "--json", str(path)])
    finally:
        torch.set_num_threads(threads)
    report = _last_json(capsys)
    assert rc == 0 and report == json.loads(path.read_text())
    assert {"torch", "transformers", "gpu"} <= set(report["environment"])
    (chunk,) = report["chunks"]
    runs = chunk["runs"]
    assert set(runs) == {"official", "plain", "lossless-0%", "lossless-100%", "plain[gather]", "lossless-0%[gather]",
                         "plain[matmul]", "lossless-0%[matmul]"}
    assert not chunk["errors"] and runs["official"]["full_length"]
    assert all(r["exact"] and r["tokens"] == 40 for r in runs.values())
    assert runs["lossless-0%"]["tau"] > 5 and runs["lossless-100%"]["tau"] == 0
    assert runs["plain"]["backend"] == "static" and "verify_s" in runs["plain"]["time_split"]
    assert set(report["memory"]) >= {"20", "40"}


def test_gpu_check_tiny_smoke(capsys):
    threads = torch.get_num_threads()
    try:
        rc = gpu_check.main(["--tiny", "--pages", "1", "--bf16-pages", "1", "--max-new-tokens", "30"])
    finally:
        torch.set_num_threads(threads)
    report = _last_json(capsys)
    assert rc == 0 and report["fp32_exact"]
    fp32 = report["runs"]["float32"]["summary"]
    assert all(s["identical"] == s["pages"] == 1 for s in fp32.values())
    assert 0.0 <= report["runs"]["bfloat16"]["summary"]["plain"]["token_match_rate"] <= 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_profile_step_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["profile_step.py"])
    assert profile_step.main() == 2
    assert "needs CUDA" in capsys.readouterr().err


def test_bench_cpu_synth_smoke(tmp_path, capsys):
    """issue 5's CPU benchmark on held-out demo-generator pages: summed over documents, every run exact."""
    from scripts import bench_cpu

    path = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    try:
        rc = bench_cpu.main(["--tiny", "--synth", "2", "--max-new-tokens", "30", "--threads", "1",
                             "--json", str(path)])
    finally:
        torch.set_num_threads(threads)
    report = _last_json(capsys)
    assert rc == 0 and report == json.loads(path.read_text())
    assert report["documents"] == 2 and report["source"] == "synth"
    runs = report["results"]
    assert set(runs) == {"official", "plain", "lossless", "lossless-replay", "always-wrong"}
    assert all(r["exact"] and r["exact_jobs"] == 2 and r["tokens"] == 60 for r in runs.values())
    replay = runs["lossless-replay"]
    assert replay["tau"] > 5 and replay["forwards"] < runs["plain"]["forwards"]
    assert 0.9 <= replay["drafters"]["replay"]["acceptance"] <= 1.0  # a rate, not a sum of per-document rates


def test_bench_engine_planted_chain_keeps_bf16_drafts_aligned(capsys):
    """``--plant``: a wide-margin successor chain, so in bf16 a width-17 verify and single steps pick the same
    tokens: lossless with exact drafts equals plain and accepts whole drafts (tau 16 per round)."""
    threads = torch.get_num_threads()
    try:
        rc = bench_engine.main(["--tiny", "--quick", "--tokens", "200", "--rates", "0", "--dtype", "bf16",
                                "--plant", "30", "--mem-tokens", "20"])
    finally:
        torch.set_num_threads(threads)
    report = _last_json(capsys)
    assert rc == 0 and report["model"]["planted_chain_scale"] == 30
    runs = report["chunks"][0]["runs"]
    assert runs["lossless-0%"]["equal_to_plain"] and runs["lossless-0%"]["tau"] >= 15


def test_bench_replay_k_tiny_smoke(tmp_path, capsys):
    """Every re-run at every k is checked token-identical to the first decode inside the script (else it exits)."""
    from engine.tiny import build_tiny_model
    from scripts import bench_replay_k

    model = build_tiny_model(tmp_path / "tiny", sliding_window=8, seed=0)
    path = tmp_path / "replay.json"
    rc = bench_replay_k.main(["--model", str(model), "--device", "cpu", "--dtype", "float32", "--chunks", "1",
                              "--pages-per-chunk", "2", "--k", "4,16", "--max-new-tokens", "30", "--json", str(path)])
    report = _last_json(capsys)
    assert rc == 0 and report == json.loads(path.read_text())
    (chunk,) = report["chunks"]
    assert set(chunk["rerun"]) == {"4", "16"} and chunk["tokens"] > 0
    assert chunk["rerun"]["16"]["forwards"] <= chunk["rerun"]["4"]["forwards"]
